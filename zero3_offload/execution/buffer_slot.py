"""A saved tensor's place in its layer's gathered flat buffer."""

from __future__ import annotations

import attrs
import torch

__all__ = ["BufferSlot"]


@attrs.frozen
class BufferSlot:
    """A saved tensor's place in its layer's gathered flat buffer (see [Note: saved activations]
    in ``execution.layer_runner``).

    Autograd keeps this instead of a parameter (or a view of one), so the
    buffer can be released between the passes and the view rebuilt from the
    buffer gathered again, which has the same layout.
    """

    layer: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements from the buffer's start
    # Which of the layer's gathered buffers: 0 the flat buffer, 1 its frozen parameters
    # as stored (see [Note: frozen weights decoded at use] in ``parameter.frozen_rows``).
    part: int = 0

    @classmethod
    def of(cls, layer: str, t: torch.Tensor, base: int, part: int = 0) -> BufferSlot:
        """The slot of ``t``, a view into ``layer``'s buffer ``part`` starting at storage
        offset ``base``."""
        return cls(layer, t.size(), t.stride(), t.storage_offset() - base, part)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved view, rebuilt from ``flat``, the layer's buffer (its ``part``) gathered now."""
        return flat.as_strided(self.size, self.stride, flat.storage_offset() + self.offset)
