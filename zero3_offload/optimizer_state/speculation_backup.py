"""Pre-update copies of layers' shard state, for speculative updates that may be undone.

See [Note: speculative update] in ``optimizer_state.step_runner``.
"""

from __future__ import annotations

import torch

from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["SpeculationBackup"]


class SpeculationBackup:
    """Copies of a layer's fp32 master shard and optimizer state taken before an update.

    The buffers are allocated at a layer's first save and reused at every later
    one (a fresh large allocation costs several times a copy), so they stay
    held between steps: :meth:`nbytes` counts them. :meth:`restore` puts the
    saved values back bitwise, into the same tensors (a layer without state
    before the update gets none back).

    Args:
        optimizer: the per-layer optimizers whose masters and state are saved.
    """

    def __init__(self, optimizer: ShardOptimizers) -> None:
        self._optimizer = optimizer
        # layer -> "master" or a state key -> its copy
        self._buffers: dict[str, dict[str, torch.Tensor]] = {}
        self._saved: dict[str, frozenset[str]] = {}  # layer -> state keys it had at the save

    def save(self, layer: str) -> None:
        """Copy ``layer``'s master shard and optimizer state into its buffers."""
        sources = {"master": self._optimizer.master(layer), **self._optimizer.layer_state(layer)}
        buffers = self._buffers.setdefault(layer, {})
        for key, src in sources.items():
            buf = buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = buffers[key] = torch.empty_like(src)
            buf.copy_(src)
        self._saved[layer] = frozenset(sources)

    def restore(self, layer: str) -> None:
        """Put back what :meth:`save` copied for ``layer`` (KeyError when nothing is saved)."""
        keys = self._saved.pop(layer)
        buffers = self._buffers[layer]
        self._optimizer.master(layer).copy_(buffers["master"])
        state = self._optimizer.layer_state(layer)
        if keys == {"master"}:
            self._optimizer.load_layer_state(layer, {})
            return
        for key in keys - {"master"}:
            state[key].copy_(buffers[key])

    def discard(self, layer: str) -> None:
        """Forget ``layer``'s save (its update stands); the buffers stay for reuse."""
        self._saved.pop(layer, None)

    def saved(self) -> list[str]:
        """Layers whose pre-update values are saved and not yet restored or discarded."""
        return list(self._saved)

    def nbytes(self) -> int:
        """Bytes of the backup buffers held, counted from the tensors."""
        return sum(tensor_bytes(b) for bufs in self._buffers.values() for b in bufs.values())

    def clear(self) -> None:
        """Free every buffer (e.g. after a checkpoint load replaced the state)."""
        self._buffers.clear()
        self._saved.clear()
