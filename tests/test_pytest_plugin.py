"""The pytest plugin (``@pytest.mark.ranks``) on inner pytest sessions (``pytester``).

- Under pytest-xdist (``-n 2``): a failing assert on rank 1 (the report names rank 1 and
  shows the rewritten assertion, explained as pytest explains it in its own process), a
  hang (timeout with stacks), ``os._exit`` and SIGKILL in one rank, ``ranks([1, 2, 3])``,
  fixtures (``tmp_path``, parameters, rank fixtures of a conftest), the manager fixture,
  pool reuse, pytest-asyncio alongside.
- Ctrl-C while the first ranks start and while a test runs: the session ends within 10 s.
- ``-x``, ``--lf``, ``-k``, ``-m``, pytest-asyncio's strict and auto modes, the ``cuda``
  mark and ``backend="nccl"``.
- The ``pytest11`` entry point and ``-p no:zero3_offload``.

After each, no rank process is left: the pids the ranks recorded are gone from ``/proc``,
and so is every process that carries the inner session's environment token.
"""

from __future__ import annotations

import importlib.metadata
import inspect

# pytester's in-process sessions forget the modules they imported, the forkserver's among them,
# and each would start a forkserver of its own (torch imported again), left running until this
# process ends: imported here, the module stays and they share one.
import multiprocessing.forkserver  # noqa: F401
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from zero3_offload.testing import RankContext, RankFailedError
from zero3_offload.testing.rank_runner import RankRunner

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "zero3_offload.testing.pytest_plugin"


def plugin_args() -> list[str]:
    """``-p`` for the plugin where the installed package predates its entry point."""
    names = {ep.name for ep in importlib.metadata.entry_points(group="pytest11")}
    return [] if "zero3_offload" in names else ["-p", PLUGIN]


def live(pids: dict[int, str]) -> list[int]:
    """The pids (with their start times) that are still a running process, per /proc."""
    alive = []
    for pid, started in pids.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and fields[19] == started:  # state, start time
            alive.append(pid)
    return alive


def recorded(directory: Path) -> dict[str, dict[int, str]]:
    """Test name -> {pid: start time} of its ranks, written by the inner ``pid_file``."""
    out: dict[str, dict[int, str]] = {}
    for file in sorted(directory.glob("*.pid")):
        pid, started = file.read_text().split()
        out.setdefault(file.name.rsplit("@", 1)[0], {})[int(pid)] = started
    return out


def with_token(token: str) -> list[int]:
    """Processes (zombies aside) whose environment holds ``ZERO3_PLUGIN_RUN=token``."""
    found = []
    needle = f"ZERO3_PLUGIN_RUN={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ and state != "Z":
            found.append(int(entry.name))
    return found


