"""Gradient shards: reduce-scatter each layer's flat gradient to its owners.

After a layer's backward, its parameter gradients are copied into a flat padded
buffer laid out like the parameters (see [Note: flat layout] in
``parameter_management``), and one reduce-scatter averages it over ranks, so each
rank receives the mean gradient of exactly the slice it owns. The flat buffers
come from a small pool on the device (:class:`GpuGradientBuffer`) so backward
does not allocate a fresh full-layer buffer per layer, while the reduce-scatter
of one layer still overlaps the compute of the next.

Shards of one backward pass are committed to :class:`CpuGradientStore` only
when the whole pass succeeded, so a pass that raised leaves the accumulated
gradients as they were.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import attrs
import torch
from torch import nn

from zero3_offload.comm import Collectives, PendingCollective
from zero3_offload.parameter_management import LayerLayout, tensor_bytes
from zero3_offload.streams import CopyStreams
from zero3_offload.timeline import Timeline
from zero3_offload.workers import CpuWorkers

__all__ = [
    "CpuGradientStore",
    "GpuGradientBuffer",
    "GradientPartitioner",
    "GradientSlot",
    "PendingGradient",
]


@attrs.define
class PendingGradient:
    """A layer's gradient shard whose reduce-scatter is in flight."""

    layer: str
    shard: torch.Tensor | None  # 1D fp32 [shard_numel] until finish() hands it over
    collective: PendingCollective
    slot: int  # the GpuGradientBuffer slot held until completion
    started: float  # time.perf_counter() at launch
    nbytes: int  # bytes of the full flat gradient reduced


@attrs.define
class GradientSlot:
    """A flat gradient buffer taken for one layer's backward (see GradientPartitioner.prepare)."""

    index: int  # the GpuGradientBuffer slot
    flat: torch.Tensor  # 1D fp32 [padded_numel] view of the slot


