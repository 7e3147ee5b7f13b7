"""Property-based fuzzing of the public API on 2 real ranks.

The state machine, its invariants and the rank processes are in ``fuzz_machine``
and the modules it names. Two profiles run it: the CI one (short, derandomized, in
the default run) and the long one, left out of the default run::

    python -m pytest -m fuzz_long --fuzz-examples 200 --fuzz-steps 40 [--fuzz-seed S]

(also ``--fuzz-timeout`` seconds per call, default 60, and ``--fuzz-no-shrink``). It
prints what it did (examples, steps, calls by kind, refusals by error class, wall
time, failures); without ``--fuzz-seed`` its examples are new on every run.
The tests after the profiles check that the harness itself can fail: a state
change behind the manager's back, a hang and a dead rank are each reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_calls import Call, Outcome
from fuzz_machine import FuzzStats, make_machine, run_fuzz
from fuzz_server import RankFailure, RankServer
from fuzz_strategies import plain_setup
from hypothesis import HealthCheck, Phase, settings

# Reproducible in CI: the same examples every run, no example database.
CI_PROFILE = settings(
    max_examples=10,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server() -> Iterator[RankServer]:
    with RankServer(2, timeout_s=60.0) as ranks:
        yield ranks


@pytest.mark.slow
def test_api_fuzz_ci_profile(server: RankServer) -> None:
    stats = FuzzStats()
    run_fuzz(server, CI_PROFILE, stats)
    print(stats.report())
    assert not stats.failures
    assert stats.examples >= CI_PROFILE.max_examples
    assert stats.replays + stats.aborted == stats.examples  # every example was replayed
    # It refused bad input, and reached updates and loads of checkpoints.
    assert sum(stats.refusals.values()) > 0
    assert stats.reached["updates"] and stats.reached["loads"]


@pytest.mark.fuzz_long
@pytest.mark.slow
def test_api_fuzz_long_profile(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    option = request.config.getoption
    phases = tuple(Phase)
    if option("--fuzz-no-shrink"):
        phases = tuple(p for p in phases if p != Phase.shrink)
    profile = settings(
        max_examples=option("--fuzz-examples"),
        stateful_step_count=option("--fuzz-steps"),
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )
    stats = FuzzStats()
    seed = option("--fuzz-seed")
    try:
        with RankServer(2, timeout_s=option("--fuzz-timeout")) as ranks:
            run_fuzz(ranks, profile, stats, seed=seed)
    finally:
        with capsys.disabled():
            heading = f"fuzz: {profile.max_examples} examples x {profile.stateful_step_count}"
            print(f"\n{heading} steps, seed {seed}\n{stats.report()}")
    assert not stats.failures
    assert stats.examples >= profile.max_examples


def _machine(server: RankServer):
    """A machine driven by hand (no hypothesis): the default config, calls chosen here."""
    machine = make_machine(server, FuzzStats())()
    machine.open(plain_setup("gpt"))
    return machine


@pytest.mark.slow
def test_the_replay_notices_a_state_change_behind_the_managers_back(server: RankServer) -> None:
    machine = _machine(server)
    assert machine.model is not None
    machine._forward("good", machine.spec.orders[0], True)
    # Changes a master shard, and the machine records it as a call that succeeded
    # without changing anything: the fresh run cannot reproduce it.
    outcomes = server.request("call", Call("tamper"))
    assert all(o.ok for o in outcomes)
    assert any(k.endswith(".master") for k in outcomes[0].changed())
    machine.last = outcomes
    with pytest.raises(AssertionError, match=r"fresh run's state differs .*\.master"):
        machine.teardown()


OPEN_S = 120.0


@pytest.mark.slow
def test_a_hang_and_a_dead_rank_are_reported_and_the_ranks_restart(tmp_path: Path) -> None:
    setup = plain_setup("mlp", str(tmp_path))
    # A short deadline for the calls; opening (a manager's first build, imports
    # included) gets the time a loaded machine needs.
    with RankServer(2, timeout_s=3.0) as ranks:
        ranks.request("open", setup, timeout_s=OPEN_S)
        pids = list(ranks.pids)
        with pytest.raises(RankFailure, match="hang: rank 0") as hang:
            ranks.request("call", Call("hang"))
        # The report shows where each rank's threads were (the event loop itself
        # waits in its selector while the collective is in flight; the group's
        # launcher thread is among the others).
        assert "--- rank 0 stacks ---" in str(hang.value)
        assert "Thread 0x" in str(hang.value) and "launcher.py" in str(hang.value)
        assert not ranks.alive and ranks.pids == []
        ranks.request("open", setup, timeout_s=OPEN_S)  # fresh ranks
        assert ranks.starts == 2 and set(ranks.pids).isdisjoint(pids)
        with pytest.raises(RankFailure, match=r"exited|died"):
            ranks.request("call", Call("crash"))
        assert not ranks.alive


def test_the_per_call_checks_fail_on_changes_a_call_may_not_make() -> None:
    """The checks themselves, on outcomes written here (no ranks)."""
    machine = make_machine(RankServer(2), FuzzStats())()
    try:
        before = {"embed.master": "a", "embed.grad": "g", "pending": "None"}

        def outcome(ok: bool, result: object, **after: str) -> Outcome:
            error = None if ok else "ConfigError"
            return Outcome(ok, result, error, not ok, "bad lr", "", before, before | after)

        check = machine._check_unchanged
        check(Call("step", {"lr": 1e-3}), outcome(True, True, **{"embed.master": "b"}), 0)
        check(Call("forward"), outcome(True, {}, pending="('embed',)"), 0)
        with pytest.raises(AssertionError, match=r"refused call .*\['embed.grad'\]"):
            check(Call("step", {"lr": -1.0}), outcome(False, None, **{"embed.grad": "h"}), 0)
        with pytest.raises(AssertionError, match="did not update"):
            check(Call("step", {"lr": 1e-3}), outcome(True, False, **{"embed.master": "b"}), 0)
        with pytest.raises(AssertionError, match="a forward changed"):
            check(Call("forward"), outcome(True, {}, **{"embed.grad": "h"}), 0)
        with pytest.raises(AssertionError, match="only reads, saves"):
            check(Call("save", {"index": 0}), outcome(True, "step-0", **{"embed.master": "b"}), 0)
    finally:
        machine.teardown()