def left_after(check: Callable[[], list[int]], limit_s: float = 10.0) -> list[int]:
    """``check()`` until it finds no process, for ``limit_s`` at most (the ranks of a
    session that just ended may take a moment to be reaped)."""
    deadline = time.monotonic() + limit_s
    while (left := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def section(out: str, test: str) -> str:
    """The failure report of ``test`` in pytest's output."""
    found = re.search(
        rf"_{{3,}} {re.escape(test)} _{{3,}}\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", out, re.S
    )
    assert found, f"no failure report for {test}"
    return found[1]


INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
"""

CONFTEST = '''
import os
from pathlib import Path

import pytest

from zero3_offload.testing import rank_fixture


@pytest.fixture
def test_name(request):
    return request.node.name


@rank_fixture
def pid_file(rank, test_name):
    """A rank-side fixture of a conftest that uses an ordinary fixture: writes this rank's
    pid and start time to pids/<test>@<rank>.pid (whole: a file renamed into place)."""
    started = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    Path("pids").mkdir(exist_ok=True)
    written = Path("pids", f"{test_name}@{rank.rank}.part")
    written.write_text(f"{os.getpid()} {started}")
    written.replace(Path("pids", f"{test_name}@{rank.rank}.pid"))
    return os.getpid()
'''

PROC_CHECK = f"""
from pathlib import Path


{inspect.getsource(live)}

{inspect.getsource(recorded)}
"""

# Run in this order on one xdist worker (--dist loadfile).
FAILURES = """
import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from proc_check import live, recorded

from zero3_offload import Collectives

CPU = torch.device("cpu")


@pytest.mark.ranks(2)
async def test_assert_on_rank_1(rank, pid_file):
    if rank.rank == 0:
        await Collectives(rank.group, device=CPU).all_reduce_sum(torch.ones(1))  # waits for 1
    seen = [rank.rank, rank.world_size]
    assert seen == [0, 2]


def test_assert_in_the_pytest_process():
    seen = [1, 2]
    assert seen == [0, 2]


@pytest.mark.ranks(2, timeout=2)
async def test_hang(rank, pid_file):
    if rank.rank == 0:
        await asyncio.sleep(3600)  # a coroutine that waits
    threading.Event().wait()  # a rank blocked in C, its event loop with it


@pytest.mark.ranks(2)
async def test_exit_in_one_rank(rank, pid_file):
    if rank.rank == 1:
        os._exit(3)
    await asyncio.sleep(3600)


@pytest.mark.ranks(3)
def test_signal_in_one_rank(rank, pid_file):
    if rank.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier(rank.group)


def test_the_failed_tests_left_no_process():
    pids = recorded(Path("pids"))
    failed = ["test_assert_on_rank_1", "test_exit_in_one_rank", "test_hang",
              "test_signal_in_one_rank"]
    for test in failed:
        assert len(pids[test]) == (3 if "signal" in test else 2), test
        assert live(pids[test]) == [], test
"""

PASSING = """
import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero3_offload import Zero3CpuOffloadConfig
from zero3_offload.testing import rank_fixture


@pytest.mark.ranks([1, 2, 3])
async def test_world_sizes(rank, tmp_path, pid_file):
    assert dist.get_world_size(rank.group) == rank.world_size
    (tmp_path / f"rank{rank.rank}").write_text(str(pid_file))
    dist.barrier(rank.group)
    expected = [f"rank{r}" for r in range(rank.world_size)]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected


@rank_fixture
async def scaled(rank, scale):
    yield rank.rank * scale
    Path(f"torn-down-{rank.rank}-{scale}").write_text("")


@pytest.mark.parametrize("scale", [3, 5])
@pytest.mark.ranks(2)
async def test_parameters_and_rank_fixtures(rank, scale, scaled, pid_file):
    assert scaled == rank.rank * scale
    assert not Path(f"torn-down-{rank.rank}-{scale}").exists()


@pytest.mark.ranks(2, fresh=True)
def test_fresh_processes(rank, pid_file):
    print(f"rank {rank.rank} says hello")


def tiny_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


@pytest.mark.ranks(2)
@pytest.mark.zero3_manager(model=tiny_model)
async def test_manager_fixture_trains(rank, zero3_manager):
    names = zero3_manager.layer_names
    g = torch.Generator().manual_seed(rank.rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    losses = []
    for _ in range(5):
        out = (await zero3_manager.forward_pass(x, names)).requires_grad_()
        loss = ((out - y) ** 2).mean()
        loss.backward()
        await zero3_manager.backward_pass(out.grad, names)
        await zero3_manager.optimizer_step(learning_rate=1e-2)
        losses.append(loss.item())
    assert zero3_manager.world_size == 2
    assert losses[-1] < losses[0]


NVME = Zero3CpuOffloadConfig(offload_optimizer_device="nvme", nvme_path="tier")


@pytest.mark.ranks(2)
@pytest.mark.zero3_manager(model=tiny_model, config=NVME)
async def test_manager_fixture_closed_after_a_failure(rank, zero3_manager):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank.rank))
    out = await zero3_manager.forward_pass(x, zero3_manager.layer_names)
    assert Path("tier", f"rank{rank.rank}").is_dir()  # the manager's disk tier, held now
    assert out.shape == (4, 99)


async def test_pytest_asyncio_runs_the_other_tests():
    await asyncio.sleep(0)


