"""Rank processes kept between tests: ``world_size`` processes joined to one group.

The processes come from the same ``forkserver`` as ``run_ranks``' (torch
imported once, one torch thread each); they rendezvous at a TCP store that this
process holds on a port the OS picked, so pools in other processes (pytest-xdist
workers) never compete for a port. The store and the ranks' gloo groups listen on
the loopback interface only. A test is written to a file of the pool's
directory and its path sent to every rank; each rank answers with a
:class:`~zero3_offload.testing.rank_task.RankOutcome`.

A pool that saw a failure, a crash or a timeout is killed: its processes may be
anywhere in a collective, so none of them runs another test.

[Note: rank stacks]
When a rank fails, the others get a short grace to report too; those still
running, or all ranks when the test times out, are asked where they are:
SIGUSR1 makes ``faulthandler`` write every thread's Python stack (it works even
while the main thread is blocked in C), SIGUSR2 makes the rank write where each
asyncio task is suspended, which is where a coroutine waits, then an end mark.
The stacks are read once the mark is there, or after a second at most.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist

from zero3_offload.comm.process_group import rendezvous_store
from zero3_offload.testing.rank_stacks import format_stacks
from zero3_offload.testing.rank_task import RankOutcome, RankTask
from zero3_offload.testing.rank_worker import STACKS_END, rank_files, serve
from zero3_offload.testing.run_ranks import process_context

__all__ = ["START_LIMIT_S", "PoolRun", "RankPool"]

# How long the other ranks may take to report once one rank failed or crashed, and how
# long a failed rank may take to format its report.
_GRACE_S = 1.0
_FORMAT_S = 30.0
# The least time ranks get to join the group and import the test's modules.
START_LIMIT_S = 120.0
_STACKS_WAIT_S = 1.0
_JOIN_S = 5.0


@attrs.frozen
class PoolRun:
    """The ranks' answers to one test.

    ``outcomes`` holds the ranks that answered (in the order they did) and the
    ranks that died (status ``"crashed"``); ``stacks`` the ranks still running
    at the end, with where they were; ``timed_out`` whether the test's time ran
    out, ``started`` whether every rank had started the test by then.
    """

    world_size: int
    outcomes: tuple[RankOutcome, ...]
    stacks: dict[int, str]
    timed_out: bool
    started: bool
    timeout_s: float
    outputs: dict[int, tuple[str, str]]

    @property
    def ok(self) -> bool:
        statuses = {o.status for o in self.outcomes}
        return (
            not self.stacks and not self.timed_out and statuses <= {"passed", "skipped", "xfailed"}
        )


class RankPool:
    """``world_size`` rank processes that run tests one after another."""

    def __init__(
        self,
        *,
        world_size: int,
        backend: str = "gloo",
        threads: int = 1,
        group_timeout_s: float = 3600.0,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.threads = threads
        self.group_timeout_s = group_timeout_s
        self.tests_run = 0
        self._dir = ""  # the pool's files, from start() until kill()
        self._store: dist.TCPStore | None = None
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._lifelines: list[Any] = []
        self._closed = False

    @property
    def usable(self) -> bool:
        return not self._closed and all(p.exitcode is None for p in self._procs)

    def start(self) -> None:
        """Start the rank processes; they join the group while the first test is sent."""
        ctx = process_context()
        self._dir = tempfile.mkdtemp(prefix="zero3-ranks-")
        self._store = rendezvous_store(  # on the loopback interface only
            "127.0.0.1",
            0,
            hosted=True,
            world_size=self.world_size,
            timeout_s=self.group_timeout_s,
        )
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe()
            watched, lifeline = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=serve,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    self.backend,
                    self.threads,
                    self.group_timeout_s,
                    theirs,
                    watched,
                    self._dir,
                ),
                name=f"zero3-rank{rank}",
                daemon=True,
            )
            self._procs.append(proc)
            self._tasks.append(ours)
            self._lifelines.append(lifeline)
            try:
                proc.start()  # an interrupt here leaves it unstarted (see kill())
            finally:
                theirs.close()
                watched.close()

    def run(self, task: RankTask, timeout_s: float) -> PoolRun:
        """Run ``task`` on every rank and wait for their outcomes.

        The test may run ``timeout_s`` from the moment every rank has started it
        (after joining the group and importing the test's modules, which may take
        up to ``max(timeout_s, 120)`` seconds).
        """
        if not self._procs:
            self.start()
        self.tests_run += 1
        path = Path(self._dir, f"test{self.tests_run}.pickle")
        path.write_bytes(pickle.dumps(task))
        for conn in self._tasks:
            conn.send_bytes(os.fsencode(path))
        answers = _Answers(self.world_size, timeout_s)
        while (until := answers.wait_until()) is not None:
            objects = {}
            for rank in answers.pending():
                objects[self._tasks[rank]] = rank
                objects[self._procs[rank].sentinel] = rank
            for obj in wait(list(objects), timeout=max(until - time.monotonic(), 0)):
                self._receive(objects[obj], answers)
        running = [r for r in answers.pending() if r not in answers.failing]
        return PoolRun(
            world_size=self.world_size,
            outcomes=answers.outcomes(),
            stacks=self._stacks(running) if running else {},
            timed_out=answers.timed_out,
            started=len(answers.started) == self.world_size,
            timeout_s=timeout_s,
            outputs=self._outputs(),
        )

    def _receive(self, rank: int, answers: _Answers) -> None:
        """Take what ``rank`` sent, or its end."""
        conn, proc = self._tasks[rank], self._procs[rank]
        try:
            while rank in answers.pending() and conn.poll():
                answers.take(rank, *pickle.loads(conn.recv_bytes()))
            return
        except (EOFError, OSError):
            pass  # the process ended (its end of the pipe closed)
        proc.join(0.1)  # its exit status follows its pipe's end
        if proc.exitcode is not None and rank in answers.pending():
            outcome = RankOutcome(rank=rank, status="crashed", message=_exit_reason(proc.exitcode))
            answers.take(rank, "outcome", outcome)

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` is (see [Note: rank stacks])."""
        paths = {r: rank_files(self._dir, r)[2] for r in ranks}
        alive = self._signal(ranks, signal.SIGUSR1)
        # The threads' stacks (written by faulthandler in its signal handler) are complete
        # before the tasks' are asked for: two writers of one file would interleave.
        settle = time.monotonic() + _STACKS_WAIT_S / 2
        sizes: dict[int, int] = {}
        while time.monotonic() < settle:
            now = {r: paths[r].stat().st_size if paths[r].exists() else 0 for r in alive}
            if all(now.values()) and now == sizes:
                break
            sizes = now
            time.sleep(0.02)  # polls the files faulthandler is writing
        self._signal(alive, signal.SIGUSR2)
        deadline = time.monotonic() + _STACKS_WAIT_S
        texts: dict[int, str] = {}
        while True:
            texts = {r: paths[r].read_text(errors="replace") for r in ranks}
            done = all(STACKS_END in t for t in texts.values())
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.02)  # polls a file the rank is writing, for a second at most
        return {r: format_stacks(t) for r, t in texts.items()}

    def _signal(self, ranks: list[int], sig: signal.Signals) -> list[int]:
        """Send ``sig`` to ``ranks``' processes; returns the ranks still alive."""
        alive = []
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, sig)
            except ProcessLookupError:
                continue
            alive.append(r)
        return alive

    def _outputs(self) -> dict[int, tuple[str, str]]:
        out = {}
        for rank in range(self.world_size):
            stdout, stderr, _ = rank_files(self._dir, rank)
            read = [p.read_text(errors="replace") if p.exists() else "" for p in (stdout, stderr)]
            out[rank] = (read[0], read[1])
        return out

    def close(self) -> None:
        """Ask the ranks to leave the group and end; kill any that do not."""
        if self._closed:
            return
        for conn in self._tasks:
            with contextlib.suppress(OSError):  # a rank that is gone already
                conn.send_bytes(b"")
        deadline = time.monotonic() + _JOIN_S
        for proc in self._started():
            proc.join(max(deadline - time.monotonic(), 0))
        self.kill()

    def kill(self) -> None:
        """End every rank process now (SIGKILL) and remove the pool's files."""
        if self._closed:
            return
        self._closed = True
        started = self._started()
        for proc in started:
            if proc.exitcode is None:
                proc.kill()
        for proc in started:
            proc.join(_JOIN_S)
        for conn in self._tasks + self._lifelines:
            conn.close()
        self._store = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _started(self) -> list[Any]:
        """The processes whose start returned. One whose start was interrupted (Ctrl-C while
        the forkserver was still starting) has no pid to signal; if the forkserver forks it
        after all, it ends once it finds its lifeline closed (``rank_worker``)."""
        return [proc for proc in self._procs if proc.pid is not None]


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code} before the test ended (os._exit, or a crash)"


