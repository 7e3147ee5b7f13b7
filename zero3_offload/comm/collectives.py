"""Awaitable collectives over one process group (torsh's ``mod.rs`` only waits where these run).

Every collective is launched with ``async_op=True``; its completion is delivered
to the event loop through the work's future (or, for ops whose backend work
gives none, such as gloo's reduce-scatter, by a waiter thread), so the loop
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

Backend differences are settled once per group, by capability, in
:class:`Collectives`: which tensor-level all-gather / reduce-scatter functions the
installed torch offers, and whether the backend accepts ``ReduceOp.AVG`` for
reduce-scatter. Nothing else in the library looks at the backend's name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as _dt
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from zero3_offload.errors import CommunicationError

__all__ = ["Collectives", "PendingCollective"]


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
    return _Capabilities(
        all_gather=all_gather, reduce_scatter=reduce_scatter, reduce_scatter_avg=avg
    )


class _Launcher:
    """One daemon thread that calls queued functions in order (a daemon, so a launch
    stuck on a dead peer never keeps the process from exiting)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._queue = queue.SimpleQueue()
        self.submitted = 0  # functions queued so far (from any thread, under the lock)
        self.finished = 0  # functions called so far (by the launcher thread only)
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to whoever waits for the launch
                    future.set_exception(exc)
            # The launch's closure holds its tensors: not until the next launch.
            del fn, future
            self.finished += 1

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self.submitted += 1
            self._queue.put((fn, future))
        return future

    def idle(self) -> bool:
        """Whether everything queued so far has been called."""
        with self._lock:
            return self.finished >= self.submitted


