"""CUDA paths: pinned host copies, side streams, NCCL. Skipped without a GPU.

Run on a GPU machine with ``python -m pytest -m cuda``; world size 1 with NCCL
exercises every device path on a single GPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from helpers import TrainSpec, compare, lm_loss, make_batches, make_model, reference, train

from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMBOS = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize(("params", "grads", "states"), COMBOS)
async def test_cuda_offload_combinations_match_torch(
    params: bool, grads: bool, states: bool
) -> None:
    spec = TrainSpec(
        steps=5,
        config={
            "device": "cuda",
            "offload_params": params,
            "offload_grads": grads,
            "offload_optimizer_states": states,
        },
    )
    ref_losses, ref_state = reference(spec, "adamw")
    results = await run_ranks(train, 1, spec, backend="nccl")
    loss_err, param_err = compare(results, ref_losses, ref_state)
    assert loss_err < 1e-4
    assert param_err < 1e-4


async def placement(ctx: RankContext) -> dict[str, Any]:
    model = make_model()
    names = model.layer_names
    config = Zero3CpuOffloadConfig(device="cuda", cpu_compression="bf16", pin_cpu_memory=True)
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        (x, y), *_ = make_batches(1, 4)
        out = await manager.forward_pass(x, names)
        out.requires_grad_()
        lm_loss(out.float(), y).backward()
        await manager.backward_pass(out.grad, names, learning_rate=1e-3)
        await manager.optimizer_step(1e-3)
        copy = manager.engine.params.compute_copy(names[-1])
        master = manager.engine.params.master(names[-1])
        return {
            "copy_pinned": copy.payload.is_pinned(),
            "copy_dtype": str(copy.payload.dtype),
            "master_device": master.device.type,
            "gpu_bytes_after_step": manager.get_memory_stats().gpu_memory_used,
            "timeline_kinds": sorted({e.kind for e in manager.get_performance_stats().timeline}),
        }


async def test_cuda_pinned_compressed_copies_and_streams() -> None:
    (r,) = await run_ranks(placement, 1, backend="nccl")
    assert r["copy_pinned"] and r["copy_dtype"] == "torch.bfloat16"
    assert r["master_device"] == "cpu"
    assert r["gpu_bytes_after_step"] == 0  # everything offloaded, nothing gathered
    assert {"gather", "compute", "cpu-optimizer", "compress"} <= set(r["timeline_kinds"])


async def test_cuda_bf16_compute() -> None:
    spec = TrainSpec(config={"device": "cuda", "compute_dtype": "bf16"})
    ref_losses, ref_state = reference(spec, "adamw")
    loss_err, param_err = compare(
        await run_ranks(train, 1, spec, backend="nccl"), ref_losses, ref_state
    )
    assert loss_err < 1e-2 and param_err < 5e-3


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_cuda_gathers_from_compute_copies_on_disk_match_memory(
    tmp_path: Any, compression: str
) -> None:
    base = {"device": "cuda", "cpu_compression": compression}
    disk = {**base, "offload_param_device": "nvme", "nvme_path": str(tmp_path)}
    ram = await run_ranks(train, 1, TrainSpec(steps=3, config=base), backend="nccl")
    nvme = await run_ranks(train, 1, TrainSpec(steps=3, config=disk), backend="nccl")
    assert ram[0]["losses"] == nvme[0]["losses"]
    for name, value in ram[0]["state"].items():
        assert torch.equal(value, nvme[0]["state"][name]), name
    assert not any(tmp_path.iterdir())


async def pinned_read_buffers(ctx: RankContext, path: str) -> bool:
    config = Zero3CpuOffloadConfig(device="cuda", offload_param_device="nvme", nvme_path=path)
    async with Zero3CpuOffloadManager(config, ctx.group, make_model()) as manager:
        disk = manager.engine.params.disk
        assert disk is not None
        return all(buffer.is_pinned() for buffer in disk._buffers)


async def test_cuda_read_buffers_of_copies_on_disk_are_pinned(tmp_path: Any) -> None:
    assert await run_ranks(pinned_read_buffers, 1, str(tmp_path), backend="nccl") == [True]
