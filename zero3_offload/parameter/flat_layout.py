"""The flat, padded layout of each layer's parameters, and this rank's slice of it.

[Note: flat layout]
A layer's parameters, in ``named_parameters()`` order, are laid end to end in
one flat buffer padded with zeros to a multiple of ``world_size``. Rank ``r``
owns the contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded / world_size``.
Between uses every rank holds only its slice; gathering rebuilds the whole
buffer with one all-gather, and the layer's ``nn.Parameter`` objects become
views into it (``param.data = flat[offset:offset+numel].view(shape)``).
Releasing points every parameter at an empty tensor, so the buffer's storage is
freed as soon as nothing else refers to it.

[Note: frozen parameters]
Whether a parameter is trainable is read from ``requires_grad`` when the manager is
built. A layer's trainable parameters form its layout (:attr:`LayerLayout.slots`):
they have an fp32 master, a gradient, a reduce-scatter and optimizer state. Its
frozen parameters form a second layout of their own, :attr:`LayerLayout.frozen`,
sharded the same way but holding only a compute copy (in ``frozen_compression``'s
format): no master, no gradient, no optimizer state. A gather fills one buffer of
:attr:`LayerLayout.gather_numel` elements, the trainable part first and the frozen
part after it, so both are views of one buffer. With a block-wise frozen format
(INT8, NF4) every frozen parameter starts at a multiple of the block size and each
shard is a whole number of blocks (``align``), so a block never spans two
parameters or two ranks and the decoded values do not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import torch
from torch import nn

from zero3_offload.errors import InputError
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.parameter.unit_params import UnitParams

__all__ = [
    "ROOT_UNIT",
    "LayerLayout",
    "ParamSlot",
    "build_layouts",
    "owned_numel",
    "param_key",
    "saved_shard_numel",
    "total_numel",
]

ROOT_UNIT = "<root>"
"""Module mode's root unit: its parameter names are the model's full names."""


def param_key(layer: str, name: str) -> str:
    """A parameter's name in the whole model (as in ``model.named_parameters()``)."""
    return name if layer == ROOT_UNIT else f"{layer}.{name}"


@attrs.frozen
class ParamSlot:
    """Where one parameter lives in its layer's flat buffer."""

    name: str  # relative to the layer, as in layer.named_parameters()
    shape: torch.Size
    offset: int  # first element in the flat buffer
    numel: int


@attrs.frozen
class LayerLayout:
    """The flat layout of one layer and this rank's part of it. See [Note: flat layout]."""

    name: str
    slots: tuple[ParamSlot, ...]
    numel: int  # real elements, without padding
    padded_numel: int  # numel rounded up to a multiple of world_size
    shard_numel: int  # padded_numel / world_size
    shard_start: int  # this rank's first element in the flat buffer
    align: int = 1  # parameters start, and shards end, at multiples of this many elements
    # The frozen parameters' layout (see [Note: frozen parameters]); None: all trainable.
    frozen: LayerLayout | None = None

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.shard_numel

    def owned_span(self, slot: ParamSlot) -> tuple[int, int]:
        """``[lo, hi)``: the elements of ``slot`` (offsets in the flat buffer) that lie in
        this rank's shard; ``lo >= hi`` when none do."""
        return max(slot.offset, self.shard_start), min(slot.offset + slot.numel, self.shard_end)

    @property
    def gather_numel(self) -> int:
        """Elements of the gathered buffer: the trainable part, then the frozen part."""
        return self.padded_numel + (self.frozen.padded_numel if self.frozen is not None else 0)

    @property
    def param_numel(self) -> int:
        """Elements of the parameters themselves (frozen too), without padding or gaps."""
        own = sum(s.numel for s in self.slots)
        return own + (self.frozen.param_numel if self.frozen is not None else 0)

    def flatten(self, module: nn.Module | UnitParams, *, dtype: torch.dtype) -> torch.Tensor:
        """The padded flat buffer of ``module``'s current parameter values (on their device)."""
        params = dict(module.named_parameters())
        device = next(iter(params.values())).device if params else torch.device("cpu")
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for slot in self.slots:
            flat[slot.offset : slot.offset + slot.numel].copy_(params[slot.name].detach().view(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` for every parameter in a full flat buffer."""
        for slot in self.slots:
            yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)


def build_layouts(
    layers: Mapping[str, nn.Module | UnitParams],
    mapping: Zero3RankMapping,
    *,
    frozen_align: int = 1,
) -> dict[str, LayerLayout]:
    """Each layer's flat layout, after checking that the model can be partitioned.

    Args:
        layers: layer name -> module, in the model's order.
        mapping: this rank's place in the group.
        frozen_align: the frozen parts' ``align`` (the block size of a block-wise
            ``frozen_compression``; see [Note: frozen parameters]).

    Raises:
        InputError: when a parameter is shared by two layers or is not floating point.
    """
    owner: dict[int, str] = {}
    layouts: dict[str, LayerLayout] = {}
    for layer_name, module in layers.items():
        trainable: list[tuple[str, torch.Size]] = []
        frozen: list[tuple[str, torch.Size]] = []
        for pname, param in module.named_parameters():
            full = param_key(layer_name, pname)
            if id(param) in owner:
                raise InputError(
                    f"parameter {full} is the same tensor as {owner[id(param)]}: parameters "
                    "shared between layers are not supported; put both uses in one layer"
                )
            if not param.dtype.is_floating_point:
                raise InputError(f"parameter {full} has dtype {param.dtype}: must be floating")
            owner[id(param)] = full
            (trainable if param.requires_grad else frozen).append((pname, param.shape))
        frozen_part = _layout(layer_name, frozen, mapping, frozen_align, None) if frozen else None
        layouts[layer_name] = _layout(layer_name, trainable, mapping, 1, frozen_part)
    return layouts


def _layout(
    name: str,
    params: list[tuple[str, torch.Size]],
    mapping: Zero3RankMapping,
    align: int,
    frozen: LayerLayout | None,
) -> LayerLayout:
    slots: list[ParamSlot] = []
    offset = 0
    for pname, shape in params:
        offset = -(-offset // align) * align
        numel = shape.numel()
        slots.append(ParamSlot(pname, shape, offset, numel))
        offset += numel
    shard = saved_shard_numel(offset, mapping.world_size, align)
    return LayerLayout(
        name=name,
        slots=tuple(slots),
        numel=offset,
        padded_numel=shard * mapping.world_size,
        shard_numel=shard,
        shard_start=mapping.rank * shard,
        align=align,
        frozen=frozen,
    )


def saved_shard_numel(numel: int, world_size: int, align: int = 1) -> int:
    """The shard length of a layout of ``numel`` elements at ``world_size`` ranks: the
    fewest whole ``align``-blocks per rank that cover it."""
    blocks = -(-numel // align)
    return -(-blocks // world_size) * align


def total_numel(layouts: Mapping[str, LayerLayout], *, frozen: bool = True) -> int:
    """Elements of the whole model's parameters, without padding (``frozen=False``: of
    the trainable ones only)."""
    if frozen:
        return sum(layout.param_numel for layout in layouts.values())
    return sum(layout.numel for layout in layouts.values())


def owned_numel(layouts: Mapping[str, LayerLayout]) -> int:
    """Elements this rank owns, padding included (trainable and frozen shards)."""
    return sum(
        layout.shard_numel + (layout.frozen.shard_numel if layout.frozen is not None else 0)
        for layout in layouts.values()
    )