class PendingCollective:
    """A collective handed to the launcher; :meth:`wait` may be awaited any number of times.

    Collectives are queued in program order and launched in that order by the
    group's launcher thread, so every rank issues them in the same order
    whatever the event loop schedules; the launch and the waiting are both off
    the event loop.
    """

    def __init__(
        self, *, op: str, launched: concurrent.futures.Future[Any], nbytes: int, comm: Collectives
    ) -> None:
        self.op = op
        self.nbytes = nbytes
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

            def watch(work: Any) -> None:
                future = self._comm._work_future(self.op, work)
                if future is None:
                    # This backend gives no future for this op: a thread waits. A
                    # daemon thread, not the loop's default executor: after a
                    # timeout the wait may last until the group's own timeout, and
                    # asyncio.run() joins the default executor's threads on exit,
                    # which would hang the process that reported the timeout.
                    def wait_work() -> None:
                        try:
                            work.wait()
                        except Exception as exc:
                            settle_from_thread(exc)
                        else:
                            settle_from_thread(None)

                    threading.Thread(
                        target=wait_work, name=f"zero3-{self.op}-wait", daemon=True
                    ).start()
                    return

                def on_done(fut: torch.futures.Future) -> None:
                    try:
                        fut.value()
                    except Exception as exc:
                        settle_from_thread(exc)
                    else:
                        settle_from_thread(None)

                future.add_done_callback(on_done)

            def on_launched(launched: concurrent.futures.Future[Any]) -> None:
                # On the launcher thread (or here, when already launched).
                exc = launched.exception()
                if exc is not None:
                    settle_from_thread(RuntimeError(f"failed to start: {exc}"))
                else:
                    watch(launched.result())

            assert self._launched is not None
            self._launched.add_done_callback(on_launched)
            self._done = done
        return self._done

    async def wait(self) -> None:
        """Wait for completion without blocking the event loop.

        Raises:
            CommunicationError: on failure, or when ``timeout_s`` passes first.
        """
        if self._finished:
            return
        label = f"{self.op} of {self.nbytes} bytes on the {_group_label(self._comm.group)}"
        try:
            await asyncio.wait_for(asyncio.shield(self._completion()), self._comm.timeout_s)
        except TimeoutError as exc:
            raise CommunicationError(
                f"{label} did not complete within {self._comm.timeout_s:g} s: "
                "a rank may have stopped or skipped this call"
            ) from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise CommunicationError(f"{label} failed: {exc}") from exc
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

    Args:
        group: the process group (every rank of it must build this object, since
            construction runs a small probe collective).
        device: device of the tensors passed to the collectives.
        timeout_s: how long to wait for one collective before raising.
    """

    def __init__(
        self, group: dist.ProcessGroup, *, device: torch.device, timeout_s: float = 300.0
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.device = device
        self.timeout_s = timeout_s
        # Called as observer(op, seconds, nbytes) when a collective completes.
        self.observer: Callable[[str, float, int], None] | None = None
        # op -> whether the backend's Work objects for it offer get_future()
        # (gloo's reduce-scatter does not); learned on first use.
        self._has_future: dict[str, bool] = {}
        self._caps = _probe(group, device)
        self._launcher = _Launcher(f"zero3-launch-{self.rank}")

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

    def _start(self, op: str, launch: Callable[[], Any], nbytes: int) -> PendingCollective:
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def launch_on_stream() -> Any:
            if stream is None:
                return launch()
            with torch.cuda.stream(stream):
                return launch()

        launched = self._launcher.submit(launch_on_stream)
        return PendingCollective(op=op, launched=launched, nbytes=nbytes, comm=self)

    async def flush(self) -> None:
        """Wait (off the loop) until every collective queued so far has been launched."""
        if not self._launcher.idle():
            await asyncio.wrap_future(self._launcher.submit(lambda: None))

    def flush_blocking(self) -> None:
        """:meth:`flush` for a thread other than the event loop's."""
        if not self._launcher.idle():
            self._launcher.submit(lambda: None).result()

    def start_all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> PendingCollective:
        """Launch the gather of every rank's ``shard`` into ``output`` (rank order)."""
        return self._start(
            "all_gather",
            lambda: self._caps.all_gather(output, shard, group=self.group, async_op=True),
            output.numel() * output.element_size(),
        )

    def start_reduce_scatter_mean(
        self, output: torch.Tensor, full: torch.Tensor
    ) -> PendingCollective:
        """Launch the average of ``full`` over ranks, keeping this rank's slice in ``output``."""
        avg = self._caps.reduce_scatter_avg
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        pending = self._start(
            "reduce_scatter",
            lambda: self._caps.reduce_scatter(output, full, op=op, group=self.group, async_op=True),
            full.numel() * full.element_size(),
        )
        if not avg:
            pending.then(lambda: output.div_(self.world_size))
        return pending

    def start_all_reduce_sum(self, tensor: torch.Tensor) -> PendingCollective:
        """Launch an in-place sum of ``tensor`` over ranks."""
        return self._start_all_reduce(tensor, dist.ReduceOp.SUM)

    def _start_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> PendingCollective:
        return self._start(
            "all_reduce",
            lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
            tensor.numel() * tensor.element_size(),
        )

    def start_broadcast(self, tensor: torch.Tensor, *, src: int = 0) -> PendingCollective:
        """Launch an in-place copy of ``tensor`` from group rank ``src`` to every rank."""
        global_src = dist.get_global_rank(self.group, src)
        return self._start(
            "broadcast",
            lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=True),
            tensor.numel() * tensor.element_size(),
        )

    async def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """Gather every rank's ``shard`` into ``output`` and wait for it."""
        await self.start_all_gather(output, shard).wait()

    async def reduce_scatter_mean(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """Average ``full`` over ranks into this rank's slice ``output`` and wait for it."""
        await self.start_reduce_scatter_mean(output, full).wait()

    async def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks in place and wait for it."""
        await self.start_all_reduce_sum(tensor).wait()

    async def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Elementwise maximum of ``tensor`` over ranks, in place; waits for it."""
        await self._start_all_reduce(tensor, dist.ReduceOp.MAX).wait()

    async def agree(self, ok: bool) -> bool:
        """True when every rank passed ``ok`` (a collective: an all-reduce of failure counts)."""
        failures = torch.tensor([0.0 if ok else 1.0], device=self.device)
        await self.all_reduce_sum(failures)
        return failures.item() == 0

    async def broadcast(self, tensor: torch.Tensor, *, src: int = 0) -> None:
        """Broadcast ``tensor`` from group rank ``src`` and wait for it."""
        await self.start_broadcast(tensor, src=src).wait()

    def broadcast_blocking(self, tensor: torch.Tensor, *, src: int = 0) -> None:
        """Synchronous broadcast, for constructors that cannot await."""
        global_src = dist.get_global_rank(self.group, src)
        try:
            # Through the launcher, behind any collective queued before it.
            work = self._launcher.submit(
                lambda: dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)
            ).result()
            if not work.wait(timeout=_dt.timedelta(seconds=self.timeout_s)):
                raise TimeoutError(f"no completion within {self.timeout_s:g} s")
        except Exception as exc:
            raise CommunicationError(
                f"broadcast of {tensor.numel() * tensor.element_size()} bytes on the "
                f"{_group_label(self.group)} failed: {exc}"
            ) from exc
