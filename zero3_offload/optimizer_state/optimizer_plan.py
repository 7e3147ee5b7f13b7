"""Parameter groups in torch's format, resolved against the flat layouts: who updates what.

[Note: parameter groups]
``Zero3CpuOffloadManager(..., param_groups=[...])`` takes torch's list of dicts. Each
group's ``"params"`` holds parameters or their ``named_parameters()`` names; its other
keys are options of the group's optimizer (``weight_decay``, ``betas``, ``momentum``,
...) over the config's, plus two of the library's own:

* ``"lr_scale"``: the group's learning rate is ``learning_rate * lr_scale`` (default 1).
  ``"lr"`` itself is refused: the learning rate is the one given to ``optimizer_step``.
* ``"optimizer"``: the group's own optimizer, a short kind or a dotted name (e.g.
  ``"torch.optim.Muon"``). Its options are torch's defaults of that class, then the
  config's when it is the config's class, then the group's keys.

Parameters named in no group form a last, default group with the config's optimizer and
options. A parameter named twice, or a name or tensor that is not a parameter of the
model, is refused. A frozen parameter (``requires_grad=False``) named in a group is
skipped, as torch never steps a parameter without a gradient: it has no slot in the
flat layout (``LayerLayout.slots`` holds the trainable parameters only).

Every rank derives the same plan from shared facts (the groups, the layouts, the world
size). Per unit (layer):

* *fast*: one element-wise group holds every parameter: one torch optimizer over the
  whole 1-D master shard, as without groups (the fused AdamW path is unchanged).
* *segments*: otherwise each rank's shard is cut into contiguous segments, the
  intersection of its slice with each element-wise group's parameters (adjacent
  parameters of one group merge), stepped by one torch param group per group (see
  [Note: segmented shards] in ``optimizer_state.segmented_shard``).
* *owned*: parameters of shape-aware groups (Adafactor, Muon) are each given to one
  owning rank, balanced by size over the whole model (largest first, to the rank with
  the fewest owned elements so far, ties to the lower rank and the name), and updated
  whole there (see [Note: owned parameters] in ``optimizer_state.owned_params``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from zero3_offload.config import OptimizerConfig, check_optimizer_options, optimizer_class
from zero3_offload.errors import ConfigError, InputError
from zero3_offload.optimizer_state.optimizer_kind import OptimizerKind, probe_kind
from zero3_offload.parameter.flat_layout import LayerLayout, ParamSlot, param_key
from zero3_offload.parameter.unit_params import UnitParams

__all__ = [
    "LayerPlan",
    "OptimizerPlan",
    "OwnedSlot",
    "ParamGroup",
    "ResolvedGroup",
    "Segment",
    "plan_optimizer",
]

ParamGroup = Mapping[str, Any]
"""One of torch's parameter groups: ``{"params": [...], option: value, ...}``."""

_OWN_KEYS = ("params", "lr_scale", "optimizer", "name")


@attrs.frozen(eq=False)
class ResolvedGroup:
    """A parameter group with its optimizer probed."""

    index: int  # position in param_groups; the default group comes last
    kind: OptimizerKind
    overrides: Mapping[str, Any]  # the group's own options (a torch param group's keys)
    lr_scale: float
    names: tuple[str, ...]  # full names of its trainable parameters

    @property
    def label(self) -> str:
        return f"param_groups[{self.index}]" if self.index >= 0 else "the default group"


@attrs.frozen
class Segment:
    """Elements ``[start, end)`` of a rank's shard that one element-wise group updates."""

    group: int
    start: int
    end: int


@attrs.frozen
class OwnedSlot:
    """A parameter of a shape-aware group, updated whole at its owner."""

    slot: ParamSlot
    name: str  # full name
    group: int
    owner: int  # the rank that keeps its optimizer state and runs its update
    position: int  # its first element in the owner's block of this layer's exchange


@attrs.frozen
class LayerPlan:
    """How one layer's shard is updated on this rank."""

    fast: int | None  # the one element-wise group of every parameter, else None
    segments: tuple[Segment, ...]  # this rank's segments (empty when fast)
    owned: tuple[OwnedSlot, ...]  # parameters updated whole (every rank lists all)
    full_keys: tuple[str, ...]  # the per-element state tensors this layer keeps
    scalar_bytes: int  # bytes of the layer's scalar state on this rank
    block: int  # elements of the largest owner's block of this layer's exchange


