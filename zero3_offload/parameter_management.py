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

import asyncio
import time
from collections.abc import Iterator, Mapping

import attrs
import torch
from torch import nn

from zero3_offload.comm import Collectives, PendingCollective
from zero3_offload.compression import CompressedShard, ShardCodec
from zero3_offload.config import Zero3RankMapping
from zero3_offload.errors import Zero3Error
from zero3_offload.logging import get_logger
from zero3_offload.streams import CopyStreams
from zero3_offload.timeline import Timeline

__all__ = [
    "CpuParameterStore",
    "GatherHandle",
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


@attrs.define
class GatherHandle:
    """A layer's gather in flight: its buffer is allocated, the all-gather launched."""

    layer: str
    flat: torch.Tensor  # 1D [padded_numel] in the compute dtype, valid once complete
    pending: PendingCollective | None  # None for a layer without parameters
    started: float  # time.perf_counter() at launch
    # Awaits the collective from launch on, so its completion (and time) is seen
    # when it happens, not when the layer is needed; awaited by complete().
    waiter: asyncio.Future[None] | None = None

    def is_completed(self) -> bool:
        return self.pending is None or self.pending.is_completed()


class GpuParameterCache:
    """Gathers layers' full parameters on the device and releases them.

    A gather is launched (:meth:`launch`: buffer allocated, copy and decode on
    the h2d stream, all-gather started) and later completed (:meth:`complete`:
    awaited, parameters bound as views). Bytes of launched and gathered
    buffers together are what the device holds for parameters.

    Args:
        layers: layer name -> module; the modules' parameters are rebound.
        layouts: each layer's flat layout.
        store: where the shards come from.
        comm: collectives of the group.
        device: compute device.
        streams: copy streams of the device.
        timeline: where gathers are recorded.
    """

    def __init__(
        self,
        *,
        layers: Mapping[str, nn.Module],
        layouts: Mapping[str, LayerLayout],
        store: CpuParameterStore,
        comm: Collectives,
        device: torch.device,
        streams: CopyStreams,
        timeline: Timeline,
    ) -> None:
        self._layers = layers
        self._layouts = layouts
        self._store = store
        self._comm = comm
        self.device = device
        self._streams = streams
        self._timeline = timeline
        self.phase = "forward"  # recorded with gathers; the manager sets it per pass
        self._gathered: dict[str, torch.Tensor] = {}  # layer -> 1D [padded_numel] buffer
        self._inflight: dict[str, GatherHandle] = {}
        self.high_water_bytes = 0  # most bytes of launched + gathered buffers at once
        # Released CPU buffers kept for the next gather of the same size (see
        # _take); a fresh large allocation costs several times a copy on the
        # CPU, and freed ones are not returned to the OS by glibc anyway. CUDA
        # has its own caching allocator, so nothing is pooled there.
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.pool_limit = 0  # bytes the pool may hold (the manager sets the budget)

    def release_views(self, name: str) -> None:
        """Point ``name``'s parameters at empty tensors (used once, after sharding it)."""
        self._unbind(name)

    def _unbind(self, name: str) -> None:
        for param in self._layers[name].parameters():
            param.data = torch.empty(0, dtype=self._store.compute_dtype, device=self.device)
            param.grad = None

    def _bind(self, name: str, flat: torch.Tensor) -> None:
        params = dict(self._layers[name].named_parameters())
        for pname, view in self._layouts[name].unflatten(flat):
            params[pname].data = view

    def nbytes(self, name: str) -> int:
        """Bytes of ``name``'s gathered buffer (padded, in the compute dtype)."""
        return self._layouts[name].padded_numel * self._store.codec.compute_itemsize

    def is_gathered(self, name: str) -> bool:
        return name in self._gathered

    def is_inflight(self, name: str) -> bool:
        return name in self._inflight

    def inflight(self) -> list[GatherHandle]:
        return list(self._inflight.values())

    def gathered_layers(self) -> list[str]:
        return list(self._gathered)

    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers gathered on the device now."""
        return sum(tensor_bytes(t) for t in self._gathered.values())

    def inflight_bytes(self) -> int:
        """Bytes of buffers whose gather is in flight."""
        return sum(tensor_bytes(h.flat) for h in self._inflight.values())

    def pooled_bytes(self) -> int:
        """Bytes of released buffers kept for reuse."""
        return sum(tensor_bytes(t) for ts in self._pool.values() for t in ts)

    def clear_pool(self) -> None:
        """Free the pooled buffers (their storage goes back to the allocator)."""
        self._pool.clear()

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.get((numel, dtype))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def _give(self, flat: torch.Tensor) -> None:
        # Pool only while gathered + in flight + pooled stays within the limit.
        fits = self.reserved_bytes() + self.pooled_bytes() + tensor_bytes(flat) <= self.pool_limit
        if self.device.type == "cpu" and fits:
            self._pool.setdefault((flat.numel(), flat.dtype), []).append(flat)

    def reserved_bytes(self) -> int:
        """Gathered plus in-flight buffer bytes: what the budget limits."""
        return self.gathered_bytes() + self.inflight_bytes()

    def launch(self, name: str) -> GatherHandle:
        """Allocate ``name``'s buffer and start its gather; returns at once.

        The compute copy is copied to the device and decoded there on the h2d
        stream, and the all-gather is launched from that stream, so the compute
        stream only waits when it needs the result (see [Note: copy streams]).
        Collectives start here, in program order, identically on every rank.
        """
        layout = self._layouts[name]
        dtype = self._store.compute_dtype
        flat = self._take(layout.padded_numel, dtype)
        pending = None
        started = time.perf_counter()
        if layout.padded_numel:
            src = self._store.compute_copy(name)
            with self._streams.on(self._streams.h2d):
                copy_started = self._streams.record(self._streams.h2d)
                staged = src.to(self.device, non_blocking=True)
                if staged is not src:
                    self._streams.track_copy(
                        "h2d", name, self.phase, src.nbytes(), copy_started, self._streams.h2d
                    )
                if staged.scales is None and staged.payload.dtype == dtype:
                    shard = staged.payload
                else:
                    shard = torch.empty(layout.shard_numel, dtype=dtype, device=self.device)
                    self._store.codec.decode_(staged, shard)
                pending = self._comm.start_all_gather(flat, shard)
        waiter = asyncio.ensure_future(pending.wait()) if pending is not None else None
        handle = GatherHandle(
            layer=name, flat=flat, pending=pending, started=started, waiter=waiter
        )
        self._inflight[name] = handle
        self.high_water_bytes = max(self.high_water_bytes, self.reserved_bytes())
        return handle

    async def complete(self, name: str) -> nn.Module:
        """Wait for ``name``'s launched gather and bind its parameters.

        Raises:
            CommunicationError: when the all-gather fails or times out (the
                buffer is dropped either way).
        """
        handle = self._inflight[name]
        try:
            if handle.waiter is not None:
                await handle.waiter
        finally:
            del self._inflight[name]
        self._streams.mark_used_on_current(handle.flat)
        done = handle.pending.completed_at if handle.pending is not None else None
        self._timeline.record(
            "gather",
            name,
            self.phase,
            handle.started,
            done if done is not None else time.perf_counter(),
            "comm",
            nbytes=tensor_bytes(handle.flat),
        )
        self._streams.record_finished_copies(self._timeline)
        self._gathered[name] = handle.flat
        self._bind(name, handle.flat)
        return self._layers[name]

    async def gather(self, name: str) -> nn.Module:
        """Launch (if needed) and complete ``name``'s gather; returns the layer module."""
        if name in self._gathered:
            return self._layers[name]
        start = time.perf_counter()
        if name not in self._inflight:
            self.launch(name)
        module = await self.complete(name)
        # The compute thread waited this long for the layer: exposed communication.
        self._timeline.record("wait", name, self.phase, start, time.perf_counter())
        return module

    def release(self, name: str) -> None:
        """Free ``name``'s full parameters (no-op if not gathered)."""
        flat = self._gathered.pop(name, None)
        if flat is not None:
            self._unbind(name)
            self._give(flat)
            now = time.perf_counter()
            self._timeline.record("release", name, self.phase, now, now, nbytes=tensor_bytes(flat))