@pytest.mark.ranks(2)
def test_leaves_a_collective_unmatched(rank, pid_file):
    if rank.rank == 0:
        dist.all_reduce(torch.ones(3), group=rank.group, async_op=True)  # never matched


@pytest.mark.ranks(2)
def test_after_an_unmatched_collective(rank, pid_file):
    value = torch.ones(1)
    dist.all_reduce(value, group=rank.group)
    assert value.item() == 2
"""


@pytest.mark.slow
def test_failures_timeouts_crashes_and_fixtures_under_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = uuid.uuid4().hex
    monkeypatch.setenv("ZERO3_PLUGIN_RUN", token)
    monkeypatch.setenv("COLUMNS", "200")  # whole lines in the short summary
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_failures=FAILURES, test_passing=PASSING, proc_check=PROC_CHECK)
    result = pytester.runpytest_subprocess(
        *plugin_args(), "-n", "2", "--dist", "loadfile", "-o", "asyncio_mode=auto", "-rfE",
        timeout=600,
    )  # fmt: skip
    out = result.stdout.str()
    result.assert_outcomes(passed=11, failed=6)
    assert "created: 2/2 workers" in out

    # A failing assert on rank 1: named, rewritten as pytest shows it, and where rank 0 was.
    report = section(out, "test_assert_on_rank_1")
    assert ">       assert seen == [0, 2]" in report
    assert "E       assert [1, 2] == [0, 2]" in report
    # The comparison explained as pytest explains the same assertion in its own process,
    # whatever its wording in the installed pytest.
    explained = [line for line in report.splitlines() if line.startswith("E")]
    expected = section(out, "test_assert_in_the_pytest_process").splitlines()
    expected = [line for line in expected if line.startswith("E")]
    assert expected[0] == "E       assert [1, 2] == [0, 2]" and len(expected) > 1, expected
    assert explained == expected
    assert "rank 1 of 2 failed (the traceback above is its own)" in report
    assert re.search(r"rank 0: had not finished; where it was:\n(.*\n)*.*all_reduce_sum", report)
    summary = "FAILED test_failures.py::test_assert_on_rank_1 - [rank 1] assert [1, 2] == [0, 2]"
    assert summary in out

    # A hang: the timeout, and each rank's stack (a waiting coroutine, a blocked thread).
    report = section(out, "test_hang")
    assert "ranks [0, 1] of 2 did not finish within 2 s" in report
    assert re.search(
        r"rank 0: was still running; where it was:\n\s+asyncio task .*\n(.*\n)*?"
        r".*line \d+, in test_hang\n\s+await asyncio.sleep\(3600\)",
        report,
    )
    assert re.search(
        r"rank 1: was still running; where it was:\n\s+thread 0x\w+:\n(.*\n)*?"
        r".*line \d+, in test_hang\n\s+threading.Event\(\).wait\(\)",
        report,
    )

    # A rank that ends (os._exit) or is killed: named as such, and what the others did.
    report = section(out, "test_exit_in_one_rank")
    assert "rank 1 of 2 exited with code 3 before the test ended" in report
    assert "rank 0: had not finished; where it was:" in report
    assert "await asyncio.sleep(3600)" in report
    report = section(out, "test_signal_in_one_rank")
    assert "rank 2 of 3 killed by SIGKILL" in report
    for rank in (0, 1):  # they were in a barrier with rank 2: it failed, or had not yet
        assert re.search(rf"rank {rank}: (failed too|had not finished)", report)

    # The manager fixture closed the manager after the failing test: its disk tier is gone.
    report = section(out, "test_manager_fixture_closed_after_a_failure")
    assert "E       assert torch.Size([4, 8]) == (4, 99)" in report
    assert list((pytester.path / "tier").iterdir()) == []

    # ranks([1, 2, 3]): one test per world size; each rank saw the same tmp_path (asserted
    # inside). Rank fixtures were torn down after each test, in each rank.
    pids = recorded(pytester.path / "pids")
    sizes = {t: len(p) for t, p in pids.items() if t.startswith("test_world_sizes")}
    assert sizes == {f"test_world_sizes[ranks{n}]": n for n in (1, 2, 3)}
    torn = sorted(p.name for p in pytester.path.glob("torn-down-*"))
    assert torn == ["torn-down-0-3", "torn-down-0-5", "torn-down-1-3", "torn-down-1-5"]
    # Two-rank tests of one worker shared their processes, but fresh=True started new ones.
    assert pids["test_parameters_and_rank_fixtures[3]"] == pids["test_world_sizes[ranks2]"]
    assert pids["test_parameters_and_rank_fixtures[5]"] == pids["test_world_sizes[ranks2]"]
    assert not set(pids["test_fresh_processes"]) & set(pids["test_world_sizes[ranks2]"])
    # A passing test left a collective unmatched: the group failed its check before the next
    # test, which ran on new processes.
    unmatched = set(pids["test_leaves_a_collective_unmatched"])
    assert not unmatched & set(pids["test_after_an_unmatched_collective"])

    # Nothing of the session is left: no rank, no forkserver, no xdist worker.
    for test, ranks in pids.items():
        assert live(ranks) == [], test
    assert left_after(lambda: with_token(token)) == []


HANG = """
import asyncio

