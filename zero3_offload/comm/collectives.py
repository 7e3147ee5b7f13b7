"""Awaitable collectives over one process group (torsh's ``mod.rs`` only waits where these run).

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
(each assignment of :attr:`Collectives.context`) the ranks check that they are
all about to run the same one in the same call (see [Note: divergence check]).
After a collective fails, times out or finds a silent rank, the group's
sequence of collectives is broken: every later collective raises at once.

Backend differences are settled once per group, by capability, in
:class:`Collectives`: which tensor-level all-gather / reduce-scatter functions the
installed torch offers, whether the backend accepts ``ReduceOp.AVG`` for
reduce-scatter, and whether a CPU group can all-to-all. Nothing else in the
library looks at the backend's name.

[Note: reduce-scatter by exchange]
On CPU tensors, a reduce-scatter runs as an ``all_to_all_single`` (each rank
sends every other rank the slice that rank keeps, and receives every rank's
copy of its own slice) followed by a local sum over the received slices and
the division by the world size. gloo's own reduce-scatter took about twice as
long for the same 12-17 MB layers on 2 ranks (15-21 ms against 7-9 ms) and
held more memory; on the 27M-parameter GPT of the benchmarks the step went
from 0.874 to 0.820 s and the peak RSS down by ~60 MiB. The receive buffers
(one layer's size each) come from the gather pool and go back to it once
summed. ``backward_pass`` releases a layer's gathered buffer before launching
its reduce-scatter, so there the exchange receives into that buffer (same
size in fp32) instead of a buffer of its own; module mode still launches
first and releases after. The sum runs on the group's waiter thread once the
exchange completed, not on the event loop, whose thread computes the layers
(there it cost ~5 ms of each layer's backward). The sum adds the ranks'
slices in rank order, so the mean is the same on every rank and in every run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import attrs
import torch
import torch.distributed as dist

from zero3_offload.comm.divergence import DivergenceCheck
from zero3_offload.comm.heartbeat import Heartbeat, default_store
from zero3_offload.comm.launcher import Launcher
from zero3_offload.comm.shared_memory import HostSharedMemory
from zero3_offload.comm.waiter import Waiter
from zero3_offload.errors import CommunicationError, RankDivergenceError, Zero3Error

__all__ = ["Collectives", "PendingCollective"]

_POLL_S = 0.2  # how often a wait looks at the heartbeat
# How long a wait gives a collective to complete once the heartbeat reports a rank,
# before it looks again and raises: a collective whose last peer closed right after
# it completed settles by then, and so does this rank's beat after a pause of its own.
_CONFIRM_S = 0.5


def _group_label(group: dist.ProcessGroup) -> str:
    try:
        backend = dist.get_backend(group)
    except (ValueError, RuntimeError):  # the group was destroyed meanwhile
        backend = "destroyed"
    return f"{backend} group of {group.size()} ranks (this is rank {group.rank()})"


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


class _ExchangeWork:
    """The all-to-all of a reduce-scatter by exchange, and the local sum that ends it.

    It offers no future, so the group's waiter thread waits for it and runs the
    sum there, off the event loop (whose thread computes layers); later waits
    return at once.
    """

    def __init__(self, work: Any, reduce: Callable[[], None]) -> None:
        self._work = work
        self._reduce: Callable[[], None] | None = reduce
        self._lock = threading.Lock()

    def get_future(self) -> torch.futures.Future:
        raise RuntimeError("a reduce-scatter by exchange completes on the waiter thread")

    def wait(self) -> bool:
        self._work.wait()
        with self._lock:
            reduce, self._reduce = self._reduce, None
        if reduce is not None:
            reduce()
        return True


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


class PendingCollective:
    """A collective handed to the launcher; :meth:`wait` may be awaited any number of times.

    Collectives are queued in program order and launched in that order by the
    group's launcher thread, so every rank issues them in the same order
    whatever the event loop schedules; the launch and the waiting are both off
    the event loop.
    """

    def __init__(
        self,
        *,
        op: str,
        launched: concurrent.futures.Future[Any],
        nbytes: int,
        comm: Collectives,
        what: str = "",
    ) -> None:
        self.op = op
        self.nbytes = nbytes
        self.what = what
        self._launched: concurrent.futures.Future[Any] | None = launched  # -> the backend's Work
        self._comm = comm
        self._after: list[Callable[[], object]] = []
        self._started = time.perf_counter()
        self._done: asyncio.Future[None] | None = None
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
        """Run ``fn`` on the event loop right after the collective completes."""
        self._after.append(fn)

    def _completion(self) -> asyncio.Future[None]:
        if self._done is None:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            # Mark a late failure as seen: nobody may be awaiting any more (the
            # wait timed out), and asyncio would log "exception never retrieved".
            done.add_done_callback(lambda f: f.cancelled() or f.exception())

            def settle(exc: BaseException | None) -> None:
                if done.done():
                    return
                if exc is None:
                    done.set_result(None)
                else:
                    done.set_exception(exc)

            def settle_from_thread(exc: BaseException | None) -> None:
                # Runs on a backend or waiter thread: hop to the loop, which may
                # already be closed when a timed-out collective ends late.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, exc)

            def on_launched(launched: concurrent.futures.Future[Any]) -> None:
                # On the launcher thread (or here, when already launched).
                exc = launched.exception()
                if isinstance(exc, Zero3Error):  # e.g. the ranks diverged: as it is
                    settle_from_thread(exc)
                elif exc is not None:
                    settle_from_thread(RuntimeError(f"failed to start: {exc}"))
                else:
                    self._comm._when_done(self.op, launched.result(), settle_from_thread)

            assert self._launched is not None
            self._launched.add_done_callback(on_launched)
            self._done = done
        return self._done

    async def wait(self) -> None:
        """Wait for completion without blocking the event loop.

        Raises:
            CommunicationError: on failure, when ``timeout_s`` passes first, or when
                the heartbeat finds a rank silent (the message names it).
            RankDivergenceError: when the ranks were about to run different collectives.
        """
        if self._finished:
            return
        what = f" ({self.what})" if self.what else ""
        label = f"{self.op} of {self.nbytes} bytes{what} on the {_group_label(self._comm.group)}"
        await self._comm._watch(self._completion(), label)
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
        if self._comm.observer is not None:
            self._comm.observer(self.op, self.seconds, self.nbytes)
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
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.device = device
        self.timeout_s = timeout_s
        # What the caller is doing, in words that must agree on every rank (the
        # public call, its arguments, the step): part of every collective's
        # description; each assignment starts a segment (see [Note: divergence check]).
        self._context = "setup"
        self._segment = 0
        # Called as observer(op, seconds, nbytes) when a collective completes.
        self.observer: Callable[[str, float, int], None] | None = None
        # op -> whether the backend's Work objects for it offer get_future()
        # (gloo's reduce-scatter does not); learned on first use.
        self._has_future: dict[str, bool] = {}
        self._broken: Zero3Error | None = None  # the failure that ended the sequence
        # Where reduce-scatters by exchange take their receive buffers and give them
        # back once summed: fresh ones by default; the engine points them at the
        # gather pool (see [Note: reduce-scatter by exchange]).
        self.take_buffer: Callable[[int, torch.dtype], torch.Tensor] = self._fresh_buffer
        self.give_buffer: Callable[[torch.Tensor], None] = lambda buffer: None
        self._exchange_inflight = 0  # bytes of receive buffers of exchanges in flight
        self._caps = _probe(group, device)
        check = None
        if verify and self.world_size > 1:
            check = DivergenceCheck(group, all_gather=self._caps.all_gather, timeout_s=timeout_s)
        self._launcher = Launcher(f"zero3-launch-{self.rank}", check)
        self._waiter = Waiter(f"zero3-wait-{self.rank}")
        self.heartbeat: Heartbeat | None = None
        if heartbeat_timeout_s is not None and self.world_size > 1:
            self.heartbeat = self._start_heartbeat(heartbeat_timeout_s)
        self.shared_memory: HostSharedMemory | None = None
        if shared_memory_block_bytes is not None and device.type == "cpu" and self.world_size > 1:
            what = "the shared-memory region"
            self.shared_memory = HostSharedMemory.open(
                group,
                block_bytes=shared_memory_block_bytes,
                broadcast=lambda t: self.broadcast_blocking(t, what=what),
                agree=lambda ok: self.agree_blocking(ok, what=what),
            )

    def _start_heartbeat(self, timeout_s: float) -> Heartbeat | None:
        store = default_store()
        if store is None:
            return None
        key = torch.tensor([random.getrandbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        self.broadcast_blocking(key.to(self.device), src=0, what="the heartbeat's key", out=key)
        global_ranks = dist.get_process_group_ranks(self.group)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        host = None if agent_store or 0 not in global_ranks else global_ranks.index(0)
        beat = error = None
        try:
            beat = Heartbeat(
                store,
                rank=self.rank,
                world_size=self.world_size,
                key=f"zero3/heartbeat/{int(key.item()):016x}",
                timeout_s=timeout_s,
                store_host_rank=host,
            )
        except Exception as exc:  # reported on every rank below
            error = exc
        # Every rank has published its pid once this collective completes.
        if not self.agree_blocking(beat is not None, what="the heartbeat's start"):
            if beat is not None:
                beat.close()
            raise CommunicationError(
                "cannot start the heartbeat: the rendezvous store did not answer on "
                f"{'this rank' if error is not None else 'another rank'}"
                + (f" ({type(error).__name__}: {error})" if error is not None else "")
            ) from error
        assert beat is not None
        beat.start()
        return beat

    def close(self) -> None:
        """Stop the heartbeat and the divergence check, and unmap the shared-memory
        region (after the last collective)."""
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

    @property
    def context(self) -> str:
        """What the caller is doing, in words that must agree on every rank (the manager
        sets it for each public call: the call, its arguments, the step)."""
        return self._context

    @context.setter
    def context(self, value: str) -> None:
        # Every assignment starts a segment, whose first collective is checked.
        self._context = value
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
        if self._broken is None:
            self._broken = exc
        return exc

    def _usable(self) -> None:
        if self._broken is not None:
            raise CommunicationError(
                f"no collective can run on the {_group_label(self.group)} after an earlier "
                f"failure: {self._broken}"
            )

    async def _watch(self, future: Awaitable[Any], label: str) -> Any:
        """Await ``future`` while watching the timeout and the heartbeat.

        Raises:
            CommunicationError: on failure (naming a silent or exited rank when
                the heartbeat finds one), on timeout, or when a rank goes silent.
        """
        task = asyncio.ensure_future(future)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        beat = self.heartbeat
        while not task.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._fail(
                    CommunicationError(
                        f"{label} did not complete within {self.timeout_s:g} s: "
                        "a rank may have stopped or skipped this call"
                    )
                )
            step = remaining if beat is None else min(_POLL_S, remaining)
            await asyncio.wait({task}, timeout=step)
            if task.done() or beat is None or beat.silent() is None:
                continue
            # Confirm once more, a moment later: the collective may have
            # completed as its last peer closed, or this process was paused.
            await asyncio.wait({task}, timeout=_CONFIRM_S)
            silent = beat.silent()
            if not task.done() and silent is not None:
                raise self._fail(CommunicationError(self._silence(silent, label)))
        try:
            return task.result()
        except RankDivergenceError as exc:
            raise self._fail(exc) from None
        except Exception as exc:
            # A backend error on a peer's death says little about who died: ask
            # the heartbeat, which names an exited peer on this host at once and
            # a remote one once its silence exceeds the heartbeat's timeout.
            silent = await self._blame()
            if silent is not None:
                raise self._fail(CommunicationError(self._silence(silent, label))) from exc
            if isinstance(exc, Zero3Error):
                raise self._fail(exc) from None
            raise self._fail(CommunicationError(f"{label} failed: {exc}")) from exc

    async def _blame(self) -> str | None:
        """:meth:`_blame_blocking` in a worker thread (it returns within the heartbeat's
        timeout and two beats)."""
        if self.heartbeat is None:
            return None
        return await anyio.to_thread.run_sync(self._blame_blocking)

    def _blame_blocking(self) -> str | None:
        """The heartbeat's finding, waited for until the silence of a rank that stopped
        just now would exceed the heartbeat's timeout; None if nobody is silent then."""
        beat = self.heartbeat
        if beat is None:
            return None
        deadline = time.monotonic() + beat.timeout_s + 2 * beat.interval_s
        while True:
            silent = beat.silent()
            if silent is not None or time.monotonic() > deadline:
                return silent
            time.sleep(_POLL_S)  # the heartbeat's next round

    def _silence(self, silent: str, label: str) -> str:
        # The oldest collective not launched yet is where the ranks parted (the
        # launcher holds it until every rank reaches it); else the one awaited.
        if self._launcher.failed_at is not None or not self._launcher.idle():
            label = self._launcher.launching()
        else:
            label = f"{label} during {self.context}"
        return (
            f"{silent}; this rank ({self.rank}) was waiting for {label}. "
            "The run cannot continue: restart the ranks and resume from the last checkpoint"
        )

    def _wait_blocking(self, future: concurrent.futures.Future[Any], label: str) -> Any:
        """:meth:`_watch` for a thread other than the event loop's."""
        deadline = time.monotonic() + self.timeout_s
        beat = self.heartbeat
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(
                    CommunicationError(f"{label} did not complete within {self.timeout_s:g} s")
                )
            try:
                return future.result(timeout=remaining if beat is None else min(_POLL_S, remaining))
            except concurrent.futures.TimeoutError:
                pass
            except RankDivergenceError as exc:
                raise self._fail(exc) from None
            except Exception as exc:
                silent = self._blame_blocking()
                if silent is not None:
                    raise self._fail(CommunicationError(self._silence(silent, label))) from exc
                if isinstance(exc, Zero3Error):
                    raise self._fail(exc) from None
                raise self._fail(CommunicationError(f"{label} failed: {exc}")) from exc
            if beat is not None and beat.silent() is not None:
                try:
                    return future.result(timeout=_CONFIRM_S)
                except concurrent.futures.TimeoutError:
                    silent = beat.silent()
                    if silent is not None:
                        raise self._fail(CommunicationError(self._silence(silent, label))) from None

    def _when_done(
        self, op: str, work: Any, settle: Callable[[BaseException | None], None]
    ) -> None:
        """Call ``settle(None)``, or ``settle(exc)`` on failure, from a backend or waiter
        thread once ``work`` completes."""
        future = self._work_future(op, work)
        if future is None:
            # This backend gives no future for this op: the group's waiter thread
            # waits for it (see Waiter).
            self._waiter.submit(work, settle)
            return

        def on_done(fut: torch.futures.Future) -> None:
            try:
                fut.value()
            except Exception as exc:
                settle(exc)
            else:
                settle(None)

        future.add_done_callback(on_done)

    def _description(self, op: str, nbytes: int, what: str) -> str:
        """A collective's description for the divergence check and for errors."""
        return f"{op} of {nbytes} bytes for {what or 'an unnamed use'} during {self.context}"

    def _work_future(self, op: str, work: Any) -> torch.futures.Future | None:
        if self._has_future.get(op, True):
            try:
                future = work.get_future()
            except RuntimeError:
                self._has_future[op] = False
            else:
                self._has_future[op] = True
                return future
        return None

    def _start(
        self, op: str, launch: Callable[[], Any], nbytes: int, what: str
    ) -> PendingCollective:
        self._usable()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def launch_on_stream() -> Any:
            if stream is None:
                return launch()
            with torch.cuda.stream(stream):
                return launch()

        description = self._description(op, nbytes, what)
        launched = self._launcher.submit(launch_on_stream, description, self._segment)
        return PendingCollective(op=op, launched=launched, nbytes=nbytes, comm=self, what=what)

    async def flush(self) -> None:
        """Wait (off the loop) until every collective queued so far has been launched.

        Returns at once after a failure: nothing queued will be launched then.
        """
        if self._broken is None and not self._launcher.idle():
            launched = asyncio.wrap_future(self._launcher.submit(lambda: None))
            await self._watch(launched, self._launcher.launching())

    def flush_blocking(self) -> None:
        """:meth:`flush` for a thread other than the event loop's."""
        if self._broken is None and not self._launcher.idle():
            launched = self._launcher.submit(lambda: None)
            self._wait_blocking(launched, self._launcher.launching())

    def start_all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor | Callable[[], torch.Tensor],
        *,
        what: str = "",
    ) -> PendingCollective:
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
            return self._start_shared(
                "all_gather", lambda: shm.all_gather(output, get()), nbytes, what
            )
        return self._start(
            "all_gather",
            lambda: self._caps.all_gather(output, get(), group=self.group, async_op=True),
            nbytes,
            what,
        )

    def start_reduce_scatter_mean(
        self, output: torch.Tensor, full: torch.Tensor, *, what: str = ""
    ) -> PendingCollective:
        """Launch the average of ``full`` over ranks, keeping this rank's slice in ``output``."""
        shm = self.shared_memory
        if shm is not None and full.device.type == "cpu":
            run = functools.partial(shm.reduce_scatter_mean, output, full)
            return self._start_shared(
                "reduce_scatter", run, full.numel() * full.element_size(), what
            )
        if self._caps.exchange and full.device.type == "cpu":
            return self._start_exchange_mean(output, full, what)
        avg = self._caps.reduce_scatter_avg
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        pending = self._start(
            "reduce_scatter",
            lambda: self._caps.reduce_scatter(output, full, op=op, group=self.group, async_op=True),
            full.numel() * full.element_size(),
            what,
        )
        if not avg:
            pending.then(lambda: output.div_(self.world_size))
        return pending

    def _start_exchange_mean(
        self, output: torch.Tensor, full: torch.Tensor, what: str
    ) -> PendingCollective:
        # See [Note: reduce-scatter by exchange].
        received = self.take_buffer(full.numel(), full.dtype)
        self._exchange_inflight += received.numel() * received.element_size()

        def reduce() -> None:  # on the waiter thread, off the event loop
            torch.sum(received.view(self.world_size, -1), dim=0, out=output)
            output.div_(self.world_size)

        def launch() -> _ExchangeWork:
            work = dist.all_to_all_single(received, full, group=self.group, async_op=True)
            return _ExchangeWork(work, reduce)

        pending = self._start("reduce_scatter", launch, full.numel() * full.element_size(), what)

        def recycle() -> None:
            self._exchange_inflight -= received.numel() * received.element_size()
            self.give_buffer(received)

        pending.then(recycle)
        return pending

    def _start_shared(
        self, op: str, run: Callable[[], None], nbytes: int, what: str
    ) -> PendingCollective:
        """Queue ``op`` through the host's shared memory: ``run`` moves the data on the
        launcher thread and the collective has completed when its launch returns (see
        [Note: shared-memory collectives])."""

        def launch() -> _DoneWork:
            run()
            return _DoneWork()

        return self._start(op, launch, nbytes, what)

    def _fresh_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def exchange_buffer_bytes(self) -> int:
        """Bytes of the receive buffers of reduce-scatters by exchange in flight."""
        return self._exchange_inflight

    def start_all_reduce_sum(self, tensor: torch.Tensor, *, what: str = "") -> PendingCollective:
        """Launch an in-place sum of ``tensor`` over ranks."""
        return self._start_all_reduce(tensor, dist.ReduceOp.SUM, what)

    def _start_all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp, what: str
    ) -> PendingCollective:
        return self._start(
            "all_reduce",
            lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
            tensor.numel() * tensor.element_size(),
            what,
        )

    def start_broadcast(
        self, tensor: torch.Tensor, *, src: int = 0, what: str = ""
    ) -> PendingCollective:
        """Launch an in-place copy of ``tensor`` from group rank ``src`` to every rank."""
        global_src = dist.get_global_rank(self.group, src)
        return self._start(
            "broadcast",
            lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=True),
            tensor.numel() * tensor.element_size(),
            what,
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
        """True when every rank passed ``ok`` (a collective: an all-reduce of failure counts)."""
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        await self.all_reduce_sum(failures, what=what or "an agreement")
        return failures.item() == 0

    async def broadcast(self, tensor: torch.Tensor, *, src: int = 0, what: str = "") -> None:
        """Broadcast ``tensor`` from group rank ``src`` and wait for it."""
        await self.start_broadcast(tensor, src=src, what=what).wait()

    def broadcast_blocking(
        self,
        tensor: torch.Tensor,
        *,
        src: int = 0,
        what: str = "",
        out: torch.Tensor | None = None,
    ) -> None:
        """Synchronous broadcast, for constructors that cannot await.

        ``out``, when given, receives a copy of the result (e.g. on the CPU).
        """
        global_src = dist.get_global_rank(self.group, src)
        self._blocking(
            "broadcast",
            lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=True),
            tensor,
            what,
        )
        if out is not None:
            out.copy_(tensor)

    def agree_blocking(self, ok: bool, *, what: str = "") -> bool:
        """:meth:`agree` for constructors that cannot await."""
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self._blocking(
            "all_reduce",
            lambda: dist.all_reduce(failures, group=self.group, async_op=True),
            failures,
            what or "an agreement",
        )
        return failures.item() == 0

    def _blocking(
        self, op: str, launch: Callable[[], Any], tensor: torch.Tensor, what: str
    ) -> None:
        """Launch ``op`` through the launcher (behind any collective queued before it) and
        wait for it on this thread, watching the timeout and the heartbeat."""
        self._usable()
        nbytes = tensor.numel() * tensor.element_size()
        label = f"{op} of {nbytes} bytes on the {_group_label(self.group)}"
        description = self._description(op, nbytes, what)
        launched = self._launcher.submit(launch, description, self._segment)
        work = self._wait_blocking(launched, label)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def settle(exc: BaseException | None) -> None:
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

        self._when_done(op, work, settle)
        self._wait_blocking(done, label)
        work.wait()  # orders the current CUDA stream after NCCL's; a no-op on gloo
