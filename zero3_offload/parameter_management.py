"""Flat, padded, per-layer parameter shards; gathering them for use.

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
from contextlib import asynccontextmanager

import attrs
import torch
from torch import nn

from zero3_offload.comm import Collectives
from zero3_offload.config import Zero3RankMapping
from zero3_offload.errors import Zero3Error
from zero3_offload.logging import get_logger

__all__ = [
    "CpuParameterStore",
    "GpuParameterCache",
    "LayerLayout",
    "ParamSlot",
    "ParameterPartitioner",
    "tensor_bytes",
]

log = get_logger(__name__)


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes held by ``t``'s elements (``numel() * element_size()``); 0 for None."""
    return 0 if t is None else t.numel() * t.element_size()


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

    def flatten(self, module: nn.Module, *, dtype: torch.dtype) -> torch.Tensor:
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


class ParameterPartitioner:
    """Builds each layer's flat layout and checks the model can be partitioned.

    Args:
        layers: layer name -> module, in the model's order.
        mapping: this rank's place in the group.

    Raises:
        Zero3Error: when a parameter is shared by two layers, is frozen, or is
            not floating point.
    """

    def __init__(self, layers: Mapping[str, nn.Module], mapping: Zero3RankMapping) -> None:
        self.mapping = mapping
        owner: dict[int, str] = {}
        layouts: dict[str, LayerLayout] = {}
        for layer_name, module in layers.items():
            slots: list[ParamSlot] = []
            offset = 0
            for pname, param in module.named_parameters():
                full = f"{layer_name}.{pname}"
                if id(param) in owner:
                    raise Zero3Error(
                        f"parameter {full} is the same tensor as {owner[id(param)]}: parameters "
                        "shared between layers are not supported; put both uses in one layer"
                    )
                if not param.requires_grad:
                    raise Zero3Error(
                        f"parameter {full} has requires_grad=False: frozen parameters are not "
                        "supported; move them to a buffer or make them trainable"
                    )
                if not param.dtype.is_floating_point:
                    raise Zero3Error(f"parameter {full} has dtype {param.dtype}: must be floating")
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
        self.layouts: dict[str, LayerLayout] = layouts

    def total_numel(self) -> int:
        """Elements of the whole model, without padding."""
        return sum(layout.numel for layout in self.layouts.values())

    def owned_numel(self) -> int:
        """Elements this rank owns, padding included."""
        return sum(layout.shard_numel for layout in self.layouts.values())


@attrs.define
class _StoredShard:
    master: torch.Tensor  # 1D fp32 [shard_numel], on the master device
    compute: torch.Tensor  # 1D [shard_numel] in compute dtype; may alias master


class CpuParameterStore:
    """This rank's parameter shards: the fp32 master and the compute copy.

    The master shard is what the optimizer updates; it lives on the CPU when
    optimizer states are offloaded, else on the device. The compute copy is
    what gathering sends to the device, in the compute dtype, kept on the CPU
    when parameters are offloaded. When both coincide (same dtype and device)
    the compute copy is the master itself, not a second tensor.
    """

    def __init__(
        self,
        *,
        master_device: torch.device,
        compute_device: torch.device,
        compute_dtype: torch.dtype,
    ) -> None:
        self.master_device = master_device
        self.compute_device = compute_device
        self.compute_dtype = compute_dtype
        self._shards: dict[str, _StoredShard] = {}

    def put_master(self, layer: str, master: torch.Tensor) -> None:
        """Store ``master`` (fp32, 1D) as ``layer``'s shard and derive its compute copy."""
        master = master.to(self.master_device, torch.float32)
        self._shards[layer] = _StoredShard(master=master, compute=master)
        self.refresh_compute_copy(layer)

    def master(self, layer: str) -> torch.Tensor:
        """The fp32 master shard of ``layer`` (updated in place by the optimizer)."""
        return self._shards[layer].master

    def compute_copy(self, layer: str) -> torch.Tensor:
        """The shard that gathering sends to the device."""
        return self._shards[layer].compute

    def refresh_compute_copy(self, layer: str) -> None:
        """Rebuild the compute copy from the master after the master changed."""
        shard = self._shards[layer]
        if shard.master.dtype == self.compute_dtype and shard.master.device == self.compute_device:
            shard.compute = shard.master
        elif shard.compute is shard.master:
            shard.compute = shard.master.to(self.compute_device, self.compute_dtype)
        else:
            shard.compute.copy_(shard.master)

    def layers(self) -> list[str]:
        return list(self._shards)

    def master_bytes(self) -> int:
        """Bytes of all master shards, counted from the tensors."""
        return sum(tensor_bytes(s.master) for s in self._shards.values())

    def compute_copy_bytes(self) -> int:
        """Bytes of compute copies that are separate tensors (aliases count 0)."""
        return sum(
            tensor_bytes(s.compute) for s in self._shards.values() if s.compute is not s.master
        )


class GpuParameterCache:
    """Gathers layers' full parameters on the device and releases them.

    Args:
        layers: layer name -> module; the modules' parameters are rebound.
        layouts: each layer's flat layout.
        store: where the shards come from.
        comm: collectives of the group.
        device: compute device.
    """

    def __init__(
        self,
        *,
        layers: Mapping[str, nn.Module],
        layouts: Mapping[str, LayerLayout],
        store: CpuParameterStore,
        comm: Collectives,
        device: torch.device,
    ) -> None:
        self._layers = layers
        self._layouts = layouts
        self._store = store
        self._comm = comm
        self.device = device
        self._gathered: dict[str, torch.Tensor] = {}  # layer -> 1D [padded_numel] buffer
        self.high_water_bytes = 0

    def release_all_views(self) -> None:
        """Point every parameter at an empty tensor (used once, after sharding)."""
        for name in self._layers:
            self._unbind(name)

    def _unbind(self, name: str) -> None:
        for param in self._layers[name].parameters():
            param.data = torch.empty(0, dtype=self._store.compute_dtype, device=self.device)
            param.grad = None

    def _bind(self, name: str, flat: torch.Tensor) -> None:
        params = dict(self._layers[name].named_parameters())
        for pname, view in self._layouts[name].unflatten(flat):
            params[pname].data = view

    def is_gathered(self, name: str) -> bool:
        return name in self._gathered

    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers alive on the device now."""
        return sum(tensor_bytes(t) for t in self._gathered.values())

    async def gather(self, name: str) -> nn.Module:
        """Rebuild ``name``'s full parameters on the device; returns the layer module.

        Raises:
            CommunicationError: when the all-gather fails or times out.
        """
        if name in self._gathered:
            return self._layers[name]
        layout = self._layouts[name]
        shard = self._store.compute_copy(name).to(self.device, non_blocking=True)
        flat = torch.empty(layout.padded_numel, dtype=self._store.compute_dtype, device=self.device)
        await self._comm.all_gather(flat, shard)
        self._gathered[name] = flat
        self._bind(name, flat)
        self.high_water_bytes = max(self.high_water_bytes, self.gathered_bytes())
        return self._layers[name]

    def release(self, name: str) -> None:
        """Free ``name``'s full parameters (no-op if not gathered)."""
        if self._gathered.pop(name, None) is not None:
            self._unbind(name)

    @asynccontextmanager
    async def use(self, name: str) -> Iterator[nn.Module]:
        """Gather ``name`` for the duration of the block, release after, also on error."""
        try:
            yield await self.gather(name)
        finally:
            self.release(name)