import pytest


@pytest.mark.ranks(2)
async def test_waits_for_ever(rank, pid_file):
    await asyncio.sleep(3600)
"""

# A terminal's Ctrl-C signals its foreground job, whose SIGINT is at its default; a pytest that a
# shell without job control started in the background (``pytest &`` in a script) has SIGINT
# ignored, and its subprocesses inherit that. The inner sessions start with the default.
DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
CTRL_C_LIMIT_S = 10.0


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*(\w+)$", status, re.M)[1], 16)
    return bool(caught >> (sig - 1) & 1)


def commands(pids: list[int]) -> dict[int, str]:
    """The command line of each of ``pids`` that still exists."""
    found = {}
    for pid in pids:
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


class InterruptedSession:
    """An inner pytest session in a directory and process group of its own, running ``HANG``,
    that gets SIGINT at ``moment``: ``"starting"`` once its forkserver exists (it is importing
    torch for the first ranks), ``"running"`` once its 2 ranks run the test."""

    def __init__(self, pytester: pytest.Pytester, moment: str) -> None:
        self.moment = moment
        self.token = uuid.uuid4().hex
        self.path = pytester.mkdir(moment)
        (self.path / "pytest.ini").write_text(INI)
        (self.path / "conftest.py").write_text(CONFTEST)
        (self.path / "test_hang.py").write_text(HANG)
        self.output = self.path / "output.txt"
        self.interrupted: float | None = None
        self.ended_s: float | None = None
        env = {**os.environ, "ZERO3_PLUGIN_RUN": self.token}
        env["PYTHONPATH"] = os.pathsep.join([str(self.path), env.get("PYTHONPATH", "")])
        # hypothesis' plugin imports hypothesis as a session ends (seconds of CPU where bytecode
        # is not cached), which is not this plugin's to answer for.
        cmd = [
            sys.executable, "-c", DEFAULT_SIGINT, "-m", "pytest", *plugin_args(),
            "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
        ]  # fmt: skip
        with self.output.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=self.path, env=env, start_new_session=True, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def ranks(self) -> dict[str, dict[int, str]]:
        return recorded(self.path / "pids")

    def step(self) -> bool:
        """Interrupt the session when its moment has come, and note when it ended; True once
        it ended after the interrupt. Fails when it ended before, or did not end in time."""
        if self.ended_s is not None:
            return True
        now = time.monotonic()
        if self.interrupted is None:
            assert self.proc.poll() is None, self.output.read_text()
            if self.moment == "starting":
                ready = any("multiprocessing.forkserver" in c for c in self.processes().values())
            else:
                ready = len(self.ranks().get("test_waits_for_ever", {})) == 2
            if ready:
                assert catches(self.proc.pid, signal.SIGINT)
                os.killpg(self.proc.pid, signal.SIGINT)
                self.interrupted = now
            return False
        if self.proc.poll() is not None:
            self.ended_s = now - self.interrupted
            return True
        if now - self.interrupted > CTRL_C_LIMIT_S:
            left = "\n".join(f"{pid}: {c[:120]}" for pid, c in self.processes().items())
            pytest.fail(
                f"{self.moment}: the session did not end within {CTRL_C_LIMIT_S:g} s of SIGINT;"
                f" its processes:\n{left}\n{self.output.read_text()}"
            )
        return False

    def processes(self) -> dict[int, str]:
        return commands(with_token(self.token))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.mark.slow
def test_ctrl_c_ends_the_session_and_leaves_no_process(pytester: pytest.Pytester) -> None:
    """Two sessions at once, one interrupted while its first ranks start, one while a test
    runs: each ends, interrupted, within 10 s of the SIGINT, and no process of it is left."""
    sessions = [InterruptedSession(pytester, moment) for moment in ("starting", "running")]
    try:
        deadline = time.monotonic() + 300
        while not all([s.step() for s in sessions]):
            assert time.monotonic() < deadline, "a session never came to its moment"
            time.sleep(0.02)
    finally:
        for session in sessions:
            session.kill()
    for session in sessions:
        print(f"ctrl-c ({session.moment}): the session ended {session.ended_s:.2f} s after SIGINT")
        out = session.output.read_text()
        assert session.proc.returncode == pytest.ExitCode.INTERRUPTED, out
        assert "KeyboardInterrupt" in out
    starting, running = sessions
    assert starting.ranks() == {}, starting.output.read_text()  # no rank had started a test
    ranks = running.ranks()["test_waits_for_ever"]
    assert left_after(lambda: live(ranks)) == []
    for session in sessions:
        assert left_after(lambda s=session: with_token(s.token)) == []


OPTIONS = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks(2)
def test_fails_on_rank_1(rank):
    assert rank.rank == 0


@pytest.mark.ranks([1, 2])
async def test_world_sizes(rank):
    assert dist.get_world_size(rank.group) == rank.world_size


@pytest.mark.slow
@pytest.mark.ranks(1)
def test_slow(rank):
    pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.ranks(1)
def test_cuda(rank):
    assert torch.ones(1, device="cuda").item() == 1


@pytest.mark.ranks(2, backend="nccl")
def test_nccl(rank):
    value = torch.ones(1, device="cuda")
    dist.all_reduce(value, group=rank.group)
    assert value.item() == 2
"""


