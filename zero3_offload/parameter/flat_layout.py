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

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.shard_numel

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
    layers: Mapping[str, nn.Module | UnitParams], mapping: Zero3RankMapping
) -> dict[str, LayerLayout]:
    """Each layer's flat layout, after checking that the model can be partitioned.

    Args:
        layers: layer name -> module, in the model's order.
        mapping: this rank's place in the group.

    Raises:
        InputError: when a parameter is shared by two layers, is frozen, or is
            not floating point.
    """
    owner: dict[int, str] = {}
    layouts: dict[str, LayerLayout] = {}
    for layer_name, module in layers.items():
        slots: list[ParamSlot] = []
        offset = 0
        for pname, param in module.named_parameters():
            full = param_key(layer_name, pname)
            if id(param) in owner:
                raise InputError(
                    f"parameter {full} is the same tensor as {owner[id(param)]}: parameters "
                    "shared between layers are not supported; put both uses in one layer"
                )
            if not param.requires_grad:
                raise InputError(
                    f"parameter {full} has requires_grad=False: frozen parameters are not "
                    "supported; move them to a buffer or make them trainable"
                )
            if not param.dtype.is_floating_point:
                raise InputError(f"parameter {full} has dtype {param.dtype}: must be floating")
            owner[id(param)] = full
            slots.append(ParamSlot(pname, param.shape, offset, param.numel()))
            offset += param.numel()
        padded = mapping.padded_numel(offset)
        shard = padded // mapping.world_size
        layouts[layer_name] = LayerLayout(
            name=layer_name,
            slots=tuple(slots),
            numel=offset,
            padded_numel=padded,
            shard_numel=shard,
            shard_start=mapping.rank * shard,
        )
    return layouts


def total_numel(layouts: Mapping[str, LayerLayout]) -> int:
    """Elements of the whole model, without padding."""
    return sum(layout.numel for layout in layouts.values())


def owned_numel(layouts: Mapping[str, LayerLayout]) -> int:
    """Elements this rank owns, padding included."""
    return sum(layout.shard_numel for layout in layouts.values())
