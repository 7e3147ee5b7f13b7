"""Rank functions run by ``zero3_offload.testing.run_ranks`` (module level, so they pickle)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from models import lm_loss, make_batches, make_model

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext


@attrs.frozen
class TrainSpec:
    """One training run: model, data, optimizer and manager settings."""

    steps: int = 10
    batch: int = 8
    lr: float = 1e-3
    optimizer: dict[str, Any] = attrs.Factory(lambda: {"kind": "adamw"})
    config: dict[str, Any] = attrs.Factory(dict)
    model: dict[str, Any] = attrs.Factory(dict)
    micro_steps: int = 1  # micro-batches per rank per step (must match config's accumulation)
    early_lr: bool = False  # pass learning_rate to backward_pass (updates may start early)
    inject_inf: tuple[int, int] | None = None  # (rank, step): that rank's grad_output gets an inf
    timeline: bool = False  # return rank's timeline events
    first_step: int = 0  # index of the first batch (to continue a run)
    load_dir: str | None = None  # load this checkpoint before training
    save_dir: str | None = None  # save a checkpoint here after training
    seed: int | None = None  # torch.manual_seed(seed + step) before each step's forwards


def local_slice(t: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    per = t.shape[0] // ctx.world_size
    return t[ctx.rank * per : (ctx.rank + 1) * per]


async def train(ctx: RankContext, spec: TrainSpec) -> dict[str, Any]:
    """Train with the manager on this rank's slice of every batch.

    Returns the per-step local losses, the final full state dict (rank 0 only)
    and the memory stats after the last step.
    """
    model = make_model(**spec.model)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(optimizer=OptimizerConfig(**spec.optimizer), **spec.config)
    losses, norms, stepped_flags, scales, states = [], [], [], [], []
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        if spec.load_dir is not None:
            await manager.load_checkpoint(spec.load_dir)
        batches = make_batches(spec.first_step + spec.steps, spec.batch)[spec.first_step :]
        for step, (x, y) in enumerate(batches, start=spec.first_step):
            xs, ys = local_slice(x, ctx), local_slice(y, ctx)
            per = xs.shape[0] // spec.micro_steps
            step_loss = 0.0
            if spec.seed is not None:
                torch.manual_seed(spec.seed + step)
            for m in range(spec.micro_steps):
                mine = slice(m * per, (m + 1) * per)
                out = await manager.forward_pass(xs[mine], names)
                out.requires_grad_()
                loss = lm_loss(out.float(), ys[mine])
                loss.backward()
                grad = out.grad
                if spec.inject_inf == (ctx.rank, step):
                    grad = grad.clone()
                    grad.view(-1)[0] = float("inf")
                lr = spec.lr if spec.early_lr else None
                await manager.backward_pass(grad, names, learning_rate=lr)
                stepped = await manager.optimizer_step(spec.lr)
                if spec.inject_inf is None:
                    assert stepped == (m == spec.micro_steps - 1), (m, stepped)
                step_loss += loss.item() / spec.micro_steps
            losses.append(step_loss)
            norms.append(manager.last_grad_norm)
            stepped_flags.append(stepped)
            scales.append(manager.loss_scale)
            if spec.inject_inf is not None:
                states.append(await manager.full_state_dict())
        if spec.save_dir is not None:
            await manager.save_checkpoint(spec.save_dir)
        state = await manager.full_state_dict()
        memory = manager.get_memory_stats()
        layouts = {
            n: (lay.numel, lay.padded_numel, lay.shard_numel)
            for n, lay in manager.engine.layouts.items()
        }
    return {
        "losses": losses,
        "grad_norms": norms,
        "stepped": stepped_flags,
        "loss_scales": scales,
        "states": states if ctx.rank == 0 else None,
        "timeline": [attrs.astuple(e) for e in manager.get_performance_stats().timeline]
        if spec.timeline
        else None,
        "state": state if ctx.rank == 0 else None,
        "memory": attrs.asdict(memory),
        "layouts": layouts,
    }


async def memory_probe(ctx: RankContext, spec: TrainSpec) -> dict[str, Any]:
    """Memory stats after a backward (gradients held) and after the step."""
    model = make_model(**spec.model)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(optimizer=OptimizerConfig(**spec.optimizer), **spec.config)
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        (x, y), *_ = make_batches(1, spec.batch)
        out = await manager.forward_pass(local_slice(x, ctx), names)
        after_forward = attrs.asdict(manager.get_memory_stats())
        out.requires_grad_()
        lm_loss(out, local_slice(y, ctx)).backward()
        await manager.backward_pass(out.grad, names)
        after_backward = attrs.asdict(manager.get_memory_stats())
        await manager.optimizer_step(spec.lr)
        after_step = attrs.asdict(manager.get_memory_stats())
        # What the model object itself still holds between steps.
        model_param_elements = sum(p.numel() for p in model.parameters())
        shards = {n: lay.shard_numel for n, lay in manager.engine.layouts.items()}
        padded = {n: lay.padded_numel for n, lay in manager.engine.layouts.items()}
    return {
        "after_forward": after_forward,
        "after_backward": after_backward,
        "after_step": after_step,
        "model_param_elements": model_param_elements,
        "shards": shards,
        "padded": padded,
    }


@attrs.frozen
class OrderSpec:
    """Training where each step may run its own layer order (subsets of the model)."""

    orders: tuple[tuple[str, ...], ...]
    config: dict[str, Any] = attrs.Factory(dict)
    batch: int = 8
    lr: float = 1e-3


async def train_orders(ctx: RankContext, spec: OrderSpec) -> dict[str, Any]:
    """Like ``train`` with a per-step layer order; also returns prefetch metrics per step."""
    import structlog

    model = make_model()
    config = Zero3CpuOffloadConfig(**spec.config)
    per_step, statuses = [], []
    with structlog.testing.capture_logs() as logs:
        async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
            batches = make_batches(len(spec.orders), spec.batch)
            for names, (x, y) in zip(spec.orders, batches, strict=True):
                out = await manager.forward_pass(local_slice(x, ctx), list(names))
                out.requires_grad_()
                lm_loss(out, local_slice(y, ctx)).backward()
                await manager.backward_pass(out.grad, list(names))
                await manager.optimizer_step(spec.lr)
                stats = manager.get_performance_stats()
                per_step.append(dict(stats.prefetch))
                statuses.append(attrs.asdict(manager.get_prefetch_status()))
            state = await manager.full_state_dict()
            high_water = manager.get_memory_stats().gathered_high_water_bytes
            memory_cycles = manager.get_memory_stats().pressure_checks
            status = manager.get_prefetch_status()
            depth, persistent = status.current_prefetch_distance, list(status.persistent_layers)
            persistence_on = status.persistence_enabled
            freed = await manager.force_memory_optimization()
            after_force = attrs.asdict(manager.get_memory_stats())
            adapted = await manager.adapt_performance()
        closed_status = attrs.asdict(manager.get_prefetch_status())
    return {
        "state": state,
        "high_water": high_water,
        "per_step": per_step,
        "statuses": statuses,
        "events": [e["event"] for e in logs],
        "memory_cycles": memory_cycles,
        "depth": depth,
        "persistent": persistent,
        "persistence_on": persistence_on,
        "freed": freed,
        "after_force": after_force,
        "adapted": adapted,
        "closed_status": closed_status,
    }


async def eval_probe(ctx: RankContext, spec: TrainSpec) -> dict[str, Any]:
    """A forward under torch.no_grad() between training steps: output, what it keeps,
    what a backward after it says; then the training continues."""
    from zero3_offload.errors import StateError

    model = make_model(**spec.model)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(**spec.config)
    (x, y), (x2, y2) = make_batches(2, spec.batch)
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        with torch.no_grad():
            evaluated = await manager.forward_pass(local_slice(x, ctx), names)
        kept_by_eval = manager.get_memory_stats().activation_bytes
        try:
            await manager.backward_pass(torch.zeros_like(evaluated), names)
            error = ""
        except StateError as exc:
            error = str(exc)
        losses = []
        for xb, yb in ((x, y), (x2, y2)):
            out = await manager.forward_pass(local_slice(xb, ctx), names)
            if not losses:
                trained_out = out.clone()
            out.requires_grad_()
            loss = lm_loss(out, local_slice(yb, ctx))
            loss.backward()
            await manager.backward_pass(out.grad, names)
            await manager.optimizer_step(spec.lr)
            losses.append(loss.item())
        state = await manager.full_state_dict()
    return {
        "evaluated": evaluated,
        "trained_out": trained_out,
        "kept_by_eval": kept_by_eval,
        "error": error,
        "losses": losses,
        "state": state if ctx.rank == 0 else None,
    }