@pytest.mark.slow
def test_selection_options_marks_and_asyncio_modes(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI + "markers =\n    slow: slow\n")
    pytester.makepyfile(test_options=OPTIONS)

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest_inprocess(*plugin_args(), "--strict-markers", *args)

    result = run("-x")  # strict mode (pytest-asyncio's default)
    result.assert_outcomes(failed=1)
    assert "stopping after 1 failures" in result.stdout.str()
    result = run("--lf")
    result.assert_outcomes(failed=1)
    assert "run-last-failure: rerun previous 1 failure" in result.stdout.str()

    gpus = torch_cuda_devices()
    result = run("-m", "not slow", "-k", "not fails", "-o", "asyncio_mode=auto", "-rs")
    result.assert_outcomes(passed=2 + (gpus >= 1) + (gpus >= 2), skipped=(gpus < 1) + (gpus < 2))
    if gpus < 2:
        assert f"backend='nccl' needs 2 CUDA devices (one per rank), found {gpus}" in (
            result.stdout.str()
        )


def torch_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.slow
def test_the_entry_point_loads_the_plugin_and_p_no_turns_it_off(
    pytester: pytest.Pytester,
) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    table = re.search(r"^\[project\.entry-points\.pytest11\]\n(.*?)(?=^\[)", pyproject, re.M | re.S)
    assert re.findall(r'^(\w+) = "(.*)"$', table[1], re.M) == [("zero3_offload", PLUGIN)]
    # A distribution on sys.path with that entry point, as an install writes it.
    dist_info = pytester.mkdir("site") / "zero3_offload_entry_point-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Name: zero3-offload-entry-point\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(f"[pytest11]\nzero3_offload = {PLUGIN}\n")
    pytester.syspathinsert(pytester.path / "site")
    pytester.makeini(INI)
    pytester.makepyfile(
        test_one="import pytest\n\n@pytest.mark.ranks(1)\ndef test_x(rank):\n    pass\n"
    )

    result = pytester.runpytest_inprocess("--markers")
    assert "@pytest.mark.ranks(n, *, timeout=None" in result.stdout.str()
    pytester.runpytest_inprocess().assert_outcomes(passed=1)
    result = pytester.runpytest_inprocess("-p", "no:zero3_offload", "--markers")
    assert "@pytest.mark.ranks" not in result.stdout.str()
    result = pytester.runpytest_inprocess("-p", "no:zero3_offload")
    result.assert_outcomes(errors=1)
    assert "fixture 'rank' not found" in result.stdout.str()


