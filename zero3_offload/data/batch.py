"""One micro-batch of examples as the model's inputs, with its token counts."""

from __future__ import annotations

from typing import Any

import attrs
import torch

__all__ = ["Batch"]


@attrs.frozen
class Batch:
    """Rows of token ids and labels, and what the forward needs besides them.

    ``attention_mask`` is the 2-D padding mask of an unpacked batch (``None`` when
    packed); ``position_ids`` restart at 0 at every example of a packed row (``None``
    when unpacked). See ``collate``.
    """

    input_ids: torch.Tensor  # (rows, length) int64
    labels: torch.Tensor  # (rows, length) int64, IGNORED where not learned
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    examples: int  # examples in the batch (counted once, duplicates of the eval tail not)
    real_tokens: int  # tokens of examples (not padding)

    @property
    def valid_tokens(self) -> int:
        """Label tokens learned (predicted and not ignored)."""
        return int((self.labels[:, 1:] != -100).sum())

    @property
    def padding_tokens(self) -> int:
        """Padding positions of the rows."""
        return self.input_ids.numel() - self.real_tokens

    def model_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a transformers causal LM's forward (with labels).

        ``use_cache=False`` always: transformers detects packed rows from
        ``position_ids`` only without a cache (see [Note: packed rows]).
        """
        kw: dict[str, Any] = {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "use_cache": False,
        }
        if self.attention_mask is not None:
            kw["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            kw["position_ids"] = self.position_ids
        return kw
