"""What the optimizer-table and parameter-group tests share: the cases, the groups each
builds from a model, plain single-process torch training with the same optimizers and
groups, and the rank functions ``run_ranks`` runs.

The model is the tiny Llama of ``hf_models`` (module mode: two decoder units and the
root unit with the embedding, the final norm and the head), trained as there: AdamW
defaults aside, accumulation 2, global-norm clipping 1.0, each rank on its slice.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from hf_models import (
    ACC,
    CLIP,
    LR,
    batch,
    build,
    call_kwargs,
    global_mean,
    local,
    loss_of,
    make_config,
)
from torch import nn

from zero3_offload import (
    OptimizerConfig,
    Zero3CpuOffloadConfig,
    Zero3CpuOffloadManager,
    decay_param_groups,
)
from zero3_offload.config import BUILTIN_OPTIMIZERS, optimizer_class
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext

KIND = "llama"
MICRO_STEPS = 8  # 4 optimizer steps


def hidden_matrices(model: nn.Module) -> list[str]:
    """The 2-D weights of the decoder layers (Muon's), by name."""
    return [n for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n]


def lora_plus_names(model: nn.Module) -> list[str]:
    """Stand-ins for LoRA's B matrices: the value and up projections."""
    return [
        n for n, _ in model.named_parameters() if n.endswith(("v_proj.weight", "up_proj.weight"))
    ]


def attention_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".self_attn." in n]


def named_groups(rule: str | None, model: nn.Module) -> list[dict[str, Any]] | None:
    """The parameter groups (by name) of ``rule``; parameters in none keep the config's."""
    if rule is None:
        return None
    if rule == "muon":  # Muon for the hidden matrices, the config's AdamW for the rest
        return [{"params": hidden_matrices(model), "optimizer": "torch.optim.Muon"}]
    if rule == "decay":  # HF Trainer's split: no decay for biases and norm weights
        return decay_param_groups(model, 0.1)
    if rule == "lora_plus":
        return [{"params": lora_plus_names(model), "lr_scale": 16.0}]
    if rule == "mixed":  # two element-wise optimizers inside each decoder unit
        return [{"params": attention_names(model), "optimizer": "sgd", "momentum": 0.9}]
    if rule == "nadam-conflict":  # one unit's groups with different NAdam mu_product
        return [{"params": attention_names(model), "momentum_decay": 0.008}]
    raise KeyError(rule)


@attrs.frozen
class OptimCase:
    """One training run: the config's optimizer, its groups and config fields."""

    kind: str = "torch.optim.AdamW"
    options: dict[str, Any] = attrs.Factory(dict)
    groups: str | None = None
    config: dict[str, Any] = attrs.Factory(dict)
    micro_steps: int = MICRO_STEPS
    first_micro: int = 0
    lr: float = LR
    save_dir: str | None = None
    load_dir: str | None = None

    def optimizer(self) -> OptimizerConfig:
        if self.kind in BUILTIN_OPTIMIZERS:
            return OptimizerConfig(kind=self.kind, **self.options)
        return OptimizerConfig(kind=self.kind, options=self.options)


def manager_config(case: OptimCase) -> Zero3CpuOffloadConfig:
    return make_config(case.config, case.optimizer())


# ---------------------------------------------------------------------- plain reference


def torch_optimizers(case: OptimCase, model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch optimizers over ``model`` with ``case``'s groups, as torch users build them:
    group lr = LR * lr_scale; a group naming an optimizer gets that class's defaults (and
    the config's options when it is the config's class)."""
    cfg = case.optimizer()
    base_cls = optimizer_class(cfg.kind)
    named = dict(model.named_parameters())
    groups = named_groups(case.groups, model) or []
    taken = {n for g in groups for n in g["params"]}
    rest = [n for n in named if n not in taken]
    by_class: dict[type, list[dict[str, Any]]] = {}
    for g in [*groups, {"params": rest}]:
        cls = optimizer_class(g.get("optimizer", cfg.kind))
        options = cfg.torch_options() if cls is base_cls else {}
        own = {k: v for k, v in g.items() if k not in ("params", "optimizer", "lr_scale")}
        entry = {
            "params": [named[n] for n in g["params"]],
            **options,
            **own,
            "lr": case.lr * g.get("lr_scale", 1.0),
        }
        if entry["params"]:
            by_class.setdefault(cls, []).append(entry)
    return [cls(entries) for cls, entries in by_class.items()]


def plain_train(case: OptimCase) -> dict[str, Any]:
    """Plain single-process training on whole batches: accumulation 2, clipping 1.0."""
    model = build(KIND)
    optimizers = torch_optimizers(case, model)
    losses = []
    for i in range(case.first_micro + case.micro_steps):
        loss = loss_of(model(**call_kwargs(KIND, batch(i, KIND))))
        (loss / ACC).backward()
        losses.append(loss.item())
        if (i + 1) % ACC == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for opt in optimizers:
                opt.step()
            for opt in optimizers:
                opt.zero_grad()
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------------------- rank runs


async def train_case(ctx: RankContext, case: OptimCase) -> dict[str, Any]:
    """Train ``case`` with the manager on this rank's slice of each batch."""
    model = build(KIND)
    groups = named_groups(case.groups, model)
    manager = Zero3CpuOffloadManager(manager_config(case), ctx.group, model, param_groups=groups)
    async with manager:
        if case.load_dir is not None:
            await manager.load_checkpoint(case.load_dir)
        losses = []
        for i in range(case.first_micro, case.first_micro + case.micro_steps):
            out = await manager.forward(**call_kwargs(KIND, local(batch(i, KIND), ctx)))
            loss = loss_of(out)
            await manager.backward(loss)
            losses.append(await global_mean(ctx, loss))
            await manager.optimizer_step(case.lr)
        if case.save_dir is not None:
            await manager.save_checkpoint(case.save_dir)
        state = await manager.full_state_dict()
        memory = attrs.asdict(manager.get_memory_stats())
        need = manager.engine.cpu_need
    return {
        "losses": losses,
        "state": state,
        "state_bytes": memory["optimizer_state_bytes"],
        "need_state_bytes": need.optimizer_state,
    }