@attrs.frozen(eq=False)
class OptimizerPlan:
    """The parameter groups resolved for this rank (see [Note: parameter groups])."""

    groups: tuple[ResolvedGroup, ...]  # by index; the default group last
    layers: Mapping[str, LayerPlan]
    rank: int

    def group(self, index: int) -> ResolvedGroup:
        return self.groups[index]

    def has_owned(self) -> bool:
        return any(lay.owned for lay in self.layers.values())

    def param_optimizers(self) -> dict[str, str]:
        """Each trainable parameter's optimizer class (saved in checkpoints)."""
        return {name: g.kind.label for g in self.groups for name in g.names}

    def disk_state_keys(self) -> tuple[str, ...]:
        """The per-element state tensors of every layer (the disk tier's record order;
        :func:`plan_optimizer` refuses layers that differ when the state is on disk)."""
        return next(iter(self.layers.values())).full_keys if self.layers else ()

    def owned_state_bytes(self) -> int:
        """Bytes of the state of the parameters this rank owns."""
        return sum(
            self.groups[o.group].kind.state_bytes(o.slot.shape)
            for lay in self.layers.values()
            for o in lay.owned
            if o.owner == self.rank
        )


def _as_list(params: object, where: str) -> list[object]:
    if isinstance(params, (torch.Tensor, str)):
        return [params]
    if isinstance(params, Iterable) and not isinstance(params, Mapping):
        return list(params)
    raise ConfigError(f"{where}['params'] must be parameters or their names, got {params!r}")


def _names(
    params: list[object],
    where: str,
    by_id: Mapping[int, str],
    known: set[str],
) -> list[str]:
    out = []
    for item in params:
        if isinstance(item, str):
            if item not in known:
                raise InputError(
                    f"{where} names {item!r}, which is not a parameter of the model "
                    "(names are those of model.named_parameters())"
                )
            out.append(item)
        elif isinstance(item, torch.Tensor):
            if id(item) not in by_id:
                raise InputError(f"{where} holds a tensor that is not a parameter of the model")
            out.append(by_id[id(item)])
        else:
            raise ConfigError(f"{where}['params'] holds {item!r}: give parameters or names")
    return out


def _lr_scale(group: ParamGroup, where: str) -> float:
    value = group.get("lr_scale", 1.0)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}['lr_scale']={value!r} is invalid: must be a number >= 0")
    return float(value)


