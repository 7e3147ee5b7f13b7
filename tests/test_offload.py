"""Offload placements and compressed compute copies.

The offload flags choose where tensors live: master shards and optimizer state
(``offload_optimizer_states``), compute copies (``offload_params``) and gradient
shards (``offload_grads``) go to the CPU or stay on the compute device. On a
CPU-only machine the compute device *is* the CPU, so all eight combinations
resolve to the same places and run one code path: the fp32 compute copy aliases
the master (``ParameterStore.put_master``), gradient shards stay where the
reduce-scatter left them (no device-to-host copy in ``GradientStore.commit_layer``),
and the construction-time CPU need counts the same bytes. Every other test runs
with all three flags on (the defaults); this file keeps the one other value,
all off. The placements that differ (a separate compute copy, staged encoding,
device-to-host gradient copies) need a GPU: ``test_cuda.py`` runs all eight
combinations there. A compressed compute copy is a tensor of its own on every
device: the runs below cover that path (encode into a second tensor, decode on
gather) for each format.
"""

from __future__ import annotations

import pytest
from helpers import TrainSpec, compare, reference, run_named, train

# Every test here reads the runs of one fixture (about 5 s on 2 cores).
pytestmark = pytest.mark.slow

METHODS = ("none", "fp16", "bf16", "int8")
NOTHING_OFFLOADED = TrainSpec(
    steps=4,
    config={"offload_params": False, "offload_grads": False, "offload_optimizer_states": False},
)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """On 2 ranks, in one rank run: 50 steps with each compression format (fp16 only needs
    its byte counts: 2 steps) and a short run with nothing offloaded."""
    specs = {
        method: TrainSpec(
            steps=2 if method == "fp16" else 50, lr=3e-3, config={"cpu_compression": method}
        )
        for method in METHODS
    }
    specs["nothing-offloaded"] = NOTHING_OFFLOADED
    return run_named(2, {name: (train, spec) for name, spec in specs.items()})


def test_nothing_offloaded_matches_torch(runs: dict[str, list[dict]]) -> None:
    ref_losses, ref_state = reference(NOTHING_OFFLOADED, "adamw")
    loss_err, param_err = compare(runs["nothing-offloaded"], ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4
    for result in runs["nothing-offloaded"]:
        # fp32 on the compute device: the compute copy is the master itself.
        assert result["memory"]["compute_copy_bytes"] == 0


def int8_bytes(shards: list[int], block: int) -> int:
    return sum(n + 4 * -(-n // block) for n in shards)


@pytest.mark.parametrize("method", ["fp16", "bf16", "int8"])
def test_compute_copy_bytes_are_counted(runs: dict[str, list[dict]], method: str) -> None:
    for result in runs[method]:
        mem = result["memory"]
        shards = [shard for _, _, shard in result["layouts"].values()]
        assert mem["master_param_bytes"] == 4 * sum(shards)
        # The flat fp32 gradient buffers live during a backward only: once its last
        # reduce-scatter is launched they are dropped (allocated again by the next).
        assert mem["gradient_buffer_bytes"] == 0
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
            + mem["shared_memory_bytes"]
        )
        assert mem["cpu_memory_used"] == (
            mem["master_param_bytes"] + expected + mem["optimizer_state_bytes"] + device_buffers
        )
    # With fp32 and no compression the compute copy is the master itself.
    assert runs["none"][0]["memory"]["compute_copy_bytes"] == 0


def mean_loss(results: list[dict], last: int = 5) -> float:
    steps = [
        sum(r["losses"][i] for r in results) / len(results)
        for i in range(len(results[0]["losses"]))
    ]
    return sum(steps[-last:]) / last


@pytest.mark.parametrize(("method", "tolerance"), [("bf16", 0.02), ("int8", 0.05)])
def test_compressed_training_reaches_fp32_loss(
    runs: dict[str, list[dict]], method: str, tolerance: float
) -> None:
    fp32 = mean_loss(runs["none"])
    first = runs["none"][0]["losses"][0]
    assert fp32 < 0.6 * first, "the task must be learned for the comparison to mean anything"
    assert abs(mean_loss(runs[method]) - fp32) <= tolerance * fp32
    # Compression is lossy: the trajectories are not bit-identical to fp32.
    assert runs[method][0]["losses"] != runs["none"][0]["losses"]
