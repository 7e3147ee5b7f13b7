"""Run an async function on N real ranks on this machine (for tests and examples).

Each rank is a separate process joined to a gloo group on 127.0.0.1 (a free
port is picked; the store and gloo listen on the loopback interface only).
Processes come from a ``forkserver`` that has already imported torch (and
``torch._dynamo``, which its optimizers import, and transformers and peft when
this process has imported them), so starting a rank costs a fork, not an
interpreter start, and no rank inherits the parent's thread pools. A failure in
any rank stops all of them and raises :class:`RankFailedError` with that rank's
traceback; no process is left behind, also on timeout or cancellation. A
successful run also waits for every rank to exit by itself, and a rank that ends
with a status other than 0 after returning its result fails the run too.

Usage (the function must be importable, i.e. defined at module level)::

    async def body(ctx: RankContext, n: int) -> float:
        t = torch.full((n,), float(ctx.rank))
        await Collectives(ctx.group, device=torch.device("cpu")).all_reduce_sum(t)
        return t[0].item()

    results = await run_ranks(body, 2, 4)   # [1.0, 1.0]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import anyio
import attrs
import psutil
import torch
import torch.distributed as dist

from zero3_offload.comm import destroy_process_group, init_process_group
from zero3_offload.comm.heartbeat import process_state
from zero3_offload.errors import Zero3Error
from zero3_offload.memory.allocator import set_mmap_threshold

__all__ = [
    "RankContext",
    "RankFailedError",
    "free_port",
    "keep_gloo_on_loopback",
    "process_context",
    "rank_pids_alive",
    "run_ranks",
]


class RankFailedError(Zero3Error, RuntimeError):
    """A rank raised, crashed or timed out; the message holds its traceback."""


@attrs.frozen
class RankContext:
    """What a rank function receives."""

    rank: int
    world_size: int
    group: dist.ProcessGroup


def keep_gloo_on_loopback() -> None:
    """Have this process's gloo groups listen on the loopback interface only (local ranks;
    by default gloo binds the address the host name resolves to), unless
    ``GLOO_SOCKET_IFNAME`` is set already."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Awaitable[Any]],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    threads: int,
    timeout_s: float,
    backend: str,
    mmap_threshold: int | None,
    heartbeat_timeout_s: float | None,
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    if mmap_threshold is not None:
        set_mmap_threshold(mmap_threshold)
    if backend == "gloo":
        keep_gloo_on_loopback()

    async def main() -> Any:
        group = await init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            port=port,
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        try:
            return await fn(RankContext(rank=rank, world_size=world_size, group=group), *args)
        finally:
            destroy_process_group()

    try:
        payload = pickle.dumps(asyncio.run(main()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    else:
        results.put((rank, True, payload))


# Preloaded by the forkserver when this process has imported them: every rank of a
# transformers model imports them (about 1.1 s of CPU each).
_PRELOAD_IF_IMPORTED = ("transformers", "peft")


def process_context() -> mp.context.BaseContext:
    """The multiprocessing context rank processes start from (a preloaded forkserver)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # torch._dynamo too: a rank's first torch.optim optimizer imports it (about 2 s of
        # CPU per rank otherwise); imported once here, every rank forks with it.
        preload = ["torch", "torch._dynamo", "zero3_offload"]
        preload += [name for name in _PRELOAD_IF_IMPORTED if name in sys.modules]
        ctx.set_forkserver_preload(preload)
        return ctx
    return mp.get_context("spawn")


def _supervise(
    procs: list[Any], results: Any, world_size: int, timeout_s: float, may_die: frozenset[int]
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}

    def take(item: tuple[int, bool, Any]) -> None:
        rank, ok, payload = item
        if not ok:
            raise RankFailedError(f"rank {rank} failed:\n{payload}")
        out[rank] = pickle.loads(payload)

    while len(out) < world_size:
        try:
            take(results.get(timeout=0.1))
            continue
        except queue.Empty:
            pass
        exited = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
        if exited:
            # A rank's result is in the pipe before the rank exits, but it may
            # have arrived after the get() above gave up: drain before blaming.
            try:
                while True:
                    take(results.get(timeout=0.1))
            except queue.Empty:
                pass
            for rank in exited:
                if rank not in out and rank in may_die:
                    out[rank] = None
                elif rank not in out:
                    raise RankFailedError(
                        f"rank {rank} exited with code {procs[rank].exitcode} without a "
                        "result (crashed or was killed)"
                    )
        if len(out) < world_size and time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(out))
            raise RankFailedError(f"ranks {missing} did not finish within {timeout_s:g} s")
    return [out[r] for r in range(world_size)]


def _await_clean_exits(procs: list[Any], may_die: frozenset[int]) -> None:
    """Wait for ranks that returned their results to end by themselves; one that ends
    with a status other than 0 (an abort at exit, say) fails the run."""
    deadline = time.monotonic() + _EXIT_GRACE_S
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    unclean = {
        rank: p.exitcode
        for rank, p in enumerate(procs)
        if rank not in may_die and p.exitcode not in (0, None)
    }
    if unclean:
        raise RankFailedError(
            "; ".join(
                f"rank {rank} returned its result, then {_exit_status(code)}"
                for rank, code in sorted(unclean.items())
            )
        )
    running = [rank for rank, p in enumerate(procs) if rank not in may_die and p.exitcode is None]
    if running:
        raise RankFailedError(
            f"ranks {running} returned their results, then did not exit within {_EXIT_GRACE_S:g} s"
        )


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def run_ranks(
    fn: Callable[..., Awaitable[Any]],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    threads_per_rank: int = 1,
    backend: str = "gloo",
    mmap_threshold: int | None = None,
    may_die: Collection[int] = (),
    heartbeat_timeout_s: float | None = 5.0,
) -> list[Any]:
    """Run ``await fn(RankContext, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level async function; its return value must pickle.
        world_size: number of ranks (processes).
        *args: passed to ``fn`` after the context; must pickle.
        timeout_s: limit for the whole run (also the group's collective timeout).
        threads_per_rank: torch intra-op threads in each rank.
        backend: ``"gloo"``, or ``"nccl"`` for ranks that each own a GPU.
        mmap_threshold: if set, each rank calls
            :func:`~zero3_offload.memory.allocator.set_mmap_threshold` with it.
        may_die: ranks whose process may end without a result (fault tests kill
            them on purpose): their result is None, and the others run on.
        heartbeat_timeout_s: the process heartbeat's timeout in
            :func:`~zero3_offload.comm.init_process_group` (it watches the
            rendezvous and the managers' construction); None: none.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankFailedError: when a rank raises, crashes or the run times out, or a rank
            that returned its result does not then exit with status 0 (an abort at
            the interpreter's exit, say).
    """
    attempt = 1
    while True:
        try:
            return await _run_once(
                fn,
                world_size,
                args,
                timeout_s,
                threads_per_rank,
                backend,
                mmap_threshold,
                frozenset(may_die),
                heartbeat_timeout_s,
            )
        except RankFailedError as exc:
            # free_port() releases the port before rank 0 binds it, so another
            # process can take it in between: only that race is retried.
            if attempt == _PORT_ATTEMPTS or "address already in use" not in str(exc).lower():
                raise
        attempt += 1


# Runs tried when the rendezvous port was taken: the race needs another process
# binding the same just-freed port, so a third collision means something else.
_PORT_ATTEMPTS = 3
_TERMINATE_GRACE_S = 10.0
_EXIT_GRACE_S = 30.0  # how long ranks that returned their results may take to exit


async def _run_once(
    fn: Callable[..., Awaitable[Any]],
    world_size: int,
    args: tuple[Any, ...],
    timeout_s: float,
    threads_per_rank: int,
    backend: str,
    mmap_threshold: int | None,
    may_die: frozenset[int],
    heartbeat_timeout_s: float | None,
) -> list[Any]:
    ctx = process_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                rank,
                world_size,
                port,
                args,
                threads_per_rank,
                timeout_s,
                backend,
                mmap_threshold,
                heartbeat_timeout_s,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        out = await anyio.to_thread.run_sync(
            _supervise, procs, results, world_size, timeout_s, may_die, abandon_on_cancel=True
        )
        await anyio.to_thread.run_sync(_await_clean_exits, procs, may_die, abandon_on_cancel=True)
        return out
    finally:
        # A failed start leaves later processes unstarted: skip them (pid is None).
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                # A stopped process (SIGSTOP) cannot clean up: it is killed.
                if process_state(p.pid) == "stopped":
                    p.kill()
                else:
                    p.terminate()
        for p in started:
            # SIGTERM lets a rank run its finally blocks; one that has not
            # exited after this long is stuck and gets SIGKILL.
            p.join(timeout=_TERMINATE_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()


def rank_pids_alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that still run (for tests of cleanup)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive
