"""Awaitable collectives over one process group (the Rust module's ``mod.rs`` only waits
where these run).

Every collective is launched with ``async_op=True``; its completion is delivered
to the event loop through the work's future (or, for ops whose backend work
gives none, such as gloo's reduce-scatter, by the group's waiter thread), so the loop
keeps running other tasks (prefetches, CPU work) while the collective is in
flight. A collective that does not complete within the timeout raises
:class:`CommunicationError` naming the op and the group.

Launching is off the loop too: some backends do real work when a collective
is launched (gloo's reduce-scatter of a 250 MB buffer spends about half a
second in the launch call), so every launch is handed, in program order, to
one *launcher thread* per group, which calls the backend in that same order on
every rank. On CUDA the launch runs on the stream that was current where
``start_*`` was called. Code outside the library may call torch.distributed on
the same group directly (a loss all-reduce, transformers' ``synced_gpus``), so
before control returns to such code the queue is flushed (:meth:`Collectives.flush`):
every collective queued so far has been launched.

Liveness and agreement (issue-level guarantees of the group): with a
:class:`~zero3_offload.comm.heartbeat.Heartbeat` (``heartbeat_timeout_s``),
every wait also watches the other ranks, and a rank that stops answering is
named within that time, whatever ``timeout_s`` allows a collective (see
[Note: heartbeat]); with ``verify``, before the first collective of each call
(each :meth:`Collectives.call_context`) the ranks check that they are all
about to run the same one in the same call (see [Note: divergence check]).
After a collective fails, times out or finds a silent rank, the group's
sequence of collectives is broken: every later collective raises at once.
Every wait, on the event loop or on another thread, follows the same rules
(see [Note: one wait] in ``comm.wait``).

Backend differences are settled once per group, by capability, in
:class:`Collectives`: which tensor-level all-gather / reduce-scatter functions the
installed torch offers, whether the backend accepts ``ReduceOp.AVG`` for
reduce-scatter, and whether a CPU group can all-to-all (then a CPU
reduce-scatter runs as one: see [Note: reduce-scatter by exchange] in
``comm.exchange``). Nothing else in the library looks at the backend's name.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

import attrs
import torch
import torch.distributed as dist

from zero3_offload.comm.catch_up import OutOfReach, catch_up
from zero3_offload.comm.divergence import DivergenceCheck
from zero3_offload.comm.exchange import BufferLender, ExchangeReduceScatter
from zero3_offload.comm.failure_report import FailureReport
from zero3_offload.comm.heartbeat import Heartbeat
from zero3_offload.comm.launcher import Launcher
from zero3_offload.comm.shared_memory import HostSharedMemory
from zero3_offload.comm.wait import CollectiveWait, group_label
from zero3_offload.comm.waiter import Waiter
from zero3_offload.errors import CommunicationError, Zero3Error

__all__ = ["Collectives", "PendingCollective"]

T = TypeVar("T")

_SETTLE_POLL_S = 0.005  # how often a recovery looks whether the launcher settled
_MEETING = "abandon the failed call"


@attrs.frozen
class _Capabilities:
    """What the installed torch and this group's backend support, probed once."""

    all_gather: Callable[..., Any]  # (output, input, group=, async_op=) -> Work
    reduce_scatter: Callable[..., Any]  # (output, input, op=, group=, async_op=) -> Work
    reduce_scatter_avg: bool  # backend accepts ReduceOp.AVG for reduce-scatter
    # CPU group: reduce-scatter by all_to_all_single and a local sum (see
    # [Note: reduce-scatter by exchange])
    exchange: bool


def _probe(group: dist.ProcessGroup, device: torch.device) -> _Capabilities:
    # torch >= 2.13 names the tensor collectives *_single; older releases
    # only have *_into_tensor / *_tensor (same signature).
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    world = group.size()
    probe_in = torch.ones(world, device=device)
    probe_out = torch.empty(1, device=device)
    try:
        reduce_scatter(probe_out, probe_in, op=dist.ReduceOp.AVG, group=group)
        avg = True
    except (RuntimeError, ValueError, NotImplementedError):
        # Every rank fails the same way before any data moves, so the group
        # stays consistent; SUM followed by a division is used instead.
        avg = False
    exchange = False
    if device.type == "cpu":
        try:
            dist.all_to_all_single(torch.empty(world), probe_in.cpu(), group=group)
            exchange = True
        except (RuntimeError, ValueError, NotImplementedError):
            # As above: every rank fails alike; the backend's reduce-scatter is used.
            exchange = False
    return _Capabilities(
        all_gather=all_gather,
        reduce_scatter=reduce_scatter,
        reduce_scatter_avg=avg,
        exchange=exchange,
    )


