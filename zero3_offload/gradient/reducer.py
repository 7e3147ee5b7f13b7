"""Reduce-scatter of each layer's flat gradient to the ranks that own its slices.

After a layer's backward, its parameter gradients sit in a flat padded buffer
laid out like the parameters (see [Note: flat layout] in
``parameter.flat_layout``), and one reduce-scatter averages it over ranks, so
each rank receives the mean gradient of exactly the slice it owns. The flat
buffers come from :class:`GradientBuffers`, so backward does not allocate a
fresh full-layer buffer per layer, while the reduce-scatter of one layer still
overlaps the compute of the next. (The Rust module's ``gradient_management.rs`` keeps
every rank's whole gradient and divides by the world size without
communicating; this is the real collective.) With ``reduce_dtype`` bf16 the
flat gradient is cast into its slot's bf16 buffer, that is reduce-scattered
(the mean taken as for fp32: ``ReduceOp.AVG`` where the backend has it, else a
sum divided by the world size, in bf16), and the shard widened to fp32. In a
token-weighted backward the flat gradient is multiplied by ``tokens *
world_size`` before it is sent (see [Note: token-weighted gradients] in
``gradient.store``). With sequence parallelism it is multiplied by
``sequence_parallel_size`` too: the ranks of a sequence hold parts of its gradient,
which add (see [Note: sequence parallelism] in ``zero3_offload.sequence``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import anyio.to_thread
import attrs
import torch
from torch import nn

from zero3_offload.comm.collectives import Collectives, PendingCollective
from zero3_offload.comm.exchange import BufferLender
from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.parameter.flat_layout import LayerLayout
from zero3_offload.parameter.unit_params import UnitParams
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.tensor_bytes import tensor_bytes
from zero3_offload.stats.timeline import Timeline

__all__ = ["GradientReducer", "GradientSlot", "PendingGradient"]

# Buffers at least this long (elements) are zeroed in a worker thread.
_ZERO_OFF_LOOP = 1 << 20


@attrs.define
class PendingGradient:
    """A layer's gradient shard whose reduce-scatter is in flight."""

    layer: str
    shard: torch.Tensor | None  # 1D fp32 [shard_numel] until finish() hands it over
    collective: PendingCollective
    slot: int  # the GradientBuffers slot held until completion
    started: float  # time.perf_counter() at launch
    nbytes: int  # bytes of the full flat gradient reduced (in the wire dtype)


@attrs.define
class GradientSlot:
    """A flat gradient buffer taken for one layer's backward (see GradientReducer.prepare)."""

    index: int  # the GradientBuffers slot
    flat: torch.Tensor  # 1D fp32 [padded_numel] view of the slot


