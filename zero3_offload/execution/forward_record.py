"""What a training forward keeps for its backward, per layer use.

See [Note: kept activations] and [Note: backward by recomputation] in
``execution.layer_runner``.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["BufferSlot", "ForwardRecord", "RngState", "SavedStep"]


@attrs.frozen
class BufferSlot:
    """A saved tensor's place in its layer's gathered flat buffer (see [Note: kept activations]).

    Autograd keeps this instead of a parameter (or a view of one), so the
    buffer can be released between the passes and the view rebuilt from the
    buffer gathered again, which has the same layout.
    """

    layer: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements from the buffer's start

    @classmethod
    def of(cls, layer: str, t: torch.Tensor, base: int) -> BufferSlot:
        """The slot of ``t``, a view into ``layer``'s buffer starting at storage offset ``base``."""
        return cls(layer, t.size(), t.stride(), t.storage_offset() - base)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved view, rebuilt from ``flat``, the layer's buffer gathered now."""
        return flat.as_strided(self.size, self.stride, flat.storage_offset() + self.offset)


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