class _DoneWork:
    """The record of a collective that ran to completion in its launch (one through
    the host's shared memory)."""

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(None)

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class PendingCollective(Generic[T]):
    """A collective handed to the launcher; :meth:`wait` may be awaited any number of times.

    Collectives are queued in program order and launched in that order by the
    group's launcher thread, so every rank issues them in the same order
    whatever the event loop schedules; the launch and the waiting are both off
    the event loop. A wait returns the collective's value (an agreement's
    verdict; None for the others).
    """

    def __init__(
        self,
        *,
        op: str,
        launched: concurrent.futures.Future[Any],
        nbytes: int,
        comm: Collectives,
        what: str = "",
        value: Callable[[], T] | None = None,
    ) -> None:
        self.op = op
        self.nbytes = nbytes
        self.what = what
        self._launched: concurrent.futures.Future[Any] | None = launched  # -> the backend's Work
        self._comm = comm
        # The rules of the group's epoch it started in: a collective abandoned with a
        # failed call no longer breaks the group once the ranks recovered from it.
        self._wait = comm._wait
        self._epoch = comm._epoch
        self._value = value
        self._after: list[Callable[[], object]] = []
        self._started = time.perf_counter()
        self._done: concurrent.futures.Future[None] | None = None
        self._finished = False
        self.seconds: float | None = None  # launch-to-completion time, once done
        self.completed_at: float | None = None  # time.perf_counter() at completion

    def is_completed(self) -> bool:
        """Whether the collective has finished (without waiting)."""
        launched = self._launched
        if self._finished or launched is None:
            return self._finished
        if not launched.done() or launched.exception() is not None:
            return False
        return bool(launched.result().is_completed())

    def then(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` right after the collective completes, on the thread that waited
        for it (the event loop's, for :meth:`wait`)."""
        self._after.append(fn)

    def _completion(self) -> concurrent.futures.Future[None]:
        """Settled, from the launcher, a backend or the waiter thread, once the
        collective completed or failed."""
        if self._done is None:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()

            def settle(exc: BaseException | None) -> None:
                if exc is None:
                    done.set_result(None)
                else:
                    done.set_exception(exc)

            def on_launched(launched: concurrent.futures.Future[Any]) -> None:
                # On the launcher thread (or here, when already launched).
                exc = launched.exception()
                if isinstance(exc, Zero3Error):  # e.g. the ranks diverged: as it is
                    settle(exc)
                elif exc is not None:
                    settle(RuntimeError(f"failed to start: {exc}"))
                else:
                    self._comm._waiter.when_done(self.op, launched.result(), settle)

            assert self._launched is not None
            self._launched.add_done_callback(on_launched)
            self._done = done
        return self._done

    def _label(self) -> str:
        what = f" ({self.what})" if self.what else ""
        return f"{self.op} of {self.nbytes} bytes{what} on the {group_label(self._comm.group)}"

    async def wait(self) -> T:
        """Wait for completion without blocking the event loop; returns the value.

        Raises:
            CommunicationError: on failure, when ``timeout_s`` passes first, or when
                the heartbeat finds a rank silent (the message names it).
            RankDivergenceError: when the ranks were about to run different collectives.
        """
        if self._abandoned():
            self._finish_abandoned()
        if not self._finished:
            await self._wait.until_done(self._completion(), self._label())
            self._finish(observe=True)
        return self._result()

    def wait_blocking(self) -> T:
        """:meth:`wait` on this thread, for code that cannot await (constructors, the
        model's thread): the same rules (see [Note: one wait]). Not reported to the
        observer: the collectives of set-up are not the training's communication."""
        if self._abandoned():
            self._finish_abandoned()
        if not self._finished:
            self._wait.until_done_blocking(self._completion(), self._label())
            self._finish(observe=False)
        return self._result()

    def _abandoned(self) -> bool:
        """Whether the collective was abandoned with a failed call the ranks recovered
        from: it completed then on every rank, or never started on any."""
        return not self._finished and self._epoch < self._comm._epoch

    def _finish_abandoned(self) -> None:
        # Its buffers are free now; what it computed is nobody's any more.
        self._finished = True
        self._launched = None
        after, self._after = self._after, []
        for fn in after:
            fn()

    def _result(self) -> T:
        return cast(T, None) if self._value is None else self._value()

    def _finish(self, *, observe: bool) -> None:
        if self._finished:  # another waiter finished it meanwhile
            return
        self._finished = True
        assert self._launched is not None
        # Orders the current CUDA stream after NCCL's; a no-op on gloo.
        self._launched.result().wait()
        # Drop the Work now: it holds the backend's buffers for the op (gloo
        # keeps full-size staging copies), which would otherwise live as long
        # as this object, e.g. until the end of a backward pass.
        self._launched = None
        self.completed_at = time.perf_counter()
        self.seconds = self.completed_at - self._started
        observer = self._comm._observer
        if observe and observer is not None:
            observer(self.op, self.seconds, self.nbytes)
        after, self._after = self._after, []  # the callbacks hold the op's tensors
        for fn in after:
            fn()


class Collectives:
    """Awaitable collectives over one process group.

    Construction is a collective: every rank of ``group`` builds this object
    together (it runs a probe, and agrees on the heartbeat's keys).

    Args:
        group: the process group.
        device: device of the tensors passed to the collectives.
        timeout_s: how long to wait for one collective before raising.
        heartbeat_timeout_s: with a value, a :class:`Heartbeat` watches the other
            ranks, and a wait raises naming a rank silent this long (see
            [Note: heartbeat]); None: only ``timeout_s`` bounds a wait.
        verify: check before the first collective of each call that every rank
            is about to run the same one (see [Note: divergence check]).
        shared_memory_block_bytes: on a CPU group whose ranks share a host, move the
            data of all-gathers and reduce-scatters through a shared-memory region
            with blocks of this many bytes (see [Note: shared-memory collectives]);
            None: through the backend.
        observer: called as ``observer(op, seconds, nbytes)`` when an awaited
            collective completes (:meth:`PendingCollective.wait`).
        startup_heartbeat: watches the other ranks while this object's own heartbeat
            starts (``comm.process_group.joined_heartbeat``: the process heartbeat of
            the default group); None: only ``timeout_s`` bounds that start.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        device: torch.device,
        timeout_s: float = 300.0,
        heartbeat_timeout_s: float | None = None,
        verify: bool = False,
        shared_memory_block_bytes: int | None = None,
        observer: Callable[[str, float, int], None] | None = None,
        startup_heartbeat: Heartbeat | None = None,
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.device = device
        self.timeout_s = timeout_s
        # What the caller is doing, in words that must agree on every rank (the
        # public call, its arguments, the step): part of every collective's
        # description; each change starts a segment (see [Note: divergence check]).
        self._context = "setup"
        self._segment = 0
        self._observer = observer
        self._broken: Zero3Error | None = None  # the failure that ended the sequence
        self._epoch = 0  # failed calls recovered from (see recover())
        # Completions of the collectives started, by start index, until they settle:
        # a recovery completes those every rank launched (see [Note: failure channel]).
        self._inflight: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        self._inflight_first = 0  # start index of self._inflight[0]
        self._started = 0
        self.filled = 0  # collectives run to complete other ranks' abandoned ones
        self._verify = verify
        self._block_bytes = shared_memory_block_bytes
        self._launcher = Launcher(f"zero3-launch-{self.rank}", None)
        self._waiter = Waiter(f"zero3-wait-{self.rank}")
        self.shared_memory: HostSharedMemory | None = None
        # The heartbeat's own start-up is waited for with the process heartbeat of
        # the default group, when there is one (see [Note: watched rendezvous]).
        self._wait = CollectiveWait(
            rank=self.rank,
            timeout_s=timeout_s,
            heartbeat=startup_heartbeat,
            waiting_for=self._waiting_for,
            fail=functools.partial(self._fail_in, 0),
        )
        if self._verify and self.world_size > 1:
            self._launcher.check = self._divergence_check(group)
        self.heartbeat: Heartbeat | None = None
        if heartbeat_timeout_s is not None and self.world_size > 1:
            key, start = "the heartbeat's key", "the heartbeat's start"
            self.heartbeat = Heartbeat.open(
                group,
                device=device,
                timeout_s=heartbeat_timeout_s,
                broadcast=lambda t: self.start_broadcast(t, what=key).wait_blocking(),
                agree=lambda ok: self.start_agree(ok, what=start).wait_blocking(),
            )
            self._wait = attrs.evolve(self._wait, heartbeat=self.heartbeat)
        # The probe runs collectives of its own: on the launcher thread, waited for by
        # the group's rules, so a rank that died meanwhile is named (heartbeat on).
        probe = "the backend's probe"
        probed = self._launcher.submit(functools.partial(_probe, group, device), what=probe)
        self._caps: _Capabilities = self._wait.until_done_blocking(probed, probe)
        self._exchange = ExchangeReduceScatter(group)
        self._open_shared_memory()

    def _divergence_check(self, group: dist.ProcessGroup) -> DivergenceCheck:
        """The divergence check of ``group``: its side group is built by every rank
        together, on the launcher thread, waited for by the group's rules."""
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        what = "the divergence check's side group"
        made = self._launcher.submit(
            lambda: DivergenceCheck(group, all_gather=all_gather, timeout_s=self.timeout_s),
            what=what,
        )
        return self._wait.until_done_blocking(made, what)

    def _open_shared_memory(self) -> None:
        block = self._block_bytes
        if block is not None and self.device.type == "cpu" and self.world_size > 1:
            what = "the shared-memory region"
            self.shared_memory = HostSharedMemory.open(
                self.group,
                block_bytes=block,
                broadcast=lambda t: self.start_broadcast(t, what=what).wait_blocking(),
                agree=lambda ok: self.start_agree(ok, what=what).wait_blocking(),
            )

    def known_failure(self) -> FailureReport | None:
        """The failure report of the current epoch (some rank's call failed), if known."""
        return None if self.heartbeat is None else self.heartbeat.failure()

    def publish_failure(self, report: FailureReport) -> FailureReport:
        """Publish this rank's failed call (see [Note: failure channel]); returns the
        epoch's first report (another rank's, when it came first)."""
        assert self.heartbeat is not None
        return self.heartbeat.publish_failure(report)

    def recover(self, state: str) -> list[str]:
        """Abandon the failed call's collectives on every rank and make the group usable
        again (a meeting of every rank; on a thread other than the event loop's).

        Nothing more is launched; the ranks meet with what each launched and with
        ``state`` (where its training state stands); a rank that launched fewer
        collectives than another launches the same ones (same op, size and dtype, on
        scratch tensors) so that every collective of the call completes on every
        rank, and the sequence goes on as one (see [Note: failure channel]).

        Returns:
            Every rank's ``state``, in rank order.

        Raises:
            CommunicationError: when a rank is silent or does not come, or the
                abandoned collectives could not be completed (the group stays broken).
        """
        beat, launcher = self.heartbeat, self._launcher
        assert beat is not None
        launcher.cancel()
        deadline = time.monotonic() + self.timeout_s
        mine = {"launched": launcher.launched, "log": list(launcher.log), "state": state}
        records = [
            json.loads(r)
            for r in beat.meet(json.dumps(mine), timeout_s=self.timeout_s, doing=_MEETING)
        ]
        try:
            missing = catch_up(records, launcher.launched)
        except OutOfReach as gap:
            raise self._fail(
                CommunicationError(
                    f"this rank ({self.rank}) is {gap.behind} collectives behind rank "
                    f"{gap.ahead} after the failed call, more than it can complete; the run "
                    "cannot continue: restart the ranks and resume from the last checkpoint"
                )
            ) from None
        filled = launcher.submit(functools.partial(self._fill, missing))
        try:
            concurrent.futures.wait([filled], timeout=self.timeout_s)
            filled.result(timeout=0)
            for done in list(self._inflight):
                done.exception(timeout=max(deadline - time.monotonic(), 0.0))
            while not launcher.idle() and time.monotonic() < deadline:
                time.sleep(_SETTLE_POLL_S)  # the launcher ends the launch it was in
            if not launcher.idle():
                raise TimeoutError("the launcher thread did not settle")
        except Exception as exc:
            raise self._fail(
                CommunicationError(
                    f"the collectives of the abandoned call did not complete on this rank "
                    f"({self.rank}): {exc}; the run cannot continue: restart the ranks and "
                    "resume from the last checkpoint"
                )
            ) from exc
        self._inflight.clear()
        self._inflight_first = self._started
        beat.advance_epoch()
        self._epoch += 1
        self._wait = attrs.evolve(self._wait, fail=functools.partial(self._fail_in, self._epoch))
        launcher.resume()
        self._broken = None
        return [str(r["state"]) for r in records]

    def _fill(self, recipes: list[tuple[Any, ...]]) -> None:
        """Run, on the launcher thread, collectives like those of ``recipes`` (another
        rank's launches this rank lacks) on scratch tensors; their results are dropped."""
        world, device, group = self.world_size, self.device, self.group
        for recipe in recipes:
            kind, numel, dtype_name, src = recipe
            dtype = getattr(torch, str(dtype_name), torch.float32)

            def scratch(n: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.zeros(n, dtype=dtype, device=device)

            if kind == "check":
                check = self._launcher.check
                assert check is not None
                with contextlib.suppress(Zero3Error):  # differs from the other's: it says so
                    check.verify(_MEETING)
            elif kind == "shm_all_gather":
                assert self.shared_memory is not None
                self.shared_memory.all_gather(scratch(numel), scratch(numel // world))
            elif kind == "shm_reduce_scatter":
                assert self.shared_memory is not None
                self.shared_memory.reduce_scatter_mean(scratch(numel // world), scratch(numel))
            elif kind == "all_gather":
                self._caps.all_gather(scratch(numel), scratch(numel // world), group=group)
            elif kind == "exchange":
                dist.all_to_all_single(scratch(numel), scratch(numel), group=group)
            elif kind == "reduce_scatter":
                op = dist.ReduceOp.AVG if self._caps.reduce_scatter_avg else dist.ReduceOp.SUM
                self._caps.reduce_scatter(
                    scratch(numel // world), scratch(numel), op=op, group=group
                )
            elif kind == "all_reduce":
                dist.all_reduce(scratch(numel), group=group)
            elif kind == "broadcast":
                dist.broadcast(scratch(numel), src=int(src), group=group)
            else:
                raise ValueError(f"unknown collective {kind!r} in another rank's log")
            self._launcher.record(recipe)
            self.filled += 1

    def close(self) -> None:
        """Stop the heartbeat and the divergence check, unmap the shared-memory region
        (after the last collective) and end the launcher and waiter threads."""
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.shared_memory is not None:
            self._launcher.submit(self.shared_memory.close)  # behind every queued launch
        check = self._launcher.check
        if check is not None and self._broken is None:
            # Behind every queued launch, so no collective is left unchecked.
            # (After a failure the launcher may be stuck with a silent peer: the
            # side group is then left to the process's exit.)
            self._launcher.submit(check.close).result(timeout=self.timeout_s)
        # After a failure either thread may be stuck with a silent peer: not waited for.
        join_s = self.timeout_s if self._broken is None else 0
        self._launcher.stop(join_s)
        self._waiter.stop(join_s)

    @property
    def context(self) -> str:
        """What the caller is doing, in words that must agree on every rank (see
        :meth:`call_context`)."""
        return self._context

    @contextlib.contextmanager
    def call_context(self, description: str) -> Iterator[None]:
        """Describe the collectives started inside as part of ``description`` (the manager
        enters one for each public call: the call, its arguments, the step).

        Entering and leaving each start a segment, whose first collective is
        checked (see [Note: divergence check]); the outer description is restored
        on the way out.
        """
        outer = self._context
        self._begin_segment(description)
        try:
            yield
        finally:
            self._begin_segment(outer)

    def _begin_segment(self, context: str) -> None:
        self._context = context
        self._segment += 1

    @property
    def divergence_checks(self) -> int:
        """Records exchanged by the divergence check so far (0 without one)."""
        check = self._launcher.check
        return 0 if check is None else check.checked

    @property
    def broken(self) -> Zero3Error | None:
        """The failure that ended the group's sequence of collectives (None while usable)."""
        return self._broken

    def _fail(self, exc: Zero3Error) -> Zero3Error:
        return self._fail_in(self._epoch, exc)

    def _fail_in(self, epoch: int, exc: Zero3Error) -> Zero3Error:
        """Mark the sequence broken by ``exc`` of a collective of ``epoch`` (one of an
        earlier epoch was abandoned with a failed call: see :meth:`recover`)."""
        if self._broken is None and epoch == self._epoch:
            self._broken = exc
        return exc

    def _usable(self) -> None:
        if self._broken is not None:
            raise CommunicationError(
                f"no collective can run on the {group_label(self.group)} after an earlier "
                f"failure: {self._broken}"
            )

    def _waiting_for(self, label: str) -> str:
        """What this rank was waiting for, for the message naming a silent rank."""
        # The oldest collective not launched yet is where the ranks parted (the
        # launcher holds it until every rank reaches it); else the one awaited.
        if self._launcher.failed_at is not None or not self._launcher.idle():
            return self._launcher.launching()
        return f"{label} during {self.context}"

    def _description(self, op: str, nbytes: int, what: str) -> str:
        """A collective's description for the divergence check and for errors."""
        return f"{op} of {nbytes} bytes for {what or 'an unnamed use'} during {self.context}"

    def _start(
        self,
        op: str,
        launch: Callable[[], Any],
        nbytes: int,
        what: str,
        value: Callable[[], T] | None = None,
        *,
        recipe: tuple[str, int, torch.dtype, int],
    ) -> PendingCollective[T]:
        """Queue ``launch``; ``recipe`` (kind, elements, dtype, source rank) says how another
        rank completes it with scratch tensors after a failed call (see :meth:`recover`)."""
        self._usable()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def launch_on_stream() -> Any:
            if stream is None:
                return launch()
            with torch.cuda.stream(stream):
                return launch()

        description = self._description(op, nbytes, what)
        kind, numel, dtype, src = recipe
        launched = self._launcher.submit(
            launch_on_stream,
            description,
            self._segment,
            (kind, numel, str(dtype).removeprefix("torch."), src),
        )
        pending: PendingCollective[T] = PendingCollective(
            op=op, launched=launched, nbytes=nbytes, comm=self, what=what, value=value
        )
        # A recovery completes those every rank launched (see recover()).
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft()
            self._inflight_first += 1
        self._inflight.append(pending._completion())
        self._started += 1
        return pending

    async def flush(self) -> None:
        """Wait (off the loop) until every collective queued so far has been launched.

        Returns at once after a failure: nothing queued will be launched then.
        """
        if self._broken is None and not self._launcher.idle():
            launched = self._launcher.submit(lambda: None)
            await self._wait.until_done(launched, self._launcher.launching())

    def flush_blocking(self) -> None:
        """:meth:`flush` for a thread other than the event loop's."""
        if self._broken is None and not self._launcher.idle():
            launched = self._launcher.submit(lambda: None)
            self._wait.until_done_blocking(launched, self._launcher.launching())

    def start_all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor | Callable[[], torch.Tensor],
        *,
        what: str = "",
    ) -> PendingCollective[None]:
        """Launch the gather of every rank's ``shard`` into ``output`` (rank order).

        ``shard`` may be a function returning the tensor: it is called on the launcher
        thread right before the collective starts (a compute copy still being read
        from disk is waited for there, off the event loop, in program order).
        ``what`` names the use (e.g. the layer) in errors and in the divergence check.
        """
        nbytes = output.numel() * output.element_size()
        get = (lambda: shard) if isinstance(shard, torch.Tensor) else shard
        shm = self.shared_memory
        if shm is not None and output.device.type == "cpu":
            recipe = ("shm_all_gather", output.numel(), output.dtype, 0)
            return self._start_shared(
                "all_gather", lambda: shm.all_gather(output, get()), nbytes, what, recipe
            )
        return self._start(
            "all_gather",
            lambda: self._caps.all_gather(output, get(), group=self.group, async_op=True),
            nbytes,
            what,
            recipe=("all_gather", output.numel(), output.dtype, 0),
        )

    def start_reduce_scatter_mean(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        *,
        what: str = "",
        lender: BufferLender | None = None,
    ) -> PendingCollective[None]:
        """Launch the average of ``full`` over ranks, keeping this rank's slice in ``output``.

        A reduce-scatter by exchange (CPU tensors, see [Note: reduce-scatter by
        exchange]) receives into a buffer from ``lender`` and gives it back once
        summed (None: a fresh buffer).
        """
        nbytes = full.numel() * full.element_size()
        shm = self.shared_memory
        if shm is not None and full.device.type == "cpu":
            run = functools.partial(shm.reduce_scatter_mean, output, full)
            recipe = ("shm_reduce_scatter", full.numel(), full.dtype, 0)
            return self._start_shared("reduce_scatter", run, nbytes, what, recipe)
        if self._caps.exchange and full.device.type == "cpu":
            launch, recycle = self._exchange.prepare(output, full, lender)
            recipe = ("exchange", full.numel(), full.dtype, 0)
            pending = self._start("reduce_scatter", launch, nbytes, what, recipe=recipe)
            pending.then(recycle)
            return pending
        avg = self._caps.reduce_scatter_avg
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        pending = self._start(
            "reduce_scatter",
            lambda: self._caps.reduce_scatter(output, full, op=op, group=self.group, async_op=True),
            nbytes,
            what,
            recipe=("reduce_scatter", full.numel(), full.dtype, 0),
        )
        if not avg:
            pending.then(lambda: output.div_(self.world_size))
        return pending

    def _start_shared(
        self,
        op: str,
        run: Callable[[], None],
        nbytes: int,
        what: str,
        recipe: tuple[str, int, torch.dtype, int],
    ) -> PendingCollective[None]:
        """Queue ``op`` through the host's shared memory: ``run`` moves the data on the
        launcher thread and the collective has completed when its launch returns (see
        [Note: shared-memory collectives])."""

        def launch() -> _DoneWork:
            run()
            return _DoneWork()

        return self._start(op, launch, nbytes, what, recipe=recipe)

    def exchange_buffer_bytes(self) -> int:
        """Bytes of the receive buffers of reduce-scatters by exchange in flight."""
        return self._exchange.inflight_bytes()

    def start_all_reduce_sum(
        self, tensor: torch.Tensor, *, what: str = ""
    ) -> PendingCollective[None]:
        """Launch an in-place sum of ``tensor`` over ranks."""
        return self._start_all_reduce(tensor, dist.ReduceOp.SUM, what)

    def _start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp,
        what: str,
        value: Callable[[], T] | None = None,
    ) -> PendingCollective[T]:
        return self._start(
            "all_reduce",
            lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
            tensor.numel() * tensor.element_size(),
            what,
            value,
            recipe=("all_reduce", tensor.numel(), tensor.dtype, 0),
        )

    def start_agree(self, ok: bool, *, what: str = "") -> PendingCollective[bool]:
        """Launch an agreement: its wait returns True when every rank passed ``ok`` (an
        all-reduce of failure counts)."""
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        return self._start_all_reduce(
            failures, dist.ReduceOp.SUM, what or "an agreement", lambda: failures.item() == 0
        )

    def start_broadcast(
        self, tensor: torch.Tensor, *, src: int = 0, what: str = ""
    ) -> PendingCollective[None]:
        """Launch an in-place copy of ``tensor`` from group rank ``src`` to every rank."""
        global_src = dist.get_global_rank(self.group, src)
        return self._start(
            "broadcast",
            lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=True),
            tensor.numel() * tensor.element_size(),
            what,
            recipe=("broadcast", tensor.numel(), tensor.dtype, global_src),
        )

    async def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, *, what: str = ""
    ) -> None:
        """Gather every rank's ``shard`` into ``output`` and wait for it."""
        await self.start_all_gather(output, shard, what=what).wait()

    async def reduce_scatter_mean(
        self, output: torch.Tensor, full: torch.Tensor, *, what: str = ""
    ) -> None:
        """Average ``full`` over ranks into this rank's slice ``output`` and wait for it."""
        await self.start_reduce_scatter_mean(output, full, what=what).wait()

    async def all_reduce_sum(self, tensor: torch.Tensor, *, what: str = "") -> None:
        """Sum ``tensor`` over ranks in place and wait for it."""
        await self.start_all_reduce_sum(tensor, what=what).wait()

    async def all_reduce_max(self, tensor: torch.Tensor, *, what: str = "") -> None:
        """Elementwise maximum of ``tensor`` over ranks, in place; waits for it."""
        await self._start_all_reduce(tensor, dist.ReduceOp.MAX, what).wait()

    async def agree(self, ok: bool, *, what: str = "") -> bool:
        """True when every rank passed ``ok`` (a collective: see :meth:`start_agree`)."""
        return await self.start_agree(ok, what=what).wait()

    async def broadcast(self, tensor: torch.Tensor, *, src: int = 0, what: str = "") -> None:
        """Broadcast ``tensor`` from group rank ``src`` and wait for it."""
        await self.start_broadcast(tensor, src=src, what=what).wait()
