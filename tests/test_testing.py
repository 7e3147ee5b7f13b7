"""Tests of testing.py: run_ranks results, failure reports and process cleanup."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist

from zero3_offload.comm import Collectives
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext, RankFailedError, rank_pids_alive, run_ranks

CPU = torch.device("cpu")


async def announce(ctx: RankContext, pid_dir: str) -> list[int]:
    """Write this rank's pid to ``pid_dir``; once it returns every rank has."""
    Path(pid_dir, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    pids = torch.zeros(ctx.world_size, dtype=torch.int64)
    pids[ctx.rank] = os.getpid()
    await Collectives(ctx.group, device=CPU).all_reduce_sum(pids)
    return pids.tolist()


def read_pids(pid_dir: Path, world_size: int) -> list[int]:
    pids = [int((pid_dir / f"rank{r}.pid").read_text()) for r in range(world_size)]
    assert len(set(pids)) == world_size
    assert os.getpid() not in pids
    return pids


async def report_body(ctx: RankContext, tag: str, scale: int) -> dict:
    if ctx.rank == 0:
        # Real work on rank 0 only, so that its result usually arrives last.
        a = torch.randn(200, 200, generator=torch.Generator().manual_seed(1))
        acc = torch.eye(200)
        for _ in range(100):
            acc = acc @ a
            acc = acc / acc.norm()
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "group_size": ctx.group.size(),
        "dist_rank": dist.get_rank(),
        "backend": dist.get_backend(ctx.group),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "value": f"{tag}-{ctx.rank * scale}",
    }


async def test_results_come_back_in_rank_order():
    results = await run_ranks(report_body, 3, "r", 7, threads_per_rank=2, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["value"] for r in results] == ["r-0", "r-7", "r-14"]
    for rank, r in enumerate(results):
        assert r["dist_rank"] == rank
        assert r["world_size"] == 3
        assert r["group_size"] == 3
        assert r["backend"] == "gloo"
        assert r["threads"] == 2
    pids = [r["pid"] for r in results]
    assert len(set(pids)) == 3
    assert os.getpid() not in pids
    assert rank_pids_alive(pids) == []


def explode(rank: int) -> None:
    raise ValueError(f"deliberate failure in rank {rank}: 42 != 41")


async def raising_body(ctx: RankContext, pid_dir: str) -> None:
    await announce(ctx, pid_dir)
    if ctx.rank == 1:
        explode(ctx.rank)
    threading.Event().wait()  # rank 0 waits for something that never happens


async def test_exception_in_a_rank_is_reported_with_its_traceback(tmp_path):
    with pytest.raises(RankFailedError) as info:
        await run_ranks(raising_body, 2, str(tmp_path), timeout_s=120)
    message = str(info.value)
    assert isinstance(info.value, Zero3Error)
    assert message.startswith("rank 1 failed")
    assert "Traceback (most recent call last)" in message
    assert "in explode" in message
    assert "ValueError: deliberate failure in rank 1: 42 != 41" in message
    # Rank 0 was blocked forever: the run stopped it rather than waiting.
    assert rank_pids_alive(read_pids(tmp_path, 2)) == []


async def exiting_body(ctx: RankContext, pid_dir: str) -> None:
    await announce(ctx, pid_dir)
    if ctx.rank == 1:
        os._exit(3)
    threading.Event().wait()


async def test_rank_that_exits_is_reported_with_its_exit_code(tmp_path):
    with pytest.raises(RankFailedError) as info:
        await run_ranks(exiting_body, 2, str(tmp_path), timeout_s=120)
    assert "rank 1 exited with code 3 without a result" in str(info.value)
    assert rank_pids_alive(read_pids(tmp_path, 2)) == []


async def blocking_body(ctx: RankContext, pid_dir: str) -> int:
    pids = await announce(ctx, pid_dir)
    if ctx.rank == 1:
        threading.Event().wait()
    return pids[ctx.rank]


@pytest.mark.slow
async def test_run_timeout_is_reported_and_stops_the_ranks(tmp_path):
    with pytest.raises(RankFailedError) as info:
        await run_ranks(blocking_body, 2, str(tmp_path), timeout_s=8)
    # Rank 0 finished; only rank 1 is named.
    assert "ranks [1] did not finish within 8 s" in str(info.value)
    assert rank_pids_alive(read_pids(tmp_path, 2)) == []


async def cancelled_body(ctx: RankContext, pid_dir: str, started: mp.synchronize.Event) -> None:
    await announce(ctx, pid_dir)
    started.set()
    threading.Event().wait()


async def test_cancelling_the_run_stops_the_ranks(tmp_path):
    started = mp.get_context("forkserver").Event()
    run = asyncio.create_task(run_ranks(cancelled_body, 2, str(tmp_path), started, timeout_s=120))
    # Blocks a worker thread (not the loop) until the ranks are inside fn.
    assert await anyio.to_thread.run_sync(started.wait, 60)
    assert not run.done()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert rank_pids_alive(read_pids(tmp_path, 2)) == []