def _group_kind(
    group: ParamGroup, where: str, cfg: OptimizerConfig
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The group's optimizer class and the options under the group's own."""
    base = optimizer_class(cfg.kind)
    named = group.get("optimizer")
    if named is None:
        return base, cfg.torch_options()
    if not isinstance(named, str):
        raise ConfigError(f"{where}['optimizer']={named!r} is invalid: give a kind or a name")
    try:
        cls = optimizer_class(named)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return cls, cfg.torch_options() if cls is base else {}


def plan_optimizer(
    cfg: OptimizerConfig,
    param_groups: Sequence[ParamGroup] | None,
    *,
    layers: Mapping[str, nn.Module | UnitParams],
    layouts: Mapping[str, LayerLayout],
    rank: int,
    world_size: int,
    device: torch.device,
    on_disk: bool = False,
) -> OptimizerPlan:
    """Resolve ``param_groups`` (None: one default group) for this rank.

    Args:
        cfg: the config's optimizer (the default group's, and the base of groups
            naming no optimizer).
        param_groups: torch's list of dicts (see [Note: parameter groups]).
        layers: the model's layers (units), for parameter names and tensors.
        layouts: their flat layouts (trainable parameters only).
        rank, world_size: this rank's place.
        device: where the masters and the state live (the probes run there).
        on_disk: the optimizer state is on disk (``offload_optimizer_device="nvme"``).

    Raises:
        ConfigError: a bad group key or option, a refused optimizer (the message says
            why), a parameter an optimizer cannot update (e.g. Muon and a vector), or
            what the disk tier cannot hold.
        InputError: a parameter named twice, or not a parameter of the model.
    """
    by_id: dict[int, str] = {}
    known: set[str] = set()
    for layer, module in layers.items():
        for pname, param in module.named_parameters():
            full = param_key(layer, pname)
            by_id.setdefault(id(param), full)
            known.add(full)
    trainable = {
        param_key(layer, s.name): (layer, s) for layer, lay in layouts.items() for s in lay.slots
    }
    user = list(param_groups or [])
    resolved, member = _resolve_groups(cfg, user, by_id, known, trainable, device)
    default_names = tuple(n for n in trainable if n not in member)
    default_kind = _kind(optimizer_class(cfg.kind), cfg.torch_options(), {}, cfg, device)
    resolved.append(ResolvedGroup(-1, default_kind, {}, 1.0, default_names))
    groups = tuple(resolved)
    of = {name: i for i, g in enumerate(groups) for name in g.names}
    _check_shapes(groups, trainable)
    owners = _assign_owners(groups, trainable, world_size)
    plans = {
        layer: _layer_plan(layer, lay, groups, of, owners, rank)
        for layer, lay in layouts.items()
        if lay.numel
    }
    plan = OptimizerPlan(groups=groups, layers=plans, rank=rank)
    _check_scalars(plan, layouts, of)
    if on_disk:
        _check_disk(plan)
    return plan


def _kind(
    cls: type[torch.optim.Optimizer],
    base: Mapping[str, Any],
    overrides: Mapping[str, Any],
    cfg: OptimizerConfig,
    device: torch.device,
) -> OptimizerKind:
    # The probe runs with the options the group's parameters get.
    probed = probe_kind(cls, {**base, **overrides}, device=device, fused=cfg.fused)
    return attrs.evolve(probed, options=dict(base))


def _resolve_groups(
    cfg: OptimizerConfig,
    user: list[ParamGroup],
    by_id: Mapping[int, str],
    known: set[str],
    trainable: Mapping[str, tuple[str, ParamSlot]],
    device: torch.device,
) -> tuple[list[ResolvedGroup], dict[str, int]]:
    member: dict[str, int] = {}
    resolved: list[ResolvedGroup] = []
    for i, group in enumerate(user):
        where = f"param_groups[{i}]"
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigError(f"{where} must be a dict with 'params', got {group!r}")
        names = _names(_as_list(group["params"], where), where, by_id, known)
        for name in names:
            if name in member:
                raise InputError(
                    f"parameter {name} is in param_groups[{member[name]}] and {where}: "
                    "a parameter may be in one group only"
                )
            member[name] = i
        cls, base = _group_kind(group, where, cfg)
        overrides = {k: v for k, v in group.items() if k not in _OWN_KEYS}
        check_optimizer_options(cls, overrides, f"{where}.")
        kind = _kind(cls, base, overrides, cfg, device)
        kept = tuple(n for n in names if n in trainable)  # frozen ones are skipped
        resolved.append(ResolvedGroup(i, kind, overrides, _lr_scale(group, where), kept))
    return resolved, member


def _check_shapes(
    groups: Sequence[ResolvedGroup], trainable: Mapping[str, tuple[str, ParamSlot]]
) -> None:
    """A shape-aware optimizer is built on every one of its parameters' shapes (on meta),
    so a parameter it refuses (Muon and a vector) is named on every rank."""
    for group in groups:
        if not group.kind.shape_aware:
            continue
        for name in group.names:
            shape = trainable[name][1].shape
            meta = torch.empty(shape, device="meta")
            try:
                group.kind.make([{"params": [meta], **group.overrides}])
            except (ValueError, RuntimeError, TypeError) as exc:
                raise ConfigError(
                    f"parameter {name} (shape {tuple(shape)}) of {group.label} cannot be "
                    f"updated by {group.kind.label}: {exc}; put it in a group with another "
                    "optimizer (e.g. torch.optim.AdamW)"
                ) from None


def _assign_owners(
    groups: Sequence[ResolvedGroup],
    trainable: Mapping[str, tuple[str, ParamSlot]],
    world_size: int,
) -> dict[str, int]:
    """Owner rank of every shape-aware parameter: largest first, to the least loaded rank."""
    owned = [name for g in groups if g.kind.shape_aware for name in g.names]
    owned.sort(key=lambda n: (-trainable[n][1].numel, n))
    load = [0] * world_size
    owners: dict[str, int] = {}
    for name in owned:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += trainable[name][1].numel
    return owners


def _layer_plan(
    layer: str,
    lay: LayerLayout,
    groups: Sequence[ResolvedGroup],
    of: Mapping[str, int],
    owners: Mapping[str, int],
    rank: int,
) -> LayerPlan:
    slot_groups = [(s, of[param_key(layer, s.name)]) for s in lay.slots]
    elementwise = [(s, g) for s, g in slot_groups if not groups[g].kind.shape_aware]
    kinds: list[OptimizerKind] = []
    for _, g in elementwise:
        if groups[g].kind not in kinds:
            kinds.append(groups[g].kind)
    full_keys: list[str] = []
    for kind in kinds:
        full_keys += [k for k in kind.full_keys if k not in full_keys]
    owned: list[OwnedSlot] = []
    fill: dict[int, int] = {}
    for s, g in slot_groups:
        if groups[g].kind.shape_aware:
            name = param_key(layer, s.name)
            owner = owners[name]
            owned.append(OwnedSlot(s, name, g, owner, fill.get(owner, 0)))
            fill[owner] = fill.get(owner, 0) + s.numel
    one = {g for _, g in slot_groups}
    if not owned and len(one) == 1:
        fast = one.pop()
        scalar_bytes = groups[fast].kind.scalar_bytes
        return LayerPlan(fast, (), (), tuple(full_keys), scalar_bytes, 0)
    segments: list[Segment] = []
    for s, g in elementwise:
        lo, hi = lay.owned_span(s)
        if lo >= hi:
            continue
        start, end = lo - lay.shard_start, hi - lay.shard_start
        if segments and segments[-1].group == g and segments[-1].end == start:
            segments[-1] = Segment(g, segments[-1].start, end)
        else:
            segments.append(Segment(g, start, end))
    block = max(fill.values(), default=0)
    # The layer's scalars are those of the kinds this rank's segments step.
    scalars: dict[str, int] = {}
    for kind in dict.fromkeys(groups[seg.group].kind for seg in segments):
        for key, size in zip(kind.scalar_keys, kind.scalar_sizes, strict=True):
            scalars.setdefault(key, size)
    return LayerPlan(
        None, tuple(segments), tuple(owned), tuple(full_keys), sum(scalars.values()), block
    )


def _check_scalars(
    plan: OptimizerPlan, layouts: Mapping[str, LayerLayout], of: Mapping[str, int]
) -> None:
    """The element-wise groups of one layer share its scalar state (``step``, NAdam's
    ``mu_product``, ...): refuse groups of one layer whose scalars would differ."""
    traces: dict[int, tuple[float, ...]] = {}  # group -> its probe's scalars
    for layer, lay_plan in plan.layers.items():
        if lay_plan.fast is not None:
            continue
        seen: dict[str, tuple[ResolvedGroup, tuple[float, ...]]] = {}
        for g in dict.fromkeys(of[param_key(layer, s.name)] for s in layouts[layer].slots):
            group = plan.groups[g]
            kind = group.kind
            if kind.shape_aware or not kind.scalar_keys:
                continue
            if g not in traces:
                traces[g] = kind.scalar_trace(group.overrides, group.lr_scale)
            trace = traces[g]
            for i, key in enumerate(kind.scalar_keys):
                values = trace[i :: len(kind.scalar_keys)]
                if key in seen and seen[key][1] != values:
                    other = seen[key][0]
                    raise ConfigError(
                        f"layer {layer!r}: {other.label} ({other.kind.label}) and "
                        f"{group.label} ({kind.label}) keep the scalar state {key!r} with "
                        "different values (their options differ), but one layer's groups "
                        "share it: give them the same options that it depends on, or the "
                        "same optimizer"
                    )
                seen.setdefault(key, (group, values))


def _check_disk(plan: OptimizerPlan) -> None:
    for group in plan.groups:
        if group.kind.shape_aware and group.names:
            raise ConfigError(
                f"offload_optimizer_device='nvme' is invalid with {group.kind.label} "
                f"({group.label}, e.g. {group.names[0]}): the disk tier holds flat shards, "
                "and this optimizer updates whole parameters; use "
                "offload_optimizer_device='cpu'"
            )
    keys = {lay.full_keys for lay in plan.layers.values()}
    if len(keys) > 1:
        raise ConfigError(
            "offload_optimizer_device='nvme' is invalid with these parameter groups: their "
            f"optimizers keep different state tensors ({sorted(keys)}), and the disk tier's "
            "records hold the same ones for every layer; use one optimizer class"
        )
