"""Tests of comm.py: awaitable collectives on real gloo ranks, timeouts, argument checks."""

from __future__ import annotations

import asyncio
import ipaddress
import multiprocessing as mp
import threading

import psutil
import pytest
import torch
import torch.distributed as dist

from zero3_offload.comm import Collectives, init_process_group, init_process_group_from_env
from zero3_offload.errors import CommunicationError, ConfigError
from zero3_offload.testing import RankContext, RankFailedError, free_port, run_ranks

CPU = torch.device("cpu")
SHARD = 5  # elements of each rank's all-gather shard
SLICE = 3  # elements of each rank's reduce-scatter slice


# Per-rank inputs, shared by the rank functions and the expected values below.
def gather_shard(rank: int) -> torch.Tensor:
    return torch.arange(SHARD, dtype=torch.float32) + 100.0 * rank + 0.5


def scatter_input(rank: int, world_size: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, SLICE * world_size) * (rank + 1) + rank**2


def reduce_input(rank: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) * (rank + 1) - rank


def broadcast_input(rank: int) -> torch.Tensor:
    return torch.tensor([7.0, -8.0, 9.5]) if rank == 1 else torch.full((3,), -float(rank + 1))


# Three ranks: an odd group, with a broadcast from a rank other than 0 and 1 (the
# collectives' code does not depend on the world size; two ranks add nothing).
@pytest.mark.ranks(3)
async def test_collectives_give_the_values_computed_locally(rank: RankContext) -> None:
    seen: list[tuple[str, int]] = []
    comm = Collectives(
        rank.group,
        device=CPU,
        timeout_s=60.0,
        observer=lambda op, seconds, nbytes: seen.append((op, nbytes)),
    )
    me, world = rank.rank, rank.world_size
    mine = slice(me * SLICE, (me + 1) * SLICE)
    mean = torch.stack([scatter_input(r, world) for r in range(world)]).mean(0)
    f32 = 4

    gathered = torch.full((SHARD * world,), float("nan"))
    await comm.all_gather(gathered, gather_shard(me))
    assert torch.equal(gathered, torch.cat([gather_shard(r) for r in range(world)]))
    mean_slice = torch.full((SLICE,), float("nan"))
    await comm.reduce_scatter_mean(mean_slice, scatter_input(me, world))
    torch.testing.assert_close(mean_slice, mean[mine], rtol=0, atol=1e-6)
    summed = reduce_input(me)
    await comm.all_reduce_sum(summed)
    assert torch.equal(summed, torch.stack([reduce_input(r) for r in range(world)]).sum(0))
    bcast = broadcast_input(me)
    await comm.broadcast(bcast, src=1)
    assert torch.equal(bcast, broadcast_input(1))
    blocking = torch.full((2,), float(me))
    # Waited on this thread, as constructors do: not reported to the observer.
    comm.start_broadcast(blocking, src=world - 1).wait_blocking()
    assert torch.equal(blocking, torch.full((2,), float(world - 1)))
    assert seen == [
        ("all_gather", SHARD * world * f32),
        ("reduce_scatter", SLICE * world * f32),
        ("all_reduce", 4 * f32),
        ("broadcast", 3 * f32),
    ]

    # Several collectives launched before any wait; waited in reverse order.
    seen.clear()
    small = torch.full((2,), float(me + 1))
    large = torch.full((6,), 10.0 * (me + 1))
    gathered2 = torch.full((2 * world,), float("nan"))
    mean2 = torch.full((SLICE,), float("nan"))
    bcast2 = broadcast_input(me)
    pendings = [
        comm.start_all_reduce_sum(small),
        comm.start_all_gather(gathered2, torch.tensor([float(me), -float(me)])),
        comm.start_reduce_scatter_mean(mean2, scatter_input(me, world) * 2.0),
        comm.start_broadcast(bcast2, src=1),
        comm.start_all_reduce_sum(large),
    ]
    for pending in reversed(pendings):
        await pending.wait()
    ranks_plus_one = float(sum(r + 1 for r in range(world)))
    assert torch.equal(small, torch.full((2,), ranks_plus_one))
    assert torch.equal(large, torch.full((6,), 10.0 * ranks_plus_one))
    assert torch.equal(gathered2, torch.tensor([v for r in range(world) for v in (r, -r)]).float())
    torch.testing.assert_close(mean2, 2.0 * mean[mine], rtol=0, atol=1e-6)
    assert torch.equal(bcast2, broadcast_input(1))
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_reduce"]
    assert [p.op for p in pendings] == ops
    # Waited in reverse: each completion is reported once, when waited.
    assert seen == [
        ("all_reduce", 6 * f32),
        ("broadcast", 3 * f32),
        ("reduce_scatter", SLICE * world * f32),
        ("all_gather", 2 * world * f32),
        ("all_reduce", 2 * f32),
    ]
    assert all(p.seconds is not None and p.seconds >= 0 for p in pendings)

    # wait() awaited twice in sequence, then by two tasks at once: completion
    # work (observer) runs exactly once and the value is not touched again.
    seen.clear()
    twice = torch.full((3,), float(me + 1))
    pending = comm.start_all_reduce_sum(twice)
    await pending.wait()
    first = twice.clone()
    await pending.wait()
    assert torch.equal(first, torch.full((3,), ranks_plus_one))
    assert torch.equal(twice, first)
    assert seen == [("all_reduce", 3 * f32)]

    seen.clear()
    concurrent = torch.full((2 * world,), float("nan"))
    pending = comm.start_all_gather(concurrent, torch.full((2,), float(me)))
    await asyncio.gather(pending.wait(), pending.wait())
    await pending.wait()
    assert torch.equal(concurrent, torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    assert seen == [("all_gather", 2 * world * f32)]

    # A second default group in the same process is refused.
    with pytest.raises(CommunicationError) as refused:
        await init_process_group("gloo", rank=me, world_size=world, port=free_port())
    assert "already exists" in str(refused.value)


TICKS_BEFORE_JOIN = 1000
MATMULS = 150


async def loop_free_body(ctx: RankContext, ticked: mp.synchronize.Event) -> dict:
    comm = Collectives(ctx.group, device=CPU, timeout_s=60.0)
    value = torch.full((8,), float(ctx.rank + 1))
    if ctx.rank == 1:
        # Join only once rank 0's loop has demonstrably run other tasks, and
        # after real CPU work (a blocking wait and compute on this rank only).
        signalled = ticked.wait(60)
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(160, 160, generator=gen)
        acc = torch.eye(160)
        for _ in range(MATMULS):
            acc = acc @ a
            acc = acc / acc.norm()
        await comm.all_reduce_sum(value)
        return {"signalled": signalled, "work": float(acc.norm()), "value": value}

    ticks = 0
    stop = False

    async def spin() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            if ticks == TICKS_BEFORE_JOIN:
                ticked.set()
            await asyncio.sleep(0)  # only yields to the loop

    task = asyncio.create_task(spin())
    pending = comm.start_all_reduce_sum(value)
    try:
        await pending.wait()
        ticks_at_completion = ticks
    finally:
        stop = True
        ticked.set()  # never leave rank 1 waiting, whatever happened
        await task
    return {"ticks": ticks_at_completion, "value": value}


async def test_event_loop_runs_other_tasks_while_a_collective_is_in_flight():
    ticked = mp.get_context("forkserver").Event()
    rank0, rank1 = await run_ranks(loop_free_body, 2, ticked, timeout_s=120)
    assert rank1["signalled"]
    assert rank1["work"] == pytest.approx(1.0)
    assert rank0["ticks"] >= TICKS_BEFORE_JOIN
    assert torch.equal(rank0["value"], torch.full((8,), 3.0))
    assert torch.equal(rank1["value"], torch.full((8,), 3.0))


async def skipped_collective_body(ctx: RankContext, reported: mp.synchronize.Event) -> dict:
    comm = Collectives(ctx.group, device=CPU, timeout_s=1.0)
    if ctx.rank == 1:
        # Skip the all_reduce until rank 0 has reported its timeout, then make
        # the late matching call so that both ranks leave the group cleanly.
        signalled = reported.wait(60)
        value = torch.full((4,), 2.0)
        await comm.all_reduce_sum(value)
        return {"signalled": signalled, "value": value}

    value = torch.full((4,), 1.0)
    pending = comm.start_all_reduce_sum(value)
    error: BaseException | None = None
    try:
        await pending.wait()
    except CommunicationError as exc:
        error = exc
    finally:
        reported.set()
    # The timed-out collective is still pending, not lost: it completes once
    # rank 1 joins, and waiting again picks that up.
    await pending.wait()
    return {
        "error_type": type(error).__name__,
        "error": str(error),
        "value": value,
        "seconds": pending.seconds,
    }


async def test_timeout_raises_communication_error_naming_op_and_group():
    reported = mp.get_context("forkserver").Event()
    rank0, rank1 = await run_ranks(skipped_collective_body, 2, reported, timeout_s=60)
    assert rank0["error_type"] == "CollectiveTimeoutError"
    assert "all_reduce" in rank0["error"]
    assert "gloo" in rank0["error"]
    assert "did not complete within 1 s" in rank0["error"]
    assert rank1["signalled"]
    assert torch.equal(rank0["value"], torch.full((4,), 3.0))
    assert torch.equal(rank1["value"], torch.full((4,), 3.0))
    assert rank0["seconds"] is not None  # completed (by rank 1's late call)


async def abandoned_reduce_scatter_body(ctx: RankContext) -> None:
    comm = Collectives(ctx.group, device=CPU, timeout_s=1.0)
    if ctx.rank == 1:
        threading.Event().wait()  # never joins and never leaves
    await comm.reduce_scatter_mean(torch.empty(2), torch.ones(4))


async def test_timed_out_rank_reports_while_the_other_rank_stays_alive():
    # reduce_scatter on gloo has no work future: the waiting must not keep the
    # timed-out rank from finishing, or the run would only end at its own
    # timeout with both ranks "not finished".
    with pytest.raises(RankFailedError) as info:
        await run_ranks(abandoned_reduce_scatter_body, 2, timeout_s=60)
    message = str(info.value)
    assert "rank 0 failed" in message
    assert "CollectiveTimeoutError" in message
    assert "reduce_scatter" in message
    assert "did not complete within 1 s" in message


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "mpi", "rank": 0, "world_size": 1}, "backend="),
        ({"backend": "gloo", "rank": 2, "world_size": 2}, "rank="),
        ({"backend": "gloo", "rank": -1, "world_size": 2}, "rank="),
        ({"backend": "gloo", "rank": 0, "world_size": 0}, "world_size="),
    ],
)
async def test_init_process_group_rejects_bad_arguments(kwargs, field):
    backend = kwargs.pop("backend")
    with pytest.raises(ConfigError) as info:
        await init_process_group(backend, port=free_port(), **kwargs)
    assert str(info.value).startswith(field)
    assert "invalid" in str(info.value)
    assert not torch.distributed.is_initialized()


