"""A rank that stops answering or dies is named by every other rank within the
heartbeat's timeout, whatever the collective timeout; a slow but live rank is not.

Real processes are stopped (SIGSTOP) and killed (SIGKILL) at real points of
training (see ``rank_faults``); the collective timeout stays at 300 s, so only
the heartbeat can explain a detection within seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import assert_bitwise, run_named
from rank_faults import (
    FaultSpec,
    construction_run,
    faulty_run,
    read_record,
    rendezvous_fault,
    resumed_run,
    throttled_run,
)

from zero3_offload.comm.heartbeat import Heartbeat
from zero3_offload.testing import RankContext, run_ranks

HEARTBEAT_S = 1.0
# Far below the 300 s collective timeout; far above the heartbeat's own 1 s, so a
# loaded machine does not make the test flaky.
DETECTED_WITHIN_S = 30.0


def poll(find: Callable[[], str | None], within_s: float = 10.0) -> str | None:
    """``find()`` once it returns something, polled every 50 ms (None after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while (found := find()) is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the heartbeat's threads do the work meanwhile
    return found


def run_fault(tmp_path: Path, **fields: object) -> tuple[FaultSpec, list[dict | None]]:
    spec = FaultSpec(out=str(tmp_path), heartbeat_s=HEARTBEAT_S, **fields)  # type: ignore[arg-type]
    results = asyncio.run(run_ranks(faulty_run, 2, spec, may_die={spec.rank}, timeout_s=120))
    return spec, results


THROTTLED_STEPS = 2  # each throttled step waits 3 heartbeats: two show it every step


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Uninterrupted runs (rank 0's results) in one rank start: ``FaultSpec``'s steps, and
    ``THROTTLED_STEPS``."""
    root = tmp_path_factory.mktemp("reference")
    specs = {
        "full": FaultSpec(out=str(root / "full")),
        "throttled": FaultSpec(out=str(root / "throttled"), steps=THROTTLED_STEPS),
    }
    runs = run_named(2, {name: (faulty_run, spec) for name, spec in specs.items()})
    return {name: results[0] for name, results in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "rank", "phase", "named_as"),
    [
        ("stop", 1, "forward", "sent no heartbeat"),
        ("stop", 0, "backward", "is stopped: the rendezvous store it serves"),  # rank 0 hosts it
        ("kill", 1, "step", "has exited"),
        ("kill", 0, "forward", "has exited"),
    ],
)
def test_silent_or_dead_rank_is_named_within_seconds(
    tmp_path: Path, kind: str, rank: int, phase: str, named_as: str
) -> None:
    _, results = run_fault(tmp_path, kind=kind, rank=rank, phase=phase)
    survivor = 1 - rank
    fault = read_record(tmp_path, "fault")
    assert fault is not None, "the fault point was never reached"
    report = results[survivor]
    assert report is not None and report["error"] == "CommunicationError", report
    message = report["message"]
    assert f"rank {rank} (pid {fault['pid']}" in message
    assert named_as in message
    assert f"this rank ({survivor}) was waiting for" in message
    assert 0 <= report["detected_at"] - fault["at"] < DETECTED_WITHIN_S
    if kind == "stop" and rank == 1:
        assert "the process is stopped" in message


@pytest.mark.slow
def test_resume_after_a_stopped_save_is_bitwise(tmp_path: Path, references: dict) -> None:
    reference = references["full"]
    spec, results = run_fault(tmp_path, kind="stop", rank=1, phase="save")
    assert results[0] is not None and results[0]["error"] == "CommunicationError"
    resumed = asyncio.run(run_ranks(resumed_run, 2, spec, timeout_s=120))[0]
    # The save of step 2 never committed: the run resumes after step 1's checkpoint.
    assert resumed["first"] == spec.fault_step
    assert resumed["losses"] == reference["losses"][spec.fault_step :]
    assert_bitwise(resumed["state"], reference["state"])


@pytest.mark.slow
def test_throttled_rank_that_keeps_beating_never_trips(tmp_path: Path, references: dict) -> None:
    reference = references["throttled"]
    spec = FaultSpec(out=str(tmp_path), heartbeat_s=HEARTBEAT_S, steps=THROTTLED_STEPS)
    busy = 3 * HEARTBEAT_S
    results = asyncio.run(run_ranks(throttled_run, 2, spec, busy, timeout_s=120))
    # Rank 0 waited in the backward's collectives for longer than the heartbeat's
    # timeout, every step, and nothing was reported.
    assert min(results[0]["waited"]) > 2 * HEARTBEAT_S
    assert results[0]["losses"] == reference["losses"]
    assert_bitwise(results[0]["state"], reference["state"])


def test_heartbeat_names_a_rank_that_never_beats() -> None:
    store = dist.HashStore()
    live = Heartbeat(store, rank=0, world_size=3, key="t", timeout_s=0.5, store_host_rank=None)
    other = Heartbeat(store, rank=1, world_size=3, key="t", timeout_s=0.5, store_host_rank=None)
    Heartbeat(store, rank=2, world_size=3, key="t", timeout_s=0.5, store_host_rank=None)
    live.start()
    other.start()  # ranks 0 and 1 beat; rank 2 published itself and then went silent
    try:
        assert live.silent() is None
        found = poll(live.silent)
        assert found is not None
        assert "rank 2" in found and "sent no heartbeat" in found
        assert "rank 1" not in found
        other.close()  # a deliberate end is reported as such, not as silence
        closed = poll(lambda: s if "rank 1" in (s := live.silent() or "") else None)
        assert closed is not None and "rank 1 (" in closed and "has closed its manager" in closed
    finally:
        live.close()


def test_heartbeat_config_is_validated() -> None:
    from zero3_offload import ConfigError, Zero3CpuOffloadConfig

    assert Zero3CpuOffloadConfig().heartbeat_timeout_s == 5.0
    assert Zero3CpuOffloadConfig().divergence_check is True
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        Zero3CpuOffloadConfig(heartbeat_timeout_s=0)


async def managers_in_turn(ctx: RankContext, count: int) -> int:
    """Build, use and close ``count`` managers back to back on one group."""
    from helpers import make_model

    from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager

    built = 0
    model = make_model(d=8, n_blocks=1)
    for _ in range(count):
        manager = Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), ctx.group, model)
        await manager.close()
        built += 1
    return built


def test_many_managers_built_back_to_back_each_get_a_heartbeat() -> None:
    assert asyncio.run(run_ranks(managers_in_turn, 2, 100, timeout_s=120)) == [100, 100]


# ------------------------------------------- the rendezvous and the managers' construction


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "named_as"), [("kill", "has exited"), ("stop", "is stopped")])
def test_a_rank_lost_during_the_rendezvous_is_named(
    tmp_path: Path, kind: str, named_as: str
) -> None:
    # Ranks 0 and 1 of 3 wait for rank 2 in the rendezvous; rank 1 is lost meanwhile.
    found = rendezvous_fault(tmp_path, kind=kind, heartbeat_s=HEARTBEAT_S, timeout_s=120.0)
    report = found["record"]
    assert report is not None and report["error"] == "CommunicationError", report
    message = report["message"]
    assert "rank 1 (pid " in message
    assert named_as in message or "sent no heartbeat" in message
    assert "this rank (0) was waiting for every rank to join the gloo group" in message
    assert "rank 2" not in message  # not arrived yet: never blamed for silence
    assert 0 <= found["seconds"] < DETECTED_WITHIN_S  # the heartbeat, not the 120 s timeout


def test_ranks_that_never_arrive_are_named_at_the_timeout(tmp_path: Path) -> None:
    found = rendezvous_fault(tmp_path, kind="none", heartbeat_s=HEARTBEAT_S, timeout_s=3.0)
    report = found["record"]
    assert report is not None and report["error"] == "CommunicationError", report
    assert report["message"].startswith(
        "rank(s) 2 never reached the rendezvous store at 127.0.0.1:"
    )
    assert "within 3 s" in report["message"]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "named_as"), [("kill", "has exited"), ("stop", "is stopped")])
def test_a_rank_lost_before_its_manager_is_built_is_named(
    tmp_path: Path, kind: str, named_as: str
) -> None:
    # Rank 1 faults after the rendezvous, before its manager's construction starts: rank
    # 0 waits in its construction's first collectives, before its manager's own
    # heartbeat exists. The rendezvous' process heartbeat names rank 1.
    spec = FaultSpec(out=str(tmp_path), kind=kind, phase="before", heartbeat_s=HEARTBEAT_S)
    results = asyncio.run(
        run_ranks(
            construction_run, 2, spec, may_die={1}, timeout_s=120, heartbeat_timeout_s=HEARTBEAT_S
        )
    )
    fault = read_record(tmp_path, "fault")
    assert fault is not None
    report = results[0]
    assert report is not None and report["error"] == "CommunicationError", report
    message = report["message"]
    assert f"rank 1 (pid {fault['pid']}" in message
    assert named_as in message or "sent no heartbeat" in message
    assert "the divergence check's side group" in message or "the heartbeat's" in message
    assert 0 <= report["detected_at"] - fault["at"] < DETECTED_WITHIN_S
