"""Bad input gets a clear library error, and a call that raised changes nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from helpers import VOCAB, lm_loss, make_batches, make_model, run_named
from torch import nn

from zero3_offload import (
    ConfigError,
    InputError,
    LayerExecutionError,
    LayerNotFoundError,
    StateError,
    Zero3CpuOffloadConfig,
    Zero3CpuOffloadManager,
    Zero3Error,
)
from zero3_offload.testing import RankContext


async def snapshot(manager: Zero3CpuOffloadManager) -> dict[str, Any]:
    """Everything a failed call must leave as it was."""
    # Gradients, optimizer state and the step state have no public view: read
    # them from the components.
    engine, names = manager.engine, manager.layer_names
    return {
        "params": await manager.full_state_dict(),
        "grads": {n: g.clone() for n in names if (g := engine.grads.get(n)) is not None},
        "opt": {
            n: {k: v.clone() for k, v in engine.optimizer.layer_state(n).items()} for n in names
        },
        "forward": manager._state.forward,
        "calls": engine.counter.window_calls,
        "early_lr": manager._state.early_lr,
        "micro": engine.grads.micro_steps,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        return x is y or x == y

    return eq(a, b)


async def expect(
    manager: Zero3CpuOffloadManager,
    exc_type: type[Exception],
    call: Callable[[], Awaitable[Any]],
) -> str:
    before = await snapshot(manager)
    try:
        await call()
    except exc_type as exc:
        assert isinstance(exc, Zero3Error)
        message = str(exc)
    else:
        raise AssertionError(f"expected {exc_type.__name__}")
    assert same(before, await snapshot(manager)), f"state changed by a call that raised: {message}"
    return message


async def bad_calls(ctx: RankContext) -> dict[str, str]:
    model = make_model()
    names = model.layer_names
    manager = Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), ctx.group, model)
    (x, y), *_ = make_batches(1, 4)
    msgs: dict[str, str] = {}
    msgs["unknown"] = await expect(
        manager, LayerNotFoundError, lambda: manager.forward_pass(x, [*names, "nope"])
    )
    msgs["str_names"] = await expect(manager, InputError, lambda: manager.forward_pass(x, "embed"))
    msgs["no_forward"] = await expect(
        manager, StateError, lambda: manager.backward_pass(torch.zeros(4, 12, VOCAB), names)
    )
    msgs["step_first"] = await expect(manager, StateError, lambda: manager.optimizer_step(1e-3))

    # One good micro-step, so later failures have gradients and state to disturb.
    out = await manager.forward_pass(x, names)
    out.requires_grad_()
    lm_loss(out, y).backward()
    await manager.backward_pass(out.grad, names)
    await manager.optimizer_step(1e-3)

    out = await manager.forward_pass(x, names)
    out.requires_grad_()
    lm_loss(out, y).backward()
    msgs["shape"] = await expect(
        manager, InputError, lambda: manager.backward_pass(out.grad[:, :5], names)
    )
    msgs["other_names"] = await expect(
        manager, StateError, lambda: manager.backward_pass(out.grad, names[1:])
    )
    msgs["layer_raises"] = await expect(
        manager, LayerExecutionError, lambda: manager.forward_pass(x.float(), names)
    )
    # A pass that failed while running leaves no gather in flight.
    status = manager.get_prefetch_status()
    assert status.active_operations == 0 and status.inflight_bytes == 0, status
    msgs["lr"] = await expect(manager, ConfigError, lambda: manager.optimizer_step(-1.0))
    # The forward kept by the failed calls still serves a correct backward.
    await manager.backward_pass(out.grad, names)
    assert await manager.optimizer_step(1e-3)
    msgs["backward_twice"] = await expect(
        manager, StateError, lambda: manager.backward_pass(out.grad, names)
    )
    await manager.close()
    try:
        await manager.forward_pass(x, names)
    except StateError as exc:
        msgs["closed"] = str(exc)
    return msgs


async def bad_models(ctx: RankContext) -> dict[str, str]:
    msgs: dict[str, str] = {}
    config = Zero3CpuOffloadConfig()

    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.lin = nn.Linear(3, 3)

    shared = nn.Linear(4, 4)
    cases: dict[str, Any] = {
        "direct": Direct(),
        "shared": {"a": shared, "b": nn.Sequential(shared)},
        "empty": nn.Module(),
        "not_module": {"a": 3},
    }
    for key, model in cases.items():
        try:
            Zero3CpuOffloadManager(config, ctx.group, model)
        except Zero3Error as exc:
            msgs[key] = str(exc)
    if not torch.cuda.is_available():
        try:
            Zero3CpuOffloadManager(Zero3CpuOffloadConfig(device="cuda"), ctx.group, make_model())
        except ConfigError as exc:
            msgs["cuda"] = str(exc)
    return msgs


@pytest.fixture(scope="module")
def messages() -> dict[str, str]:
    runs = run_named(1, {"calls": (bad_calls,), "models": (bad_models,)})
    (calls,), (models,) = runs["calls"], runs["models"]
    return {**calls, **models}


def test_unknown_layer_lists_known_names(messages: dict[str, str]) -> None:
    msg = messages["unknown"]
    assert "'nope'" in msg
    for name in make_model().layer_names:
        assert repr(name) in msg


def test_pass_arguments(messages: dict[str, str]) -> None:
    assert "sequence of layer names" in messages["str_names"]
    assert "(4, 5, 37)" in messages["shape"] and "(4, 12, 37)" in messages["shape"]
    assert "same names" in messages["other_names"]
    assert "'embed'" in messages["layer_raises"]


def test_call_order(messages: dict[str, str]) -> None:
    assert "without a forward_pass" in messages["no_forward"]
    assert "without a forward_pass" in messages["backward_twice"]
    assert "without a backward_pass" in messages["step_first"]
    assert "learning_rate=-1.0" in messages["lr"]
    assert "closed" in messages["closed"]


def test_unpartitionable_models(messages: dict[str, str]) -> None:
    assert "['w']" in messages["direct"]
    assert "b.0.weight" in messages["shared"] and "a.weight" in messages["shared"]
    assert "no layers" in messages["empty"]
    assert "['a']" in messages["not_module"]
    if not torch.cuda.is_available():
        assert "CUDA is not available" in messages["cuda"]