class GradientReducer:
    """Flattens a layer's gradients and reduce-scatters them to their owners.

    Args:
        layouts: each layer's flat layout.
        comm: collectives of the group.
        buffers: the flat device buffers gradients are reduce-scattered from.
        timeline: where reduce-scatters and waits are recorded.
        lender: lends the receive buffers of reduce-scatters by exchange (the gather
            pool; see [Note: reduce-scatter by exchange]); None: fresh buffers.
        sequence_parallel_size: ranks that share each sequence (their gradients add).
    """

    def __init__(
        self,
        *,
        layouts: Mapping[str, LayerLayout],
        comm: Collectives,
        buffers: GradientBuffers,
        timeline: Timeline,
        lender: BufferLender | None = None,
        sequence_parallel_size: int = 1,
    ) -> None:
        self._layouts = layouts
        self._lender = lender
        self._comm = comm
        self._buffers = buffers
        self._timeline = timeline
        # layer -> bytes of its reduced shard of this pass, until it is committed
        self._uncommitted: dict[str, int] = {}
        self._weight: float | None = None  # this pass's gradient weight (token-weighted)
        self._sequence_parallel = sequence_parallel_size

    def has_gradients(self, layer: str) -> bool:
        """Whether ``layer`` has trainable parameters (a layer with none launches no
        reduce-scatter; see [Note: frozen parameters])."""
        return self._layouts[layer].numel > 0

    def pending_shard_bytes(self) -> int:
        """Bytes of this pass's gradient shards (in flight or landed) not yet committed."""
        return sum(self._uncommitted.values())

    def forget_pending(self, layer: str | None = None) -> None:
        """Stop counting ``layer``'s shard (None: every shard of the pass) as pending: it was
        committed to the gradient store, or dropped."""
        if layer is None:
            self._uncommitted.clear()
        else:
            self._uncommitted.pop(layer, None)

    def end_pass(self) -> None:
        """Every reduce-scatter of a backward is launched: free the idle gradient buffers."""
        self._buffers.trim()

    def begin_pass(self, *, tokens: int | None = None) -> None:
        """Start a backward pass: buffers a failed pass took and never launched are free.

        With ``tokens`` (this rank's valid tokens of a token-weighted pass) every
        gradient of the pass is multiplied by ``tokens * world_size`` before it is
        reduced, zeroed for 0 tokens (see [Note: token-weighted gradients] in
        ``gradient.store``); with sequence parallelism by ``sequence_parallel_size`` too.
        """
        self._buffers.untake_all()
        self._uncommitted.clear()
        size = self._sequence_parallel
        if tokens is None:
            self._weight = None if size == 1 else float(size)
        else:
            self._weight = float(tokens * self._comm.world_size * size)

    async def prepare(
        self,
        layer: str,
        module: nn.Module | UnitParams,
        *,
        in_place: bool = True,
        fresh: bool = False,
    ) -> GradientSlot:
        """Take a flat buffer for ``layer``'s gradients.

        With ``in_place`` (before the layer's backward runs) and parameters in
        fp32 on the buffer's device, each ``param.grad`` is set to its zeroed
        view of the buffer, so autograd accumulates into the buffer in place
        (see [Note: gradients in place]); otherwise the gradients are copied in
        by :meth:`start_reduce_scatter`. With ``fresh`` the buffer is a new
        one, not a pool slot (for a layer that keeps it for a whole pass).
        """
        layout = self._layouts[layer]
        waited = time.perf_counter()
        if fresh:
            slot, flat = self._buffers.fresh(layout.padded_numel)
        else:
            slot, flat = await self._buffers.acquire(layout.padded_numel)
        self._timeline.add("wait", layer, Phase.BACKWARD, waited, time.perf_counter())
        params = dict(module.named_parameters())
        in_place = in_place and all(
            params[s.name].dtype == flat.dtype and params[s.name].device == flat.device
            for s in layout.slots
        )
        if in_place:
            if flat.numel() >= _ZERO_OFF_LOOP:
                await anyio.to_thread.run_sync(flat.zero_)  # keeps the event loop free
            else:
                flat.zero_()
            for s in layout.slots:
                params[s.name].grad = flat[s.offset : s.offset + s.numel].view_as(params[s.name])
        return GradientSlot(index=slot, flat=flat)

    async def start_reduce_scatter(
        self, layer: str, module: nn.Module | UnitParams, prepared: GradientSlot
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
                dest.copy_(grad.reshape(-1))
            param.grad = None
        flat[layout.numel :].zero_()
        if self._weight is not None:
            await self._weigh(flat, self._weight)
        shard = torch.empty(layout.shard_numel, dtype=torch.float32, device=flat.device)
        what = f"the gradients of {layer!r}"
        if self._buffers.wire_dtype is None:
            sent = flat
            collective = self._comm.start_reduce_scatter_mean(
                shard, flat, what=what, lender=self._lender
            )
        else:
            # reduce_dtype: the cast gradient is what the collective reads; its mean
            # arrives in the wire dtype and is widened into the fp32 shard.
            sent = self._buffers.wire(prepared.index, flat.numel())
            sent.copy_(flat)
            received = torch.empty_like(shard, dtype=sent.dtype)
            collective = self._comm.start_reduce_scatter_mean(
                received, sent, what=what, lender=self._lender
            )
            collective.then(functools.partial(shard.copy_, received))
        self._uncommitted[layer] = tensor_bytes(shard)
        pending = PendingGradient(
            layer=layer,
            shard=shard,
            collective=collective,
            slot=prepared.index,
            started=time.perf_counter(),
            nbytes=tensor_bytes(sent),
        )
        self._buffers.hold(prepared.index, pending.collective)
        return pending

    @staticmethod
    async def _weigh(flat: torch.Tensor, weight: float) -> None:
        """Multiply ``flat`` by ``weight`` in place; zero it for 0 (a NaN of an all-masked
        micro-batch's loss must not reach the sum)."""
        scale = flat.zero_ if weight == 0 else functools.partial(flat.mul_, weight)
        if flat.numel() >= _ZERO_OFF_LOOP:
            await anyio.to_thread.run_sync(scale)  # keeps the event loop free
        else:
            scale()

    async def finish(self, pending: PendingGradient) -> torch.Tensor:
        """Wait for ``pending``'s reduce-scatter; returns the averaged shard.

        Awaited in a task right after launch, so the recorded interval ends
        when the collective completes.
        """
        await pending.collective.wait()
        self._buffers.free(pending.slot, pending.collective)
        self._timeline.add(
            "reduce-scatter",
            pending.layer,
            Phase.BACKWARD,
            pending.started,
            time.perf_counter(),
            "comm",
            nbytes=pending.nbytes,
        )
        # Hand the shard over: the caller decides how long it lives (an early
        # update drops it at once; a PendingGradient held for error handling must not).
        shard, pending.shard = pending.shard, None
        assert shard is not None
        return shard
