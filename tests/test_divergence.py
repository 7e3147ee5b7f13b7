"""Ranks whose calls differ get RankDivergenceError on every rank, naming the ranks and
what each was about to run, instead of a crash inside gloo (different sizes), a hang,
or silently mixed data (equal sizes); the processes live on (default config).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch
from helpers import lm_loss, local_slice, make_batches, make_model

from zero3_offload import (
    CommunicationError,
    RankDivergenceError,
    Zero3CpuOffloadConfig,
    Zero3CpuOffloadManager,
)
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext, run_ranks

CASES = ("layers", "no_grad", "skipped_micro_step", "other_call", "same_size_other_layer")


def config() -> Zero3CpuOffloadConfig:
    # Defaults (the check is on by default), with an accumulation window of 2.
    return Zero3CpuOffloadConfig(gradient_accumulation_steps=2)


async def micro_step(manager: Zero3CpuOffloadManager, x: torch.Tensor, y: torch.Tensor) -> None:
    names = list(manager.layer_names)
    out = await manager.forward_pass(x, names)
    out.requires_grad_()
    lm_loss(out, y).backward()
    await manager.backward_pass(out.grad, names)


async def diverge(ctx: RankContext, case: str, tmp: str) -> dict[str, Any]:
    """Both ranks build the same manager, then make calls that differ as ``case`` says."""
    # Two blocks of equal size: gathering block0 on one rank and block1 on the
    # other pairs two collectives of the same size.
    manager = Zero3CpuOffloadManager(config(), ctx.group, make_model(n_blocks=3))
    names = list(manager.layer_names)
    x, y = (local_slice(t, ctx) for t in make_batches(1, 8)[0])
    zero = ctx.rank == 0
    result: dict[str, Any] = {}
    try:
        if case == "layers":
            await manager.forward_pass(x, names if zero else names[1:])
        elif case == "no_grad":
            with torch.no_grad() if zero else contextlib.nullcontext():
                await manager.forward_pass(x, names)
        elif case == "skipped_micro_step":
            await micro_step(manager, x, y)
            if zero:  # rank 1 forgets to call optimizer_step for this micro-step
                await manager.optimizer_step(1e-3)
            await micro_step(manager, x, y)
        elif case == "other_call":
            if zero:
                await manager.save_checkpoint(tmp)
            else:
                await manager.forward_pass(x, names)
        elif case == "same_size_other_layer":
            # embed, then block0 on rank 0 but block1 on rank 1 (same number of bytes).
            chosen = ["embed", "block0"] if zero else ["embed", "block1"]
            await manager.forward_pass(x, chosen)
        else:
            raise ValueError(case)
        result["error"] = None
    except Zero3Error as exc:
        result.update(error=type(exc).__name__, message=str(exc))
        result["is_communication_error"] = isinstance(exc, CommunicationError)
    # The group's sequence is broken now: a later call fails at once, it does not hang.
    try:
        await manager.forward_pass(x, names)
        result["after"] = None
    except Zero3Error as exc:
        result["after"] = (type(exc).__name__, str(exc))
    await manager.close()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_diverging_ranks_raise_on_every_rank(case: str, tmp_path: Any) -> None:
    results = asyncio.run(run_ranks(diverge, 2, case, str(tmp_path), timeout_s=120))
    for rank, result in enumerate(results):
        assert result["error"] == RankDivergenceError.__name__, (rank, result)
        assert result["is_communication_error"]
        message = result["message"]
        assert "rank 0 (check #" in message and "rank 1 (check #" in message
        assert result["after"] is not None and result["after"][0] in (
            "CommunicationError",
            "RankDivergenceError",
        )
    message = results[0]["message"]
    if case == "layers":
        assert "['embed', 'block0', 'block1', 'block2', 'ln_f', 'head']" in message
        assert "['block0', 'block1', 'block2', 'ln_f', 'head']" in message
    elif case == "no_grad":
        assert "under no_grad" in message
    elif case == "skipped_micro_step":
        # Rank 0's optimizer_step already prefetches the next forward's first layer.
        assert "during optimizer_step(0.001)" in message and "during forward_pass(" in message
    elif case == "other_call":
        assert "save_checkpoint(" in message and "forward_pass(" in message
    elif case == "same_size_other_layer":
        assert "the gather of 'block0'" in message or "['embed', 'block0']" in message
        assert "['embed', 'block1']" in message


async def agreeing(ctx: RankContext, check: bool) -> dict[str, Any]:
    """A normal run: with the check, every call is checked and none is refused."""
    cfg = Zero3CpuOffloadConfig(gradient_accumulation_steps=2, divergence_check=check)
    manager = Zero3CpuOffloadManager(cfg, ctx.group, make_model())
    x, y = (local_slice(t, ctx) for t in make_batches(1, 8)[0])
    before = manager.engine.comm.divergence_checks
    for _ in range(2):
        await micro_step(manager, x, y)
        await manager.optimizer_step(1e-3)
    checked = manager.engine.comm.divergence_checks - before
    state = await manager.full_state_dict()
    await manager.close()
    return {"checked": checked, "state": state}


def test_agreeing_ranks_check_every_call_and_train_the_same() -> None:
    on, off = (asyncio.run(run_ranks(agreeing, 2, check, timeout_s=120)) for check in (True, False))
    # Two micro-steps: each forward_pass and backward_pass launches collectives,
    # so each was checked once (optimizer_step too when it prefetches).
    assert on[0]["checked"] == on[1]["checked"] >= 2 * 2
    assert off[0]["checked"] == off[1]["checked"] == 0
    for name, value in on[0]["state"].items():
        assert torch.equal(value, off[0]["state"][name]), name


async def diverge_module_mode(ctx: RankContext) -> dict[str, Any]:
    """A transformers model in module mode: rank 1 leaves out the labels."""
    from hf_models import batch, build, call_kwargs, local

    manager = Zero3CpuOffloadManager(config(), ctx.group, build("llama"))
    x = local(batch(0, "llama"), ctx)
    kwargs = call_kwargs("llama", x)
    if ctx.rank == 1:
        del kwargs["labels"]
    try:
        await manager.forward(**kwargs)
        outcome: dict[str, Any] = {"error": None}
    except Zero3Error as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    await manager.close()
    return outcome


def test_module_mode_ranks_with_different_arguments_raise() -> None:
    pytest.importorskip("transformers")
    results = asyncio.run(run_ranks(diverge_module_mode, 2, timeout_s=120))
    for result in results:
        assert result["error"] == RankDivergenceError.__name__, result
    message = results[0]["message"]
    assert "forward(input_ids=tensor, labels=tensor, use_cache=False)" in message
    assert "forward(input_ids=tensor, use_cache=False)" in message
