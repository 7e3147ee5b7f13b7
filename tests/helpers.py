"""What the tests share: the small model, its data and loss, plain-PyTorch reference
training, comparisons, and the rank functions that ``run_ranks`` runs.

Every test compares the manager against plain single-process PyTorch built from
the same functions here. Rank functions live at module level so that rank
processes can unpickle them by name (``conftest.py`` puts ``tests/`` on the path).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import structlog
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.errors import StateError
from zero3_offload.testing import RankContext, run_ranks
from zero3_offload.testing.rank_runner import session_runner

VOCAB = 37
SEQ = 12

# ------------------------------------------------------------------------- model and data


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int, mlp: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(
            d, 3 * d, bias=False
        )  # a key bias has zero gradient: Adam would amplify noise
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp)
        self.fc2 = nn.Linear(mlp, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.empty(seq, d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Children first, then own parameters: meta initialisation replays this order.
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class TinyGPT(nn.Module):
    """Token embedding, ``n_blocks`` blocks, final LayerNorm, LM head; unequal layer sizes."""

    def __init__(
        self, *, d: int = 24, heads: int = 4, n_blocks: int = 2, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embed = Embed(VOCAB, d, SEQ)
        for i in range(n_blocks):
            # Unequal MLP widths give layers of unequal, odd sizes.
            self.add_module(f"block{i}", Block(d, heads, 4 * d + 3 * i + 1, dropout))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.named_children()]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = idx
        for module in self.children():
            h = module(h)
        return h


def make_model(seed: int = 0, **kwargs: object) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def make_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task: predict the next token of a shifted arithmetic sequence."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ------------------------------------------------------------------ plain PyTorch reference


class NormalizedSGD(torch.optim.Optimizer):
    """SGD on the gradient divided by its norm: not element-wise (it reduces over each
    tensor), so the manager must refuse it."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


def make_torch_optimizer(kind: str, params: object, **kw: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=kw.get("weight_decay", 0.0))
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, weight_decay=kw.get("weight_decay", 0.0))
    return torch.optim.SGD(
        params,
        lr=1e-2,
        momentum=kw.get("momentum", 0.9),
        nesterov=bool(kw.get("nesterov", False)),
        weight_decay=kw.get("weight_decay", 0.0),
    )


def train_reference(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    clip: float = 0.0,
    norms: list[float] | None = None,
    seed: int | None = None,
) -> list[float]:
    """Plain PyTorch training on whole batches; returns the loss per step.

    With ``clip``, the pre-clipping global norm of each step is appended to
    ``norms`` when given. With ``seed``, ``torch.manual_seed(seed + step)`` runs
    before each step's forward (as ``TrainSpec.seed`` does on the ranks).
    """
    losses = []
    for step, (x, y) in enumerate(batches):
        if seed is not None:
            torch.manual_seed(seed + step)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        optimizer.step()
        losses.append(loss.item())
    return losses


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name, detached (the form of ``full_state_dict``)."""
    return {n: p.detach() for n, p in model.named_parameters()}


def reference(spec: TrainSpec, kind: str, **kw: float) -> tuple[list[float], dict]:
    """Losses and final parameters of plain PyTorch trained as ``spec`` trains on the ranks."""
    model = make_model(**spec.model)
    opt = make_torch_optimizer(kind, model.parameters(), **kw)
    losses = train_reference(model, make_batches(spec.steps, spec.batch), opt, seed=spec.seed)
    return losses, parameters(model)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in b)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_same_training(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Two ``train`` runs (every rank's result) ended bitwise equal: final parameters, every
    loss and every grad norm."""
    assert_bitwise(a[0]["state"], b[0]["state"])
    for x, y in zip(a, b, strict=True):
        assert x["losses"] == y["losses"]
        assert x["grad_norms"] == y["grad_norms"]


def compare(results: list[dict], ref_losses: list[float], ref_state: dict) -> tuple[float, float]:
    """(loss error, parameter error) of a ``train`` run against the reference."""
    world = len(results)
    # Each rank's loss is its micro-batch mean; equal splits make their mean the global loss.
    losses = [sum(r["losses"][i] for r in results) / world for i in range(len(ref_losses))]
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    state = results[0]["state"]
    assert state.keys() == ref_state.keys()
    for name, value in state.items():
        assert value.shape == ref_state[name].shape, name
    return loss_err, max_abs_diff(state, ref_state)


# ----------------------------------------------------------------------------- rank runs


async def in_turn(ctx: RankContext, calls: list[tuple[Any, ...]]) -> list[Any]:
    """Rank function: ``await fn(ctx, *args)`` for each ``(fn, *args)`` of ``calls``, in turn.

    Independent runs share one process start and rendezvous this way.
    """
    return [await fn(ctx, *args) for fn, *args in calls]


