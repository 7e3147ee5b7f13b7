"""Gathering layers' full parameters on the device, and releasing them.

See [Note: flat layout] in ``parameter.flat_layout`` for what a gather rebuilds,
and [Note: copy streams] in ``comm.copy_streams`` for how the copies are ordered.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Iterable, Mapping

import attrs
import torch
from torch import nn

from zero3_offload.comm.collectives import Collectives, PendingCollective
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.errors import StateError
from zero3_offload.parameter.codec import CompressedShard, ShardCodec
from zero3_offload.parameter.flat_layout import LayerLayout, ParamSlot, param_key
from zero3_offload.parameter.frozen_embedding import FrozenEmbeddingForward
from zero3_offload.parameter.frozen_linear import FrozenLinearForward
from zero3_offload.parameter.frozen_rows import FrozenRows, release_scratch, reserve_scratch
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.parameter.unit_params import UnitParams
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.tensor_bytes import tensor_bytes
from zero3_offload.stats.timeline import Timeline

__all__ = ["GatherHandle", "ParameterGatherer"]


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
    # A compressed gather's 1D uint8 buffer of every rank's stored shard, decoded
    # into flat when the all-gather completes (see [Note: compressed gather]).
    wire: torch.Tensor | None = None
    # The frozen part's all-gather (see [Note: frozen parameters]) and its received
    # stored shards; None when the layer has no frozen parameters.
    frozen_pending: PendingCollective | None = None
    frozen_wire: torch.Tensor | None = None

    def is_completed(self) -> bool:
        return all(p is None or p.is_completed() for p in (self.pending, self.frozen_pending))

    def completed_at(self) -> float | None:
        """When the last of the layer's all-gathers completed (None: not known)."""
        times = [p.completed_at for p in (self.pending, self.frozen_pending) if p is not None]
        known = [t for t in times if t is not None]
        return max(known) if known and len(known) == len(times) else None


