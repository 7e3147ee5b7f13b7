"""Collectives through the host's shared memory: bitwise the backend's results, fallback.

See [Note: shared-memory collectives]. The expected values are computed on
every rank by the backend itself (gloo's all-gather, and the all-to-all plus
rank-order sum of [Note: reduce-scatter by exchange]), after the collectives
under test, on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import TrainSpec, assert_bitwise, run_named, train

from zero3_offload.comm import Collectives
from zero3_offload.comm.shared_memory import HostSharedMemory
from zero3_offload.testing import RankContext

CPU = torch.device("cpu")
BLOCK = 4096  # bytes per rank and slot: most tensors below take several rounds
# (dtype, elements per rank's shard / slice): one element, one round, many rounds with
# a partial last one, for every dtype the library sends.
GATHERS = [(torch.float32, 1), (torch.float32, 5003), (torch.bfloat16, 4099), (torch.uint8, 9001)]
SCATTERS = [(torch.float32, 1), (torch.float32, 3001), (torch.bfloat16, 2049)]
MODEL = {"d": 64, "n_blocks": 2}


def rounds_expected(world: int) -> int:
    gathers = sum(-(-n * dt.itemsize // BLOCK) for dt, n in GATHERS)
    scatters = sum(-(-n // (BLOCK // (world * dt.itemsize))) for dt, n in SCATTERS)
    return gathers + scatters


def data(rank: int, dtype: torch.dtype, n: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    return (torch.randn(n, generator=gen) * 3.0).to(dtype)


def exchange_mean(full: torch.Tensor, world: int) -> torch.Tensor:
    received = torch.empty_like(full)
    dist.all_to_all_single(received, full)
    out = torch.empty(full.numel() // world, dtype=full.dtype)
    torch.sum(received.view(world, -1), dim=0, out=out)
    return out.div_(world)


# Three ranks: the reduce-scatter's rank-order sum of three terms is not commutative.
@pytest.mark.ranks([3, 2])
async def test_shared_memory_collectives_equal_the_backend_bitwise(rank: RankContext) -> None:
    comm = Collectives(rank.group, device=CPU, timeout_s=60.0, shared_memory_block_bytes=BLOCK)
    world, me = rank.world_size, rank.rank
    assert comm.shared_memory is not None
    # Everything started before anything is awaited: the rounds run one after another.
    pending, outputs, inputs = [], [], []
    for salt, (dtype, n) in enumerate(GATHERS):
        shard, out = data(me, dtype, n, salt), torch.empty(world * n, dtype=dtype)
        pending.append(comm.start_all_gather(out, shard, what=f"gather {salt}"))
        outputs.append(out)
        inputs.append(shard)
    for salt, (dtype, n) in enumerate(SCATTERS, start=len(GATHERS)):
        full, out = data(me, dtype, world * n, salt), torch.empty(n, dtype=dtype)
        pending.append(comm.start_reduce_scatter_mean(out, full, what=f"scatter {salt}"))
        outputs.append(out)
        inputs.append(full)
    for p in reversed(pending):
        await p.wait()
    await comm.flush()
    for i, (out, x) in enumerate(zip(outputs, inputs, strict=True)):
        if i < len(GATHERS):
            expected = torch.empty_like(out)
            dist.all_gather_into_tensor(expected, x)
        else:
            expected = exchange_mean(x, world)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), i
    assert comm.shared_memory.rounds == rounds_expected(world)
    assert comm.shared_memory.nbytes == 4096 + 2 * world * BLOCK
    comm.close()


@pytest.mark.ranks(2)
@pytest.mark.parametrize(
    ("hostile", "opened"), [("token", False), ("pid", False), ("size", False), ("none", True)]
)
async def test_a_rank_that_cannot_open_the_region_makes_every_rank_fall_back(
    rank: RankContext, hostile: str, opened: bool
) -> None:
    comm = Collectives(rank.group, device=CPU, timeout_s=60.0)
    assert comm.shared_memory is None  # no block size: the backend only

    def broadcast(t: torch.Tensor) -> None:
        comm.start_broadcast(t).wait_blocking()
        if rank.rank == 1:  # what rank 1 would read on another host
            _, _, token, size = t.tolist()
            if hostile == "token":
                t[2] = token ^ 1  # another region with the same pid and descriptor
            elif hostile == "pid":
                t[0] = 2**22 + 1  # above the kernel's largest pid: no such process
            elif hostile == "size":
                t[3] = size + 4096

    region = HostSharedMemory.open(
        rank.group,
        block_bytes=BLOCK,
        broadcast=broadcast,
        agree=lambda ok: comm.start_agree(ok).wait_blocking(),
    )
    assert (region is not None) == opened
    # The group still works through the backend afterwards.
    total = torch.tensor([float(rank.rank + 1)])
    await comm.all_reduce_sum(total)
    assert total.item() == 3.0
    comm.close()


def test_training_through_shared_memory_is_bitwise_training_through_the_backend() -> None:
    specs = {
        "shm": {},
        "backend": {"shared_memory_collectives": False},
        "shm_compressed": {"gather_compression": "int8", "reduce_dtype": "bf16"},
        "backend_compressed": {
            "gather_compression": "int8",
            "reduce_dtype": "bf16",
            "shared_memory_collectives": False,
        },
    }
    runs = run_named(
        2, {k: (train, TrainSpec(steps=3, model=MODEL, config=c)) for k, c in specs.items()}
    )
    for a, b in (("shm", "backend"), ("shm_compressed", "backend_compressed")):
        assert_bitwise(runs[a][0]["state"], runs[b][0]["state"])  # the full state, on rank 0
        for ra, rb in zip(runs[a], runs[b], strict=True):
            assert ra["losses"] == rb["losses"]
            for op in ("all_gather", "reduce_scatter"):
                ca, cb = ra["performance"].communication[op], rb["performance"].communication[op]
                assert (ca.operations, ca.bytes) == (cb.operations, cb.bytes)
    for r in runs["shm"]:
        assert r["memory"]["shared_memory_bytes"] == 4096 + 2 * 2 * 8 * 2**20
    for r in runs["backend"]:
        assert r["memory"]["shared_memory_bytes"] == 0