@pytest.mark.slow
def test_the_docs_example_passes(pytester: pytest.Pytester) -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    files = dict(re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", page, re.S))
    assert sorted(files) == ["conftest.py", "test_training.py"]
    for name, text in files.items():
        (pytester.path / name).write_text(text)
    pytester.makeini(INI)
    pytester.runpytest_inprocess(*plugin_args()).assert_outcomes(passed=3)


async def where(ctx: RankContext, tag: str) -> tuple[int, int, str, int]:
    return ctx.rank, ctx.world_size, tag, os.getpid()


async def refuse_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    return ctx.rank


def test_rank_runner_runs_functions_on_the_sessions_processes(rank_runner: RankRunner) -> None:
    first = rank_runner.run(where, 2, "a")
    assert [r[:3] for r in first] == [(0, 2, "a"), (1, 2, "a")]
    ranks = {
        r[3]: Path(f"/proc/{r[3]}/stat").read_text().rsplit(")", 1)[1].split()[19] for r in first
    }
    again = rank_runner.run(where, 2, "b")
    assert [r[3] for r in again] == [r[3] for r in first]  # the same processes
    with pytest.raises(RankFailedError) as info:
        rank_runner.run(refuse_on_rank_1, 2)
    assert "rank 1 failed:" in str(info.value)
    assert 'raise ValueError("rank 1 refuses")' in str(info.value)  # its traceback
    after = rank_runner.run(where, 2, "c")
    assert not {r[3] for r in after} & {r[3] for r in first}  # a failure ends the processes
    assert left_after(lambda: live(ranks)) == []


TRIVIAL = """
@pytest.mark.ranks(2)
def test_trivial_{i}(rank):
    value = torch.ones(1)
    dist.all_reduce(value, group=rank.group)
    assert value.item() == 2
"""


@pytest.mark.measure
def test_pool_reuse_speed(pytester: pytest.Pytester) -> None:
    """50 trivial 2-rank tests, the processes reused or new for each (ranks_reuse)."""
    head = "import pytest\nimport torch\nimport torch.distributed as dist\n"
    pytester.makepyfile(test_trivial=head + "".join(TRIVIAL.format(i=i) for i in range(50)))
    pytester.makeini(INI)
    pytester.runpytest_inprocess(*plugin_args(), "-k", "trivial_0")  # the forkserver starts
    per_test = {}
    for reuse in ("true", "false"):
        started = time.perf_counter()
        result = pytester.runpytest_inprocess(
            *plugin_args(), "-o", f"ranks_reuse={reuse}", "--durations=0", "--durations-min=0"
        )
        session = time.perf_counter() - started
        result.assert_outcomes(passed=50)
        calls = sorted(float(s) for s in re.findall(r"([\d.]+)s call ", result.stdout.str()))
        per_test[reuse] = (session / 50, calls[len(calls) // 2])
        print(f"ranks_reuse={reuse}: {session:.1f} s for 50 tests, {session / 50:.3f} s per "
              f"test, median call {calls[len(calls) // 2]:.3f} s")  # fmt: skip
    assert per_test["true"][1] < per_test["false"][1] / 5  # the median test
