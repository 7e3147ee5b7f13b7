"""The flat fp32 gradient buffers that reduce-scatters read from, reused across layers
(with ``reduce_dtype`` bf16, each with the bf16 buffer the reduce-scatter sends)."""

from __future__ import annotations

import torch

from zero3_offload.comm.collectives import PendingCollective
from zero3_offload.errors import StateError
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["GradientBuffers"]


class GradientBuffers:
    """A pool of flat fp32 gradient buffers on the device, reused across layers.

    ``depth`` buffers let the reduce-scatter of ``depth - 1`` layers stay in
    flight while the next layer's gradients are written. A slot is taken from
    :meth:`acquire` until :meth:`hold` hands it to its reduce-scatter; when
    every slot is taken (module mode can have several units' gradients open
    at once) a fresh buffer outside the pool is handed out under slot ``-1``.

    With a ``wire_dtype``, every slot also has a buffer of that dtype (:meth:`wire`)
    that the flat gradient is cast into and the reduce-scatter reads instead; it is
    busy and free with its slot.

    Args:
        numel: elements of each buffer (a larger request gets a fresh buffer).
        device: compute device.
        depth: number of buffers.
        wire_dtype: dtype the gradients are reduce-scattered in (``reduce_dtype``);
            None: the fp32 buffers themselves are reduce-scattered.
    """

    def __init__(
        self,
        *,
        numel: int,
        device: torch.device,
        depth: int = 2,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self._numel = numel
        self.wire_dtype = wire_dtype
        # Allocated on first use, dropped by trim() between backward passes.
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._wires: list[torch.Tensor | None] = [None] * depth  # wire_dtype buffers
        self._busy: list[PendingCollective | None] = [None] * depth  # reading each slot
        self._taken = [False] * depth  # acquired, gradients being written (not yet held)
        self._device = device
        self._next = 0

    async def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        """A free slot and a view of its first ``numel`` elements.

        Slots are taken round robin; when the next one is still read by a
        reduce-scatter in flight, this waits for that collective.
        """
        depth = len(self._buffers)
        free = [
            k % depth for k in range(self._next, self._next + depth) if not self._taken[k % depth]
        ]
        if not free or numel > self._numel:
            return self.fresh(numel)
        slot = free[0]
        self._next = (slot + 1) % depth
        self._taken[slot] = True
        pending = self._busy[slot]
        if pending is not None:
            await pending.wait()
        self._busy[slot] = None
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = torch.empty(self._numel, dtype=torch.float32, device=self._device)
            self._buffers[slot] = buffer
        return slot, buffer[:numel]

    def fresh(self, numel: int) -> tuple[int, torch.Tensor]:
        """A buffer outside the pool (slot ``-1``), for a layer larger than the pool's."""
        return -1, torch.empty(numel, dtype=torch.float32, device=self._device)

    def wire(self, slot: int, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of ``slot``'s ``wire_dtype`` buffer (a fresh buffer
        for slot ``-1``), taken and held with the slot.

        Raises:
            StateError: without a ``wire_dtype``.
        """
        if self.wire_dtype is None:
            raise StateError("these gradient buffers have no wire dtype: reduce_dtype is fp32")
        if slot < 0:
            return torch.empty(numel, dtype=self.wire_dtype, device=self._device)
        buffer = self._wires[slot]
        if buffer is None:
            buffer = torch.empty(self._numel, dtype=self.wire_dtype, device=self._device)
            self._wires[slot] = buffer
        return buffer[:numel]

    def hold(self, slot: int, collective: PendingCollective) -> None:
        """Mark ``slot`` as read by ``collective`` until :meth:`free`."""
        if slot >= 0:
            self._busy[slot] = collective
            self._taken[slot] = False

    def free(self, slot: int, collective: PendingCollective) -> None:
        """``collective`` (held by ``slot``) completed: the slot is no longer read.

        A no-op when the slot was taken again since (its new owner waited for
        ``collective`` already and is writing it now).
        """
        if slot >= 0 and self._busy[slot] is collective:
            self._busy[slot] = None

    def trim(self) -> None:
        """Drop the buffers no layer is writing (after the last reduce-scatter of a backward):
        they are allocated again when the next backward needs them. One still read by a
        reduce-scatter in flight is freed when that completes."""
        self._buffers = [
            b if taken else None for b, taken in zip(self._buffers, self._taken, strict=True)
        ]
        self._wires = [
            b if taken else None for b, taken in zip(self._wires, self._taken, strict=True)
        ]

    def untake_all(self) -> None:
        """Forget slots taken by a pass that failed before launching their reduce-scatter."""
        self._taken = [False] * len(self._taken)

    def nbytes(self) -> int:
        """Bytes of the buffers (wire buffers included), counted from the tensors."""
        return sum(tensor_bytes(b) for b in (*self._buffers, *self._wires) if b is not None)