async def run_in_turn(
    world_size: int,
    *calls: tuple[Callable[..., Awaitable[Any]], Any],
    fresh: bool = False,
    **kwargs: Any,
) -> list[list[Any]]:
    """Several rank functions one after another on the same ranks.

    They run on the pytest session's reused rank processes (the plugin's, see
    docs/testing.md), or on processes of their own with ``fresh`` (``run_ranks``).
    Returns, for each call, the ranks' results in rank order.
    """
    runner = None if fresh else session_runner()
    if runner is not None:
        per_rank = runner.run(in_turn, world_size, list(calls), **kwargs)
    else:
        per_rank = await run_ranks(in_turn, world_size, list(calls), **kwargs)
    return [list(results) for results in zip(*per_rank, strict=True)]


def run_named(
    world_size: int, calls: dict[str, tuple[Any, ...]], *, fresh: bool = False
) -> dict[str, list[Any]]:
    """``run_in_turn`` of named calls from outside an event loop (module fixtures).

    Returns, by name, the ranks' results in rank order.
    """
    results = asyncio.run(run_in_turn(world_size, *calls.values(), fresh=fresh))
    return dict(zip(calls, results, strict=True))


def local_slice(t: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    per = t.shape[0] // ctx.world_size
    return t[ctx.rank * per : (ctx.rank + 1) * per]


async def train_step(
    manager: Zero3CpuOffloadManager,
    ctx: RankContext,
    batch: tuple[torch.Tensor, torch.Tensor],
    names: list[str] | tuple[str, ...],
    lr: float = 1e-3,
    *,
    early_lr: bool = False,
) -> float:
    """One step on this rank's slice of ``batch``: forward, loss, backward, update; the loss."""
    x, y = batch
    out = await manager.forward_pass(local_slice(x, ctx), names)
    out.requires_grad_()
    loss = lm_loss(out, local_slice(y, ctx))
    loss.backward()
    await manager.backward_pass(out.grad, names, learning_rate=lr if early_lr else None)
    await manager.optimizer_step(lr)
    return loss.item()


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

    def manager_config(self) -> Zero3CpuOffloadConfig:
        return Zero3CpuOffloadConfig(optimizer=OptimizerConfig(**self.optimizer), **self.config)


def _layouts(manager: Zero3CpuOffloadManager) -> dict[str, tuple[int, int, int]]:
    # Per-layer sizes have no public figure (the stats hold totals): read the layouts.
    return {
        n: (lay.numel, lay.padded_numel, lay.shard_numel)
        for n, lay in manager.engine.layouts.items()
    }


async def train(ctx: RankContext, spec: TrainSpec) -> dict[str, Any]:
    """Train with the manager on this rank's slice of every batch.

    Returns the per-step local losses, the final full state dict (rank 0 only),
    the memory stats after the last step and each layer's (numel, padded, shard).
    """
    model = make_model(**spec.model)
    names = model.layer_names
    losses, norms, stepped_flags, scales, states = [], [], [], [], []
    async with Zero3CpuOffloadManager(spec.manager_config(), ctx.group, model) as manager:
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
        layouts = _layouts(manager)
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
        "performance": manager.get_performance_stats(),
    }


async def memory_probe(ctx: RankContext, spec: TrainSpec) -> dict[str, Any]:
    """Memory stats after a forward, after a backward (gradients held) and after the step."""
    model = make_model(**spec.model)
    names = model.layer_names
    async with Zero3CpuOffloadManager(spec.manager_config(), ctx.group, model) as manager:
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
        layouts = _layouts(manager)
    return {
        "after_forward": after_forward,
        "after_backward": after_backward,
        "after_step": after_step,
        "model_param_elements": model_param_elements,
        "shards": {n: shard for n, (_, _, shard) in layouts.items()},
        "padded": {n: padded for n, (_, padded, _) in layouts.items()},
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
    model = make_model()
    config = Zero3CpuOffloadConfig(**spec.config)
    per_step, statuses = [], []
    with structlog.testing.capture_logs() as logs:
        async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
            batches = make_batches(len(spec.orders), spec.batch)
            for names, batch in zip(spec.orders, batches, strict=True):
                await train_step(manager, ctx, batch, list(names), spec.lr)
                stats = manager.get_performance_stats()
                per_step.append(dict(stats.prefetch))
                statuses.append(attrs.asdict(manager.get_prefetch_status()))
            state = await manager.full_state_dict()
            high_water = manager.get_memory_stats().gathered_high_water_bytes
            memory_cycles = manager.get_memory_stats().pressure_checks
            status = manager.get_prefetch_status()
            depth, persistent = status.depth, list(status.persistent_layers)
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
    model = make_model(**spec.model)
    names = model.layer_names
    (x, y), (x2, y2) = make_batches(2, spec.batch)
    async with Zero3CpuOffloadManager(spec.manager_config(), ctx.group, model) as manager:
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


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns (of those ``counts`` keeps)."""

    def __init__(self, counts: Callable[[torch.Tensor], bool] = lambda t: True) -> None:
        super().__init__()
        self.counts, self.largest = counts, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and self.counts(t):
                self.largest = max(self.largest, t.numel())
        return out
