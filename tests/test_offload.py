"""Offload placements and compressed compute copies.

On a CPU-only machine every placement is CPU memory, so the eight offload
combinations differ in which tensors alias which; ``test_cuda.py`` runs them
where the device is a GPU.
"""

from __future__ import annotations

import itertools

import pytest
from rank_bodies import TrainSpec, train
from test_equivalence import compare, reference

from zero3_offload.testing import run_ranks

COMBOS = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("params", "grads", "states"),
    COMBOS,
    ids=[f"p{int(a)}g{int(b)}s{int(c)}" for a, b, c in COMBOS],
)
async def test_every_offload_combination_matches_torch(
    params: bool, grads: bool, states: bool, world: int
) -> None:
    spec = TrainSpec(
        steps=4,
        config={
            "offload_params": params,
            "offload_grads": grads,
            "offload_optimizer_states": states,
        },
    )
    ref_losses, ref_state = reference(spec, "adamw")
    loss_err, param_err = compare(await run_ranks(train, world, spec), ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4


async def test_offload_on_four_ranks_with_accumulation() -> None:
    spec = TrainSpec(
        steps=4,
        batch=16,
        micro_steps=2,
        config={"gradient_accumulation_steps": 2, "offload_optimizer_states": False},
    )
    ref_losses, ref_state = reference(spec, "adamw")
    loss_err, param_err = compare(await run_ranks(train, 4, spec), ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4


def int8_bytes(shards: list[int], block: int) -> int:
    return sum(n + 4 * -(-n // block) for n in shards)


@pytest.fixture(scope="module")
def compressed_runs() -> dict[str, list[dict]]:
    import asyncio

    async def run_all() -> dict[str, list[dict]]:
        out = {}
        for method in ("none", "fp16", "bf16", "int8"):
            spec = TrainSpec(steps=50, lr=3e-3, config={"cpu_compression": method})
            out[method] = await run_ranks(train, 2, spec)
        return out

    return asyncio.run(run_all())


@pytest.mark.parametrize("method", ["fp16", "bf16", "int8"])
def test_compute_copy_bytes_are_counted(compressed_runs: dict, method: str) -> None:
    for result in compressed_runs[method]:
        mem = result["memory"]
        shards = [shard for _, _, shard in result["layouts"].values()]
        assert mem["master_param_bytes"] == 4 * sum(shards)
        # Two flat fp32 gradient buffers, each the size of the largest padded layer.
        largest = max(padded for _, padded, _ in result["layouts"].values())
        assert mem["gradient_buffer_bytes"] == 2 * 4 * largest
        if method == "int8":
            expected = int8_bytes(shards, 256)
            assert mem["master_param_bytes"] / 4 < expected < mem["master_param_bytes"] / 3.5
        else:
            expected = mem["master_param_bytes"] // 2
        assert mem["compute_copy_bytes"] == expected
        device_buffers = (
            mem["gathered_param_bytes"]
            + mem["inflight_param_bytes"]
            + mem["gather_pool_bytes"]
            + mem["gradient_buffer_bytes"]
        )
        assert mem["cpu_memory_used"] == (
            mem["master_param_bytes"] + expected + mem["optimizer_state_bytes"] + device_buffers
        )
    # With fp32 and no compression the compute copy is the master itself.
    assert compressed_runs["none"][0]["memory"]["compute_copy_bytes"] == 0


def mean_loss(results: list[dict], last: int = 5) -> float:
    steps = [
        sum(r["losses"][i] for r in results) / len(results)
        for i in range(len(results[0]["losses"]))
    ]
    return sum(steps[-last:]) / last


@pytest.mark.parametrize(("method", "tolerance"), [("bf16", 0.02), ("int8", 0.05)])
def test_compressed_training_reaches_fp32_loss(
    compressed_runs: dict, method: str, tolerance: float
) -> None:
    fp32 = mean_loss(compressed_runs["none"])
    first = compressed_runs["none"][0]["losses"][0]
    assert fp32 < 0.6 * first, "the task must be learned for the comparison to mean anything"
    assert abs(mean_loss(compressed_runs[method]) - fp32) <= tolerance * fp32
    # Compression is lossy: the trajectories are not bit-identical to fp32.
    assert compressed_runs[method][0]["losses"] != compressed_runs["none"][0]["losses"]
