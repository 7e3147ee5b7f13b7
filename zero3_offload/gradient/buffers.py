"""The flat fp32 gradient buffers that reduce-scatters read from, reused across layers."""

from __future__ import annotations

import torch

from zero3_offload.comm.collectives import PendingCollective
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["GradientBuffers"]


class GradientBuffers:
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
        self._busy: list[PendingCollective | None] = [None] * depth  # reading each slot
        self._next = 0

    async def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        """A free slot and a view of its first ``numel`` elements.

        Slots are taken round robin; when the next one is still read by a
        reduce-scatter in flight, this waits for that collective.
        """
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        pending = self._busy[slot]
        if pending is not None:
            await pending.wait()
        self._busy[slot] = None
        return slot, self._buffers[slot][:numel]

    def hold(self, slot: int, collective: PendingCollective) -> None:
        """Mark ``slot`` as read by ``collective`` until :meth:`free`."""
        self._busy[slot] = collective

    def free(self, slot: int) -> None:
        """Mark ``slot`` as free (its collective completed)."""
        self._busy[slot] = None

    def nbytes(self) -> int:
        """Bytes of the buffers, counted from the tensors."""
        return sum(tensor_bytes(b) for b in self._buffers)