class _Answers:
    """What the ranks of one test said so far, and how long to wait for the rest."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.started: set[int] = set()
        self.failing: dict[int, str] = {}  # rank -> its exception, before its report came
        self.timed_out = False
        self._outcomes: dict[int, RankOutcome] = {}
        self._order: list[int] = []  # ranks by when they first failed or answered
        self._start_by = time.monotonic() + max(timeout_s, START_LIMIT_S)
        self._test_by: float | None = None
        self._failed_at: float | None = None

    def pending(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self._outcomes]

    def take(self, rank: int, kind: str, value: Any = None) -> None:
        if kind == "started":
            self.started.add(rank)
            if len(self.started) == self.world_size:
                self._test_by = time.monotonic() + self.timeout_s
            return
        if rank not in self._order:
            self._order.append(rank)
        failed = kind == "failing" or value.status in ("failed", "crashed", "stale")
        if failed and self._failed_at is None:
            self._failed_at = time.monotonic()
        if kind == "failing":
            self.failing[rank] = value
        else:
            self._outcomes[rank] = value

    def wait_until(self) -> float | None:
        """When to stop waiting for the next answer; None when no answer is awaited."""
        pending = self.pending()
        if not pending:
            return None
        now = time.monotonic()
        if self._failed_at is None:
            until = self._test_by if self._test_by is not None else self._start_by
            if now >= until:
                self.timed_out = True
                return None
            return until
        # After a failure: a failing rank's report, and the others' answers for a grace.
        limits = [self._failed_at + (_FORMAT_S if r in self.failing else _GRACE_S) for r in pending]
        return max(limits) if max(limits) > now else None

    def outcomes(self) -> tuple[RankOutcome, ...]:
        """The outcomes in the order the ranks failed or answered; a failing rank whose
        report did not come in time is there with its exception alone."""
        late = {r: RankOutcome(rank=r, status="failed", message=m) for r, m in self.failing.items()}
        found = {**late, **self._outcomes}
        return tuple(found[r] for r in self._order if r in found)
