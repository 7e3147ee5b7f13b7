"""The forward of a frozen ``nn.Embedding`` whose weight is decoded at use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload.parameter.frozen_rows import FrozenRows

__all__ = ["FrozenEmbeddingForward"]


class FrozenEmbeddingForward:
    """``module.forward`` of a frozen ``nn.Embedding`` (without ``max_norm``) whose weight
    stays in its stored format while gathered (see [Note: frozen weights decoded at
    use] in ``parameter.frozen_rows``).

    The rows the ids select are decoded from the unit's gathered wire: the whole
    weight at once when it fits the scratch, else block by block, each block only
    from its smallest to its largest id. The weight is frozen, so nothing is saved
    for backward; the output needs no gradient (as a frozen embedding's).

    Args:
        module: the embedding.
        rows: where its weight lies in its unit's wire.
    """

    def __init__(self, module: nn.Embedding, rows: FrozenRows) -> None:
        self._module = module
        self.rows = rows

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        rows, wire = self.rows, self.rows.wire()
        if rows.whole:
            weight = rows.decode(wire, 0, rows.rows)
            return F.embedding(input, weight, self._module.padding_idx)
        ids = input.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows.rows):
            raise IndexError(
                f"index out of range in self: ids must lie in [0, {rows.rows}), got "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        out = torch.empty(ids.numel(), rows.cols, dtype=rows.dtype, device=input.device)
        for first, end in rows.blocks():
            where = ((ids >= first) & (ids < end)).nonzero().squeeze(1)
            if not where.numel():
                continue
            picked = ids.index_select(0, where)
            low = int(picked.min())
            low -= low % rows.row_step
            block = rows.decode(wire, low, int(picked.max()) + 1)
            out.index_copy_(0, where, block.index_select(0, picked - low))
        return out.view(*input.shape, rows.cols)