class ParameterGatherer:
    """Gathers layers' full parameters on the device and releases them.

    A gather is launched (:meth:`launch`: buffer allocated, copy and decode on
    the h2d stream, all-gather started) and later completed (:meth:`complete`:
    awaited, parameters bound as views). Bytes of launched and gathered
    buffers together are what the device holds for parameters. Each call names
    the :class:`Phase` its work belongs to (the timeline's label).

    Args:
        layers: layer name -> module; the modules' parameters are rebound.
        layouts: each layer's flat layout.
        store: where the shards come from.
        comm: collectives of the group.
        device: compute device.
        streams: copy streams of the device.
        timeline: where gathers are recorded.
        compressed_wire: all-gather the compute copies as stored and decode after
            (``gather_compression``; see [Note: compressed gather]). Where the stored
            format is the compute dtype this changes nothing.
        pool_layers: released CPU buffers are pooled for reuse while gathered, in-flight
            and pooled buffers stay within this many of a typical layer's gather
            bytes (the lower median of the layers with parameters; see
            :meth:`give_buffer`); 0 pools nothing.
        pool_budget: and within this many bytes (``gpu_param_memory_budget``).
        decode_at_use: keep gathered frozen parameters as stored, and decode the weights
            of frozen plain ``nn.Linear`` and ``nn.Embedding`` modules of module-mode
            units at use (``frozen_decode_at_use``; see [Note: frozen weights decoded at
            use] in ``parameter.frozen_rows``). Changes nothing where frozen parameters
            are stored in the compute dtype.
    """

    def __init__(
        self,
        *,
        layers: Mapping[str, nn.Module | UnitParams],
        layouts: Mapping[str, LayerLayout],
        store: ParameterStore,
        comm: Collectives,
        device: torch.device,
        streams: CopyStreams,
        timeline: Timeline,
        compressed_wire: bool = False,
        pool_layers: int = 0,
        pool_budget: int = 0,
        decode_at_use: bool = False,
    ) -> None:
        self._layers = layers
        self._layouts = layouts
        self._store = store
        self._comm = comm
        self.device = device
        self._streams = streams
        self._timeline = timeline
        codec = store.codec
        self.compressed_wire = compressed_wire and codec.storage_dtype != codec.compute_dtype
        # Frozen shards always travel as stored (see [Note: frozen parameters]).
        frozen = store.frozen_codec
        self._frozen_on_wire = frozen.storage_dtype != frozen.compute_dtype
        self._gathered: dict[str, torch.Tensor] = {}  # layer -> 1D [padded_numel] buffer
        # Decoded at use (see [Note: frozen weights decoded at use]): per layer, the
        # frozen slots decoded at gather time and their offsets in the buffer, and
        # its gathered frozen wire while gathered.
        self._eager: dict[str, tuple[tuple[ParamSlot, int], ...]] = {}
        self._eager_numel: dict[str, int] = {}
        self._wires: dict[str, torch.Tensor] = {}
        self.decoded_at_use: dict[str, FrozenRows] = {}  # full parameter name -> its rows
        if decode_at_use and self._frozen_on_wire:
            self._plan_decode_at_use()
        self._inflight: dict[str, GatherHandle] = {}
        self.high_water_bytes = 0  # most bytes of launched + gathered buffers at once
        # Released CPU buffers pooled for the next gather of the same size (see
        # take_buffer); a fresh large allocation costs several times a copy on the
        # CPU, and freed ones are not returned to the OS by glibc anyway. CUDA
        # has its own caching allocator, so nothing is pooled there.
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        # Enough reusable buffers for what is gathered at once (the layer in use, the
        # look-ahead and one being released: pool_layers) of a typical layer (the
        # median's bytes: an embedding or LM head many times a decoder layer's size
        # would otherwise let idle decoder buffers sit in the pool through the
        # backward's peak), never more than the budget.
        sizes = sorted(n for n in (self.nbytes(name) for name in layers) if n)
        typical = sizes[(len(sizes) - 1) // 2] if sizes else 0  # the lower median
        self.pool_limit = min(pool_budget, pool_layers * typical)
        # What is gathered at once at most (pool_layers of the largest layers' bytes).
        self.window_limit = min(pool_budget, pool_layers * (sizes[-1] if sizes else 0))

    def release_views(self, name: str) -> None:
        """Point ``name``'s parameters at empty tensors (used once, after sharding it).

        A parameter still on the meta device (its values came from a shard
        source) cannot take a real tensor as ``.data``; its contents are
        swapped with an empty real parameter instead, so the object (and any
        tie to it) stays the same.
        """
        for param in self._layers[name].parameters():
            if param.is_meta:
                empty = torch.empty(0, dtype=self._store.compute_dtype, device=self.device)
                torch.utils.swap_tensors(param, nn.Parameter(empty, param.requires_grad))
        self._unbind(name)

    def _unbind(self, name: str, *, keep_grads: bool = False) -> None:
        for param in self._layers[name].parameters():
            param.data = torch.empty(0, dtype=self._store.compute_dtype, device=self.device)
            if not keep_grads:
                param.grad = None

    def _bind(self, name: str, flat: torch.Tensor) -> None:
        params = dict(self._layers[name].named_parameters())
        layout = self._layouts[name]
        for pname, view in layout.unflatten(flat):
            params[pname].data = view
        if name in self._eager:
            for slot, at in self._eager[name]:
                params[slot.name].data = flat[at : at + slot.numel].view(slot.shape)
        elif layout.frozen is not None:
            for pname, view in layout.frozen.unflatten(flat[layout.padded_numel :]):
                params[pname].data = view

    def _plan_decode_at_use(self) -> None:
        """Find the frozen weights decoded at use and replace their modules' ``forward``
        (see [Note: frozen weights decoded at use])."""
        modules = {
            id(m): m
            for u in self._layers.values()
            if isinstance(u, UnitParams)
            for _, m in u.owners()
        }
        holders = collections.Counter(
            id(p) for m in modules.values() for p in m._parameters.values() if p is not None
        )
        for name, unit in self._layers.items():
            layout = self._layouts[name]
            if not isinstance(unit, UnitParams) or layout.frozen is None:
                continue
            if any(".lora_magnitude_vector." in f".{path}." for path, _ in unit.owners()):
                continue  # DoRA reads its base layers' weights itself
            names = {id(p): pname for pname, p in unit.named_parameters()}
            slots = {slot.name: slot for slot in layout.frozen.slots}
            at_use: set[str] = set()
            for _, module in unit.owners():
                weight = getattr(module, "weight", None)
                pname = names.get(id(weight))
                if pname is None or pname not in slots or not _decodable(module):
                    continue
                if holders[id(weight)] != 1:
                    continue  # shared (tied): its other holder reads it bound
                assert isinstance(weight, torch.Tensor)
                rows = FrozenRows(
                    layer=name,
                    shape=(weight.shape[0], weight.shape[1]),
                    offset=slots[pname].offset,
                    codec=self._store.frozen_codec,
                    world_size=self._comm.world_size,
                    shard_numel=layout.frozen.shard_numel,
                    wire=self.gathered_wire,
                )
                if isinstance(module, nn.Embedding):
                    module.forward = FrozenEmbeddingForward(module, rows)
                else:
                    assert isinstance(module, nn.Linear)
                    module.forward = FrozenLinearForward(module, rows)
                self.decoded_at_use[param_key(name, pname)] = rows
                at_use.add(pname)
            if not at_use:
                continue
            eager, at = [], layout.padded_numel
            for slot in layout.frozen.slots:
                if slot.name not in at_use:
                    eager.append((slot, at))
                    at += -(-slot.numel // 16) * 16  # even offsets: the fast nf4 decode
            self._eager[name] = tuple(eager)
            self._eager_numel[name] = at - layout.padded_numel

    def reserve_scratch(self) -> None:
        """Allocate the calling thread's scratch for the largest weight decoded at use (at
        the start of a pass, on the thread that runs the model; nothing to do when no
        weight is decoded at use)."""
        if self.decoded_at_use:
            rows = max(self.decoded_at_use.values(), key=lambda r: r.block_numel)
            reserve_scratch(rows.block_numel, rows.dtype, self.device)

    def release_scratch(self) -> None:
        """Free the scratch frozen weights are decoded into at use (at the end of a pass;
        nothing to do when no weight is decoded at use)."""
        if self.decoded_at_use:
            release_scratch()

    def _buffer_numel(self, name: str) -> int:
        """Elements of ``name``'s gathered buffer (the frozen part only what is decoded)."""
        layout = self._layouts[name]
        if name in self._eager:
            return layout.padded_numel + self._eager_numel[name]
        return layout.gather_numel

    def nbytes(self, name: str) -> int:
        """Bytes of ``name``'s buffers while its gather is in flight: the gathered buffer
        (padded, in the compute dtype), and with a compressed wire the received shards."""
        return self._flat_nbytes(name) + self._wire_nbytes(name)

    def _flat_nbytes(self, name: str) -> int:
        return self._buffer_numel(name) * self._store.codec.compute_itemsize

    def _wire_nbytes(self, name: str) -> int:
        layout = self._layouts[name]
        frozen = 0
        if layout.frozen is not None and self._frozen_on_wire:
            frozen = self._comm.world_size * self._store.frozen_codec.wire_nbytes(
                layout.frozen.shard_numel
            )
        return frozen + self._trainable_wire_nbytes(name)

    def _trainable_wire_nbytes(self, name: str) -> int:
        layout = self._layouts[name]
        if not self.compressed_wire or not layout.padded_numel:
            return 0
        return self._comm.world_size * self._store.codec.wire_nbytes(layout.shard_numel)

    def gathered_flat(self, name: str) -> torch.Tensor:
        """``name``'s gathered flat buffer (KeyError when it is not gathered)."""
        return self._gathered[name]

    def gathered_wire(self, name: str) -> torch.Tensor:
        """``name``'s gathered frozen parameters as stored (see [Note: frozen weights
        decoded at use]).

        Raises:
            StateError: when ``name`` is not gathered (its module ran outside the manager).
        """
        wire = self._wires.get(name)
        if wire is None:
            raise StateError(
                f"unit {name!r} is not gathered: its frozen weights are decoded at use, so "
                "the model runs only through the manager"
            )
        return wire

    def gathered_buffer(self, name: str, part: int) -> torch.Tensor:
        """``name``'s gathered buffer ``part``: 0 the flat buffer, 1 its frozen wire (KeyError
        when it is not gathered)."""
        return self._gathered[name] if part == 0 else self._wires[name]

    def gathered_storages(self) -> dict[int, tuple[str, int, int]]:
        """Storage pointer -> (layer, storage offset, part of :meth:`gathered_buffer`) of
        every gathered buffer with elements."""
        found = {
            buf.untyped_storage().data_ptr(): (name, buf.storage_offset(), part)
            for part, buffers in enumerate((self._gathered, self._wires))
            for name, buf in buffers.items()
            if buf.numel()
        }
        return found

    def is_gathered(self, name: str) -> bool:
        return name in self._gathered

    def is_inflight(self, name: str) -> bool:
        return name in self._inflight

    def inflight(self) -> list[GatherHandle]:
        return list(self._inflight.values())

    def gathered_layers(self) -> list[str]:
        return list(self._gathered)

    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers gathered on the device now (with the frozen wires
        of units decoded at use)."""
        gathered = sum(tensor_bytes(t) for t in self._gathered.values())
        return gathered + sum(tensor_bytes(t) for t in self._wires.values())

    def inflight_bytes(self) -> int:
        """Bytes of buffers whose gather is in flight (received compressed shards included)."""
        return sum(
            tensor_bytes(h.flat) + tensor_bytes(h.wire) + tensor_bytes(h.frozen_wire)
            for h in self._inflight.values()
        )

    def pooled_bytes(self) -> int:
        """Bytes of released buffers pooled for reuse."""
        return sum(tensor_bytes(t) for ts in self._pool.values() for t in ts)

    def clear_pool(self) -> None:
        """Free the pooled buffers (their storage goes back to the allocator)."""
        self._pool.clear()

    def take_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``numel`` elements from the pool (fresh when none fits): for a
        gather, or lent to other work (a reduce-scatter's receive buffer). Give it back
        with :meth:`give_buffer`."""
        free = self._pool.get((numel, dtype))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def give_buffer(self, buffer: torch.Tensor) -> None:
        """Take back a buffer from :meth:`take_buffer`: pooled (CPU device only) while
        gathered + in flight + pooled stays within ``pool_limit``, else freed."""
        fits = self.reserved_bytes() + self.pooled_bytes() + tensor_bytes(buffer) <= self.pool_limit
        if self.device.type == "cpu" and fits:
            self._pool.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    def reserved_bytes(self) -> int:
        """Gathered plus in-flight buffer bytes: what the budget limits."""
        return self.gathered_bytes() + self.inflight_bytes()

    def launch(self, name: str, phase: Phase) -> GatherHandle:
        """Allocate ``name``'s buffer and start its gather; returns at once.

        The compute copy is copied to the device and decoded there on the h2d
        stream, and the all-gather is launched from that stream, so the compute
        stream only waits when it needs the result (see [Note: copy streams]);
        with a compressed wire the stored copy is all-gathered and decoded when
        the collective completes (see [Note: compressed gather]). A layer with
        frozen parameters gathers their shards as stored into the buffer's frozen
        part with a second all-gather (see [Note: frozen parameters]).
        Collectives start here, in program order, identically on every rank.
        """
        layout = self._layouts[name]
        dtype = self._store.compute_dtype
        flat = self.take_buffer(self._buffer_numel(name), dtype)
        trainable = flat[: layout.padded_numel]
        pending = wire = None
        started = time.perf_counter()
        if layout.padded_numel and self._store.disk is not None:
            pending, wire = self._launch_from_disk(name, trainable, phase)
        elif layout.padded_numel:
            pending, wire = self._launch_part(
                name,
                trainable,
                self._store.compute_copy(name),
                self._store.codec,
                self.compressed_wire,
                layout.shard_numel,
                phase,
            )
        frozen_pending = frozen_wire = None
        frozen_copy = self._store.frozen_copy(name)
        if layout.frozen is not None and frozen_copy is not None:
            frozen_pending, frozen_wire = self._launch_part(
                name,
                flat[layout.padded_numel :],
                frozen_copy,
                self._store.frozen_codec,
                self._frozen_on_wire,
                layout.frozen.shard_numel,
                phase,
                eager=self._eager.get(name),
            )
        waits = [p.wait() for p in (pending, frozen_pending) if p is not None]
        waiter = asyncio.ensure_future(_all(waits)) if waits else None
        handle = GatherHandle(
            layer=name,
            flat=flat,
            pending=pending,
            started=started,
            waiter=waiter,
            wire=wire,
            frozen_pending=frozen_pending,
            frozen_wire=frozen_wire,
        )
        self._inflight[name] = handle
        self.high_water_bytes = max(self.high_water_bytes, self.reserved_bytes())
        return handle

    def _launch_part(
        self,
        name: str,
        out: torch.Tensor,
        src: CompressedShard,
        codec: ShardCodec,
        on_wire: bool,
        shard_numel: int,
        phase: Phase,
        *,
        eager: tuple[tuple[ParamSlot, int], ...] | None = None,
    ) -> tuple[PendingCollective, torch.Tensor | None]:
        """Launch the all-gather of one part of ``name``'s buffer (``out``) from this
        rank's shard ``src`` in ``codec``'s format: sent as stored and decoded after
        (``on_wire``), or decoded first. With ``eager`` (slot, offset in ``out``'s buffer)
        only those slots are decoded, and the wire is kept (see [Note: frozen weights
        decoded at use])."""
        what = f"the gather of {name!r}"
        wire = None
        with self._streams.on(self._streams.h2d):
            copy_started = self._streams.event_now(self._streams.h2d)
            staged = src.to(self.device, non_blocking=True)
            if staged is not src:
                self._streams.track_copy(
                    "h2d", name, phase, src.nbytes(), copy_started, self._streams.h2d
                )
            if on_wire:
                size = self._comm.world_size * codec.wire_nbytes(shard_numel)
                wire = self.take_buffer(size, torch.uint8)
                pending = self._comm.start_all_gather(wire, staged.wire(), what=what)
                if eager is None:
                    pending.then(functools.partial(self._decode, codec, wire, out))
                else:
                    base = self._layouts[name].padded_numel
                    pending.then(
                        functools.partial(self._decode_eager, wire, out, eager, base, shard_numel)
                    )
            else:
                if staged.scales is None and staged.payload.dtype == out.dtype:
                    shard = staged.payload
                else:
                    shard = torch.empty(shard_numel, dtype=out.dtype, device=self.device)
                    codec.decode_(staged, shard)
                pending = self._comm.start_all_gather(out, shard, what=what)
        return pending, wire

    def _launch_from_disk(
        self, name: str, flat: torch.Tensor, phase: Phase
    ) -> tuple[PendingCollective, torch.Tensor | None]:
        """Launch ``name``'s gather from its compute copy on disk (see [Note: compute
        copies on disk]): the launcher thread waits for the copy's read, moves it to
        the device and decodes it right before the all-gather; the read buffer is
        released when the collective has completed."""
        disk, codec = self._store.disk, self._store.codec
        assert disk is not None
        staged = disk.stage(name, phase)
        what = f"the gather of {name!r}"
        device = self.device
        wire = None
        with self._streams.on(self._streams.h2d):
            if self.compressed_wire:
                wire = self.take_buffer(self._trainable_wire_nbytes(name), torch.uint8)
                pending = self._comm.start_all_gather(
                    wire, lambda: staged.wait().to(device).wire(), what=what
                )
                pending.then(functools.partial(self._decode, codec, wire, flat))
            else:
                direct = codec.storage_dtype == flat.dtype
                shard_numel = self._layouts[name].shard_numel
                shard = (
                    None if direct else torch.empty(shard_numel, dtype=flat.dtype, device=device)
                )

                def send() -> torch.Tensor:
                    src = staged.wait().to(device)
                    if shard is None:
                        return src.payload
                    codec.decode_(src, shard)
                    return shard

                pending = self._comm.start_all_gather(flat, send, what=what)
        pending.then(staged.release)
        return pending, wire

    def read_ahead(self, names: Iterable[str], phase: Phase) -> None:
        """Start reading ``names``' compute copies from disk for gathers to come (nothing
        when the copies are in memory)."""
        if self._store.disk is not None:
            self._store.disk.read_ahead(names, phase)

    def _decode(self, codec: ShardCodec, wire: torch.Tensor, flat: torch.Tensor) -> None:
        """Decode a completed compressed all-gather into the gathered buffer.

        [Note: compressed gather]
        With ``gather_compression`` the all-gather's input is the rank's compute
        copy as stored (``CompressedShard.wire``: bf16, or int8 scales and payload
        in one byte buffer) and its output one byte buffer of every rank's. When
        it completes, every rank decodes each rank's part into that rank's slice
        of the flat compute-dtype buffer, exactly as that rank's shard is decoded
        before an uncompressed all-gather, so the gathered values are bitwise the
        same while the wire carries the stored bytes (a half or about a quarter of
        fp32's). Runs on the event loop right after the collective (on CUDA on the
        current stream, which the collective's wait has ordered after it).
        """
        self._streams.mark_used_on_current(wire)
        codec.decode_gathered_(wire, flat, world_size=self._comm.world_size)

    def _decode_eager(
        self,
        wire: torch.Tensor,
        out: torch.Tensor,
        eager: tuple[tuple[ParamSlot, int], ...],
        base: int,
        shard_numel: int,
    ) -> None:
        """Decode the frozen slots not decoded at use from a completed all-gather's wire into
        their places in ``out`` (the buffer's frozen part, which starts at ``base``)."""
        self._streams.mark_used_on_current(wire)
        codec = self._store.frozen_codec
        for slot, at in eager:
            codec.decode_gathered_range_(
                wire,
                out[at - base : at - base + slot.numel],
                world_size=self._comm.world_size,
                shard_numel=shard_numel,
                start=slot.offset,
            )

    async def complete(self, name: str, phase: Phase) -> nn.Module:
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
        if handle.wire is not None:
            self.give_buffer(handle.wire)  # decoded already (see _decode)
        if handle.frozen_wire is not None and name in self._eager:
            self._streams.mark_used_on_current(handle.frozen_wire)
            self._wires[name] = handle.frozen_wire  # decoded at use
        elif handle.frozen_wire is not None:
            self.give_buffer(handle.frozen_wire)
        self._streams.mark_used_on_current(handle.flat)
        done = handle.completed_at()
        self._timeline.add(
            "gather",
            name,
            phase,
            handle.started,
            done if done is not None else time.perf_counter(),
            "comm",
            nbytes=tensor_bytes(handle.flat),
        )
        self._streams.add_finished_copies(self._timeline)
        self._gathered[name] = handle.flat
        self._bind(name, handle.flat)
        return self._layers[name]

    async def gather(self, name: str, phase: Phase) -> nn.Module:
        """Launch (if needed) and complete ``name``'s gather; returns the layer module."""
        if name in self._gathered:
            return self._layers[name]
        start = time.perf_counter()
        if name not in self._inflight:
            self.launch(name, phase)
        module = await self.complete(name, phase)
        # The compute thread waited this long for the layer: exposed communication.
        self._timeline.add("wait", name, phase, start, time.perf_counter())
        return module

    def release(
        self, name: str, phase: Phase, *, keep_grads: bool = False, pool: bool = True
    ) -> None:
        """Free ``name``'s full parameters (no-op if not gathered).

        Args:
            name: the layer.
            phase: the phase the release belongs to (the timeline's label).
            keep_grads: leave the parameters' ``.grad`` (gradients still being
                accumulated while the values are not needed).
            pool: keep the buffer for the next gather of its size (within the
                pool's limit); False frees it at once.
        """
        flat = self._gathered.pop(name, None)
        if flat is not None:
            wire = self._wires.pop(name, None)
            self._unbind(name, keep_grads=keep_grads)
            if pool:
                self.give_buffer(flat)
                if wire is not None:
                    self.give_buffer(wire)
            now = time.perf_counter()
            nbytes = tensor_bytes(flat) + tensor_bytes(wire)
            self._timeline.add("release", name, phase, now, now, nbytes=nbytes)


async def _all(waits: list[Awaitable[None]]) -> None:
    """Await every one of ``waits`` (each is awaited, also after one failed)."""
    results = await asyncio.gather(*waits, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _decodable(module: nn.Module) -> bool:
    """Whether ``module`` is a plain, frozen ``nn.Linear`` or ``nn.Embedding`` whose weight can
    be decoded at use (see [Note: frozen weights decoded at use])."""
    if type(module) not in (nn.Linear, nn.Embedding) or "forward" in vars(module):
        return False
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return False
    weight = module.weight
    return isinstance(weight, torch.Tensor) and not weight.requires_grad and weight.dim() == 2
