"""What a training forward keeps for its backward, per layer use.

See [Note: kept activations] and [Note: backward by recomputation] in
``execution.layer_runner``.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["ForwardRecord", "RngState", "SavedStep"]


@attrs.frozen
class RngState:
    """The generator states a layer's forward ran with."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


@attrs.define
class SavedStep:
    """What backward needs from one layer's forward.

    ``inp`` is the layer input (detached; with kept activations a leaf that
    requires grad when floating). ``out`` is the output with its graph (kept
    activations) or None (recomputation, then ``rng`` is set).
    """

    inp: torch.Tensor
    out: torch.Tensor | None
    rng: RngState | None
    kept: dict[int, int]  # storage pointer -> bytes, of what this step keeps for backward


@attrs.define
class ForwardRecord:
    """What backward needs from the last forward. See [Note: kept activations]."""

    layer_names: tuple[str, ...]
    steps: list[SavedStep | None]  # one per layer use; None once backward used it
    output_shape: torch.Size

    def activation_bytes(self) -> int:
        """Bytes of the distinct storages (inputs, activations) still kept for backward."""
        kept: dict[int, int] = {}
        for s in self.steps:
            if s is not None:
                kept.update(s.kept)
        return sum(kept.values())
