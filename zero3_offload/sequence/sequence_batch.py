"""What the attention of a sequence-parallel forward needs of the whole sequence."""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from zero3_offload.sequence.full_mask import full_sequence_mask

__all__ = ["SequenceBatch"]


@attrs.define(eq=False)
class SequenceBatch:
    """One forward's whole sequence, as :func:`ulysses_attention` sees it from every layer.

    Passed to the model as a keyword argument (transformers hands its keyword arguments
    down to the attention functions), so a recomputation in backward (activation
    checkpointing) sees the same one.
    """

    group: dist.ProcessGroup  # the ranks of the sequence
    size: int  # S, ranks in the group
    implementation: str  # the model's own attention: "eager" or "sdpa"
    position_ids: torch.Tensor  # [B, T] of the whole (padded) sequence
    padding: torch.Tensor | None  # [B, T] 2D attention mask of the whole sequence, or None
    _masks: dict[tuple[int | None, torch.dtype | None], torch.Tensor | None] = attrs.field(
        factory=dict, init=False
    )

    def mask(self, sliding_window: int | None, dtype: torch.dtype | None) -> torch.Tensor | None:
        """The whole sequence's mask (see :func:`full_sequence_mask`), built once per
        window and dtype."""
        key = (sliding_window, dtype)
        if key not in self._masks:
            self._masks[key] = full_sequence_mask(
                self.position_ids, self.padding, sliding_window, dtype
            )
        return self._masks[key]