async def refusal(ctx: RankContext, case: OptimCase) -> str:
    """The error building a manager for ``case`` raises (its class and message)."""
    try:
        model = build(KIND)
        groups = named_groups(case.groups, model)
        manager = Zero3CpuOffloadManager(
            manager_config(case), ctx.group, model, param_groups=groups
        )
    except Zero3Error as exc:
        return f"{type(exc).__name__}: {exc}"
    await manager.close()
    return "built"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def loss_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) if a else math.nan


# ------------------------------------------------- chain mode: early and speculative updates


def chain_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Muon for the blocks' 2-D weights, a no-decay AdamW group for the norms and biases,
    the config's AdamW (decay 0.01) for the rest (embeddings, head)."""
    named = dict(model.named_parameters())
    hidden = [n for n, p in named.items() if p.ndim == 2 and n.startswith("block")]
    flat = [n for n, p in named.items() if p.ndim == 1]
    return [
        {"params": hidden, "optimizer": "torch.optim.Muon"},
        {"params": flat, "weight_decay": 0.0, "lr_scale": 2.0},
    ]


CHAIN_CONFIG = {
    "gradient_clipping": 0.5,
    "speculative_step": True,
    "overlap_computation": True,
}


def chain_reference(steps: int, batch_size: int) -> dict[str, Any]:
    """Plain torch: TinyGPT with ``chain_groups``, clipping 0.5, whole batches."""
    from helpers import make_batches, make_model, parameters, train_reference

    model = make_model()
    named = dict(model.named_parameters())
    muon, flat = chain_groups(model)
    rest = [n for n in named if n not in set(muon["params"]) | set(flat["params"])]
    adamw = torch.optim.AdamW(
        [
            {"params": [named[n] for n in rest], "lr": LR},
            {"params": [named[n] for n in flat["params"]], "weight_decay": 0.0, "lr": 2 * LR},
        ],
        weight_decay=0.01,
    )
    muon_opt = torch.optim.Muon([named[n] for n in muon["params"]], lr=LR)

    class Both:
        def zero_grad(self, set_to_none: bool = True) -> None:
            adamw.zero_grad(set_to_none)
            muon_opt.zero_grad(set_to_none)

        def step(self) -> None:
            adamw.step()
            muon_opt.step()

    losses = train_reference(model, make_batches(steps, batch_size), Both(), clip=0.5)  # type: ignore[arg-type]
    return {"losses": losses, "state": parameters(model)}


async def train_chain(ctx: RankContext, steps: int, batch_size: int) -> dict[str, Any]:
    """Chain mode with ``chain_groups``: the units without whole parameters update
    during backward (speculatively, under clipping); the blocks wait for the step."""
    from helpers import make_batches, make_model, train_step

    model = make_model()
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=0.01), **CHAIN_CONFIG
    )
    losses = []
    async with Zero3CpuOffloadManager(
        config, ctx.group, model, param_groups=chain_groups(model)
    ) as manager:
        for xy in make_batches(steps, batch_size):
            loss = await train_step(manager, ctx, xy, model.layer_names, LR, early_lr=True)
            losses.append(loss)
        state = await manager.full_state_dict()
        rollbacks = manager.get_performance_stats().speculative_rollbacks
    return {"losses": losses, "state": state, "rollbacks": rollbacks}
