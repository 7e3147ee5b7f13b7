"""What one optimizer step of a rank counted: its loss sum and its tokens and examples."""

from __future__ import annotations

import attrs

__all__ = ["StepCounts"]


@attrs.frozen
class StepCounts:
    """One rank's counts of a step (or, summed over ranks, the whole step's).

    ``loss_sum`` is the sum of per-token losses over the valid (learned) tokens, so
    ``loss_sum / valid`` over the ranks' sums is the step's global token mean.
    """

    loss_sum: float
    valid: float  # learned label tokens
    real: float  # tokens of examples (or windows), not padding
    padding: float  # padding positions
    examples: float  # examples (or text windows)

    def values(self) -> list[float]:
        """The counts in field order (for one all-reduce)."""
        return [self.loss_sum, self.valid, self.real, self.padding, self.examples]

    @property
    def loss(self) -> float:
        """The token-mean loss (NaN without a valid token)."""
        return self.loss_sum / self.valid if self.valid else float("nan")

    @property
    def padding_fraction(self) -> float:
        """The share of the rows' positions that are padding."""
        total = self.real + self.padding
        return self.padding / total if total else 0.0