ENV = {"RANK": "5", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("missing", sorted(ENV))
async def test_init_from_env_names_the_missing_variable(monkeypatch, missing):
    # RANK=5 with WORLD_SIZE=1 could never join a group: nothing here rendezvouses.
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(missing)
    with pytest.raises(ConfigError) as info:
        await init_process_group_from_env("gloo")
    assert f"environment variable {missing} is not set" in str(info.value)
    assert not torch.distributed.is_initialized()


async def test_init_from_env_rejects_non_integers(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError) as info:
        await init_process_group_from_env("gloo")
    assert "must be integers" in str(info.value)
    assert "'two'" in str(info.value)


async def test_init_from_env_validates_the_values_it_read(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        await init_process_group_from_env("gloo")
    assert str(info.value).startswith("rank=5 is invalid")


async def listening_addresses(ctx: RankContext) -> list[str]:
    """The addresses this rank's process listens on (TCP), once every rank has joined."""
    dist.barrier(ctx.group)
    sockets = psutil.Process().net_connections("tcp")
    return sorted({c.laddr.ip for c in sockets if c.status == psutil.CONN_LISTEN})


async def test_local_ranks_listen_on_the_loopback_interface_only():
    # Rank 0 serves the rendezvous store (torch's own listens on every interface), and
    # every rank's gloo group listens for its peers: docs/security.md.
    addresses = await run_ranks(listening_addresses, 2)
    assert all(addresses), addresses
    assert all(ipaddress.ip_address(a).is_loopback for ranks in addresses for a in ranks)
