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

import attrs
import torch
from torch import nn

from zero3_offload.compression import CompressedShard, ShardCodec
from zero3_offload.config import Zero3RankMapping
from zero3_offload.errors import Zero3Error
from zero3_offload.logging import get_logger

__all__ = [
    "CpuParameterStore",
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
    compute: CompressedShard  # [shard_numel] in the compression format; may alias master
    aliased: bool  # compute.payload is master itself


class CpuParameterStore:
    """This rank's parameter shards: the fp32 master and the compressed compute copy.

    The master shard is what the optimizer updates, exactly, in fp32; it lives
    on the CPU when optimizer states are offloaded, else on the device. The
    compute copy is what gathering sends to the device, in the compression
    format (see ``compression``), kept on the CPU (pinned for CUDA) when
    parameters are offloaded. When the format is fp32 and both live on the
    same device, the compute copy is the master itself, not a second tensor.

    Args:
        codec: the compression format of the compute copy.
        master_device: where master shards live.
        copy_device: where compute copies live.
        pin: allocate CPU compute copies in pinned memory.
    """

    def __init__(
        self,
        *,
        codec: ShardCodec,
        master_device: torch.device,
        copy_device: torch.device,
        pin: bool = False,
    ) -> None:
        self.codec = codec
        self.master_device = master_device
        self.copy_device = copy_device
        self.pin = pin and copy_device.type == "cpu"
        self._shards: dict[str, _StoredShard] = {}

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.codec.compute_dtype

    def put_master(self, layer: str, master: torch.Tensor) -> None:
        """Store ``master`` (fp32, 1D) as ``layer``'s shard and encode its compute copy."""
        master = master.to(self.master_device, torch.float32)
        if self.codec.is_identity and self.copy_device == self.master_device:
            self._shards[layer] = _StoredShard(master, CompressedShard(master, None), True)
            return
        copy = self.codec.empty(master.numel(), device=self.copy_device, pin=self.pin)
        self._shards[layer] = _StoredShard(master, copy, False)
        self.refresh_compute_copy(layer)

    def master(self, layer: str) -> torch.Tensor:
        """The fp32 master shard of ``layer`` (updated in place by the optimizer)."""
        return self._shards[layer].master

    def compute_copy(self, layer: str) -> CompressedShard:
        """The shard that gathering sends to the device."""
        return self._shards[layer].compute

    def refresh_compute_copy(self, layer: str) -> None:
        """Re-encode the compute copy from the master (after the master changed).

        Blocking CPU work: the manager runs it in a worker thread.
        """
        shard = self._shards[layer]
        if shard.aliased:
            return
        if self.copy_device == self.master_device:
            self.codec.encode_(shard.master, shard.compute)
            return
        staged = self.codec.empty(shard.master.numel(), device=self.master_device)
        self.codec.encode_(shard.master, staged)
        shard.compute.payload.copy_(staged.payload)
        if staged.scales is not None:
            shard.compute.scales.copy_(staged.scales)

    def layers(self) -> list[str]:
        return list(self._shards)

    def master_bytes(self) -> int:
        """Bytes of all master shards, counted from the tensors."""
        return sum(tensor_bytes(s.master) for s in self._shards.values())

    def compute_copy_bytes(self) -> int:
        """Bytes of compute copies that are tensors of their own (aliases count 0)."""
        return sum(s.compute.nbytes() for s in self._shards.values() if not s.aliased)
