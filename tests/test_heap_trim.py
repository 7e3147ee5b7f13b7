"""``trim_heap_after_forward``: a trim at the end of each training forward, in both modes,
and in module mode one more as the forward enters its last unit (the head), on real ranks;
nothing else changes (losses and parameters bitwise those of a run without)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import run_named
from hf_models import batch, build, call_kwargs, local, loss_of, make_config
from torch import nn

from zero3_offload import Zero3CpuOffloadManager
from zero3_offload.testing import RankContext

STEPS = 4  # micro-steps (accumulation 2): 2 optimizer steps


def _trims(manager: Zero3CpuOffloadManager) -> list[int]:
    events = manager.get_performance_stats().timeline
    return [e.nbytes for e in events if e.kind == "heap-trim"]


async def train_module(ctx: RankContext, trim: bool) -> dict[str, Any]:
    """The tiny Llama in module mode, then one evaluation forward."""
    model = build("llama")
    manager = Zero3CpuOffloadManager(
        make_config({"trim_heap_after_forward": trim}), ctx.group, model
    )
    losses = []
    for i in range(STEPS):
        out = await manager.forward(**call_kwargs("llama", local(batch(i, "llama"), ctx)))
        await manager.backward(loss_of(out))
        losses.append(loss_of(out).item())
        await manager.optimizer_step(1e-3)
    trims = len(_trims(manager))
    with torch.no_grad():
        await manager.forward(**call_kwargs("llama", local(batch(99, "llama"), ctx)))
    after_eval = len(_trims(manager))
    state = await manager.full_state_dict()
    await manager.close()
    return {"losses": losses, "state": state, "trims": trims, "after_eval": after_eval}


async def train_chain(ctx: RankContext, trim: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    layers = {f"l{i}": nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for i in range(3)}
    manager = Zero3CpuOffloadManager(
        make_config({"trim_heap_after_forward": trim}), ctx.group, layers
    )
    losses = []
    for i in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))[ctx.rank :: 2]
        out = await manager.forward_pass(x, list(layers))
        out.requires_grad_()
        loss = out.pow(2).mean()
        loss.backward()
        await manager.backward_pass(out.grad, list(layers))
        losses.append(loss.item())
        await manager.optimizer_step(1e-2)
    trims = len(_trims(manager))
    state = await manager.full_state_dict()
    await manager.close()
    return {"losses": losses, "state": state, "trims": trims}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any]]:
    calls = {
        f"{mode}-{trim}": (fn, trim)
        for mode, fn in (("module", train_module), ("chain", train_chain))
        for trim in (False, True)
    }
    return run_named(2, calls)


@pytest.mark.parametrize("mode", ["module", "chain"])
def test_the_trims_of_each_training_forward_change_no_number(
    runs: dict[str, list[Any]], mode: str
) -> None:
    for plain, trimmed in zip(runs[f"{mode}-False"], runs[f"{mode}-True"], strict=True):
        assert plain["trims"] == 0
        # One heap-trim interval per training forward, and in module mode one before its
        # last unit (the timeline keeps the recent steps: both of this run's).
        assert trimmed["trims"] == STEPS * (2 if mode == "module" else 1)
        assert trimmed["losses"] == plain["losses"]
        assert trimmed["state"].keys() == plain["state"].keys()
        assert all(torch.equal(trimmed["state"][k], v) for k, v in plain["state"].items())
    if mode == "module":  # an evaluation forward trims nothing
        assert all(r["after_eval"] == r["trims"] for r in runs["module-True"])
