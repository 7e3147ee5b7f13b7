"""What one pass of either runner leaves: one record type for chain and module mode."""

from __future__ import annotations

import asyncio

import attrs
import torch

from zero3_offload.execution.saved_step import SavedStep
from zero3_offload.gradient.reducer import PendingGradient
from zero3_offload.stats.phase import Phase

__all__ = ["PassResult"]


@attrs.define(eq=False)
class PassResult:
    """One pass of :class:`ChainRunner` or :class:`ModuleRunner`, as it ran.

    A training forward's result is what its backward goes through (the manager
    holds it until then); a backward's holds the reduce-scatters it launched until
    they landed (see :class:`GradientLanding`).
    """

    phase: Phase
    layers: list[str] = attrs.Factory(list)
    """The layers (units) in the order they ran; a layer used twice appears twice."""
    samples: int = 0
    """Rows of the batch (forward passes)."""
    steps: list[SavedStep | None] = attrs.Factory(list)
    """Chain mode, training forward: per layer use, what its backward needs (None once
    the backward used it)."""
    output_shape: torch.Size | None = None
    """Chain mode: the shape of the forward's output (its gradient must match)."""
    saved: dict[int, int] = attrs.Factory(dict)
    """Module mode, training forward: storage pointer -> bytes autograd saved for backward
    (gathered parameters excluded)."""
    root_views: int = 0
    """Module mode: views of the root unit's gathered values that autograd saved (training
    forward), or that its backward has still to unpack (backward)."""
    pending: list[PendingGradient] = attrs.Factory(list)
    """Backward: the reduce-scatters launched, in launch order."""
    landings: list[asyncio.Future[torch.Tensor | None]] = attrs.Factory(list)
    """Backward: per reduce-scatter, the task that waits for it and hands its shard over
    (its *landing*: to the gradient store, or to the layer's early update)."""
    grad_inputs: set[str] = attrs.Factory(set)
    """Module mode, training forward: the units with an input that needs a gradient. Such
    a unit's backward is over only once that gradient is computed (its frozen weights
    may still be needed after its trainable ones have their gradients)."""
    no_backward: set[str] = attrs.Factory(set)
    """Training forward: the layers (units) no gradient goes through (frozen, after inputs
    that need none). Their backward is skipped, so they are not gathered again."""

    def units(self) -> list[str]:
        """Distinct layers (units) run, in first-use order."""
        return list(dict.fromkeys(self.layers))

    def saved_bytes(self) -> int:
        """Bytes of the distinct storages (inputs, activations) still saved for backward."""
        saved = dict(self.saved)
        for step in self.steps:
            if step is not None:
                saved.update(step.saved)
        return sum(saved.values())