class GpuGradientBuffer:
    """A pool of flat fp32 gradient buffers on the device, reused across layers.

    ``depth`` buffers let the reduce-scatter of ``depth - 1`` layers stay in
    flight while the next layer's gradients are written.

    Args:
        numel: elements of the largest layer's padded flat buffer.
        device: compute device.
        depth: number of buffers.
    """

    def __init__(self, *, numel: int, device: torch.device, depth: int = 2) -> None:
        self._buffers = [
            torch.empty(numel, dtype=torch.float32, device=device) for _ in range(depth)
        ]
        self._busy: list[PendingGradient | None] = [None] * depth
        self._next = 0

    async def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        """A free slot and a zero-length-``numel`` view of it; waits for the oldest in flight."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        pending = self._busy[slot]
        if pending is not None:
            await pending.collective.wait()
        self._busy[slot] = None
        return slot, self._buffers[slot][:numel]

    def hold(self, slot: int, pending: PendingGradient) -> None:
        self._busy[slot] = pending

    def free(self, slot: int) -> None:
        self._busy[slot] = None

    def nbytes(self) -> int:
        return sum(tensor_bytes(b) for b in self._buffers)


class GradientPartitioner:
    """Flattens a layer's gradients and reduce-scatters them to their owners.

    Args:
        layouts: each layer's flat layout.
        comm: collectives of the group.
        buffer: pool of flat device buffers.
        timeline: where reduce-scatters and waits are recorded.
    """

    def __init__(
        self,
        *,
        layouts: Mapping[str, LayerLayout],
        comm: Collectives,
        buffer: GpuGradientBuffer,
        timeline: Timeline,
    ) -> None:
        self._layouts = layouts
        self._comm = comm
        self._buffer = buffer
        self._timeline = timeline

    async def prepare(self, layer: str, module: nn.Module) -> GradientSlot:
        """Take a flat buffer for ``layer``'s gradients before its backward runs.

        When the parameters are fp32 on the buffer's device, each ``param.grad``
        is set to its zeroed view of the buffer, so autograd accumulates into
        the buffer in place (see [Note: gradients in place]); otherwise the
        gradients are copied in by :meth:`start_reduce_scatter`.
        """
        layout = self._layouts[layer]
        waited = time.perf_counter()
        slot, flat = await self._buffer.acquire(layout.padded_numel)
        self._timeline.record("wait", layer, "backward", waited, time.perf_counter())
        params = dict(module.named_parameters())
        in_place = all(
            params[s.name].dtype == flat.dtype and params[s.name].device == flat.device
            for s in layout.slots
        )
        if in_place:
            flat.zero_()
            for s in layout.slots:
                params[s.name].grad = flat[s.offset : s.offset + s.numel].view_as(params[s.name])
        return GradientSlot(index=slot, flat=flat)

    async def start_reduce_scatter(
        self, layer: str, module: nn.Module, prepared: GradientSlot
    ) -> PendingGradient:
        """Launch the reduce-scatter of ``module``'s parameter gradients.

        Gradients not already in ``prepared``'s buffer (from :meth:`prepare`)
        are copied in; parameters without a gradient contribute zeros, as do
        the padding elements. The parameters' ``.grad`` are cleared (the
        buffer holds the gradient now).

        [Note: gradients in place]
        With a buffer from :meth:`prepare`, autograd adds each parameter's
        gradient into its view of the flat buffer (``AccumulateGrad`` adds in
        place into a defined ``.grad``), which saves a layer-sized allocation
        and a copy per layer. A gradient that autograd replaced instead (a
        hook assigning ``.grad``) no longer points into the buffer and is
        copied like any other.
        """
        layout = self._layouts[layer]
        flat = prepared.flat
        params = dict(module.named_parameters())
        for s in layout.slots:
            param = params[s.name]
            grad = param.grad
            dest = flat[s.offset : s.offset + s.numel]
            if grad is None:
                dest.zero_()
            elif grad.data_ptr() != dest.data_ptr():  # not accumulated in place
                dest.copy_(grad.view(-1))
            param.grad = None
        flat[layout.numel :].zero_()
        shard = torch.empty(layout.shard_numel, dtype=torch.float32, device=flat.device)
        pending = PendingGradient(
            layer=layer,
            shard=shard,
            collective=self._comm.start_reduce_scatter_mean(shard, flat),
            slot=prepared.index,
            started=time.perf_counter(),
            nbytes=tensor_bytes(flat),
        )
        self._buffer.hold(prepared.index, pending)
        return pending

    async def finish(self, pending: PendingGradient) -> torch.Tensor:
        """Wait for ``pending``'s reduce-scatter; returns the averaged shard.

        Awaited in a task right after launch, so the recorded interval ends
        when the collective completes.
        """
        await pending.collective.wait()
        self._buffer.free(pending.slot)
        self._timeline.record(
            "reduce-scatter",
            pending.layer,
            "backward",
            pending.started,
            time.perf_counter(),
            "comm",
            nbytes=pending.nbytes,
        )
        # Hand the shard over: the caller decides how long it lives (an early
        # update drops it at once; a PendingGradient kept for error handling must not).
        shard, pending.shard = pending.shard, None
        assert shard is not None
        return shard


class CpuGradientStore:
    """fp32 gradient shards accumulated over micro-steps (on the CPU when offloaded).

    Args:
        device: where the shards live.
        streams: copy streams (device-to-host copies run on ``d2h``).
        workers: CPU worker threads (accumulation runs there).
        timeline: where device-to-host copies are recorded.
        pin: stage device-to-host copies in pinned memory.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        streams: CopyStreams,
        workers: CpuWorkers,
        timeline: Timeline,
        pin: bool = False,
    ) -> None:
        self.device = device
        self._timeline = timeline
        self._streams = streams
        self._workers = workers
        self._pin = pin and device.type == "cpu"
        self._grads: dict[str, torch.Tensor] = {}  # layer -> 1D fp32 [shard_numel]
        self.micro_steps = 0  # backward passes accumulated since the last clear

    async def commit_layer(self, layer: str, shard: torch.Tensor) -> None:
        """Add one reduced shard (fp32, on the compute device) to ``layer``'s gradient.

        A device-to-host copy runs on the d2h stream into pinned memory; the
        worker thread waits for its event, then accumulates.
        """
        event = None
        if shard.device != self.device:
            with self._streams.on(self._streams.d2h):
                # The d2h stream must see the reduce-scatter's result first.
                self._streams.wait(self._streams.record(), self._streams.d2h)
                copy_started = self._streams.record(self._streams.d2h)
                host = torch.empty(
                    shard.numel(), dtype=torch.float32, device=self.device, pin_memory=self._pin
                )
                host.copy_(shard, non_blocking=True)
                if shard.is_cuda:
                    shard.record_stream(self._streams.d2h)
                event = self._streams.record(self._streams.d2h)
                self._streams.track_copy(
                    "d2h", layer, "backward", tensor_bytes(host), copy_started, self._streams.d2h
                )
            shard = host
        held = self._grads.get(layer)
        if held is None and event is None:
            self._grads[layer] = shard
            return

        def land() -> torch.Tensor:
            self._streams.host_wait(event)
            self._streams.record_finished_copies(self._timeline)
            return shard if held is None else held.add_(shard)

        self._grads[layer] = await self._workers.run("grad-accumulate", layer, "backward", land)

    async def commit(self, shards: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Add one backward pass's shards (layer, shard) and count the micro-step."""
        for layer, shard in shards:
            await self.commit_layer(layer, shard)
        self.count_micro_step()

    def count_micro_step(self) -> None:
        """Count one backward pass whose shards were committed layer by layer."""
        self.micro_steps += 1

    def load(self, grads: dict[str, torch.Tensor], micro_steps: int) -> None:
        """Replace the accumulated shards (e.g. from a checkpoint taken mid-window)."""
        self._grads = {k: v.to(self.device, torch.float32).clone() for k, v in grads.items()}
        self.micro_steps = micro_steps

    def get(self, layer: str) -> torch.Tensor | None:
        """The accumulated gradient shard of ``layer``, or None if it got none."""
        return self._grads.get(layer)

    def layers(self) -> list[str]:
        return list(self._grads)

    def scale_(self, factor: float) -> None:
        """Multiply every accumulated shard by ``factor`` in place."""
        for g in self._grads.values():
            g.mul_(factor)

    def shards(self) -> list[torch.Tensor]:
        return list(self._grads.values())

    async def global_norm(self, comm: Collectives) -> float:
        """L2 norm of the whole model's gradient: squared shard norms summed over ranks.

        Padding elements hold zero gradient, so they add nothing.
        """
        local = torch.zeros(1, dtype=torch.float64, device=comm.device)
        for g in self._grads.values():
            local += g.double().square().sum().to(comm.device)
        await comm.all_reduce_sum(local)
        return float(local.sqrt().item())

    async def clip_(self, max_norm: float, comm: Collectives) -> float:
        """Scale gradients so their global norm is at most ``max_norm``.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by
        ``min(1, max_norm / (norm + 1e-6))``.

        Returns:
            The global norm before clipping.
        """
        norm = await self.global_norm(comm)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            self.scale_(coef)
        return norm

    def drop(self, layer: str) -> None:
        """Drop ``layer``'s shard (its update is done; the window is closed for it)."""
        self._grads.pop(layer, None)

    def clear(self) -> None:
        """Drop every gradient shard (after an optimizer step)."""
        self._grads.clear()
        self.micro_steps = 0

    def nbytes(self) -> int:
        """Bytes of the accumulated shards, counted from the tensors."""
        return sum(tensor_bytes(g) for g in self._grads.values())
