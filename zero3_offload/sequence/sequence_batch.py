"""What the attention of a sequence-parallel forward needs of the whole sequence."""

from __future__ import annotations

import attrs
import torch

from zero3_offload.errors import InputError
from zero3_offload.sequence.full_mask import full_sequence_mask
from zero3_offload.sequence.sequence_group import SequenceGroup

__all__ = ["SequenceBatch"]


@attrs.define(eq=False)
class SequenceBatch:
    """One forward's whole sequence, as :func:`ulysses_attention` sees it from every layer.

    Passed to the model as a keyword argument (transformers hands its keyword arguments
    down to the attention functions), so a recomputation in backward (activation
    checkpointing) sees the same one.
    """

    group: SequenceGroup  # the ranks of the sequence
    size: int  # S, ranks in the group
    implementation: str  # the model's own attention: "eager" or "sdpa"
    position_ids: torch.Tensor  # [B, T] of the whole (padded) sequence
    padding: torch.Tensor | None  # [B, T] 2D attention mask of the whole sequence, or None
    fingerprint: int  # of the whole batch, in [0, 2**20): equal on the ranks of the group
    _checked: bool = attrs.field(default=False, init=False)
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

    def check_same_batch(self) -> None:
        """Raise on every rank of the group unless all were given the same batch (once per
        forward; one all-reduce of the fingerprint and its square, which sum to S times
        this rank's own on every rank only when all are equal).

        Raises:
            InputError: when the ranks of the group passed different batches.
        """
        if self._checked:
            return
        own = float(self.fingerprint)
        sums = torch.tensor([own, own * own], dtype=torch.float64, device=self.position_ids.device)
        self.group.all_reduce(sums)
        self._checked = True
        if sums[0].item() != self.size * own or sums[1].item() != self.size * own * own:
            raise InputError(
                f"the {self.size} ranks of a sequence group passed different batches to "
                "forward: with sequence_parallel_size > 1 every rank of a group passes the "
                "same whole sequences (input_ids, labels, attention_mask, position_ids), "
                "and the manager cuts them"
            )
