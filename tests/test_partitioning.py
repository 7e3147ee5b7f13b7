"""Partitioning is real: each rank holds 1/N of the model state (plus padding)."""

from __future__ import annotations

import pytest
from helpers import (
    TrainSpec,
    lm_loss,
    local_slice,
    make_batches,
    make_model,
    make_torch_optimizer,
    memory_probe,
    train_reference,
)

from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext


def unpartitioned_bytes() -> dict[str, int]:
    """Bytes plain PyTorch holds for the same model after one AdamW step."""
    model = make_model()
    opt = make_torch_optimizer("adamw", model.parameters())
    train_reference(model, make_batches(1, 8), opt)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    moments = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for key, t in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    return {"params": params, "grads": grads, "moments": moments}


# Four ranks: a quarter of every layer plus padding of up to 3 elements. Two ranks take
# the same path (the layouts, stores and accounting do not depend on the world size).
@pytest.mark.ranks(4)
async def test_each_rank_holds_one_nth(rank: RankContext) -> None:
    world = rank.world_size
    full = unpartitioned_bytes()
    # Prefetch and keeping for the backward off: then exactly one layer is gathered at a time.
    config = {"async_prefetch": False, "keep_gathered_for_backward": False}
    r = await memory_probe(rank, TrainSpec(config=config))
    padding = sum(r["padded"].values()) - full["params"] // 4
    assert 0 <= padding < world * len(r["padded"])
    share = {k: (v + 4 * padding) // world for k, v in full.items()}
    owned = sum(r["shards"].values())
    assert owned * world == full["params"] // 4 + padding
    after_step = r["after_step"]
    assert after_step["master_param_bytes"] == share["params"]
    assert after_step["compute_copy_bytes"] == 0  # fp32 on CPU: the master is the copy
    assert r["after_backward"]["gradient_bytes"] == share["grads"]
    assert after_step["gradient_bytes"] == 0  # consumed by the step
    # AdamW: two moments per element plus one 4-byte step counter per layer shard.
    step_counters = 4 * len(r["shards"])
    assert after_step["optimizer_state_bytes"] == 2 * share["params"] + step_counters
    assert 2 * share["params"] * world == full["moments"] + 8 * padding
    # The model object holds no parameter storage between uses.
    assert r["model_param_elements"] == 0
    assert after_step["gathered_param_bytes"] == 0
    # At most one layer is gathered at a time.
    assert after_step["gathered_high_water_bytes"] == 4 * max(r["padded"].values())


@pytest.mark.ranks(2)
async def test_pending_gradient_shards_are_counted_until_committed(rank: RankContext) -> None:
    model = make_model()
    names = model.layer_names
    seen: list[int] = []
    async with Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), rank.group, model) as manager:
        # Runs inside backward_pass, when every later layer's reduce-scatter is launched.
        model.embed.register_full_backward_pre_hook(
            lambda *_: seen.append(manager.get_memory_stats().pending_gradient_bytes)
        )
        (x, y), *_ = make_batches(1, 8)
        out = await manager.forward_pass(local_slice(x, rank), names)
        out.requires_grad_()
        lm_loss(out, local_slice(y, rank)).backward()
        await manager.backward_pass(out.grad, names)
        after = manager.get_memory_stats()
        shards = {n: lay.shard_numel for n, lay in manager.engine.layouts.items()}
    # Every layer after the first has its fp32 shard in flight or landed, uncommitted.
    assert seen == [sum(4 * shards[n] for n in names[1:])]
    assert after.pending_gradient_bytes == 0
    assert after.gradient_bytes == 4 * sum(shards.values())
