"""Examples to a :class:`~zero3_offload.data.batch.Batch`: padded, or packed in rows.

[Note: packed rows]
Unpacked, each example is a row, padded on the right to the longest example of the
batch (never to ``--max-seq-len``), with a 2-D ``attention_mask``. Packed
(``--pack``), the examples go into rows of at most ``max_len`` tokens: as many rows
as first-fit decreasing needs, each example (longest first) into the shortest row
it fits, so the rows are about equally long; they are padded to the longest row.
``position_ids`` restart at 0 at every example and at the padding, and neither an
``attention_mask`` nor a cache (``use_cache=False``) is passed: that is
transformers' padding-free path, where the causal mask is built per segment of
``position_ids`` (``masking_utils.find_packed_sequence_indices``), so no token
attends to another example. The tests check it for the sdpa and eager kernels of
Llama by comparing each example's logits in a packed row with the example run
alone; a model whose attention does not build its mask with ``masking_utils``
would attend across examples, so ``--pack`` is for such models only after that
check. The first label of every example is ignored (see [Note: truncation rule]),
so no example's last token learns to predict the next example's first one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zero3_offload.data.batch import Batch
from zero3_offload.data.token_dataset import IGNORED

__all__ = ["collate"]


def _first_fit(lengths: Sequence[int], order: Sequence[int], max_len: int) -> int:
    """Rows that first-fit of ``order`` needs."""
    room: list[int] = []
    for i in order:
        free = next((r for r, left in enumerate(room) if lengths[i] <= left), None)
        if free is None:
            room.append(max_len - lengths[i])
        else:
            room[free] -= lengths[i]
    return len(room)


def _rows(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """The indices of the examples of each row: as many rows as first-fit decreasing
    needs, filled longest example first into the shortest row it fits (so the rows, which
    are padded to the longest, come out about equally long); ties in batch order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = [[] for _ in range(_first_fit(lengths, order, max_len))]
    used = [0] * len(rows)
    for i in order:
        fits = [r for r in range(len(rows)) if used[r] + lengths[i] <= max_len]
        if not fits:  # balancing can leave no room where first-fit had some
            rows.append([])
            used.append(0)
            fits = [len(rows) - 1]
        r = min(fits, key=lambda r: (used[r], r))
        rows[r].append(i)
        used[r] += lengths[i]
    return rows


def collate(
    ids: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    *,
    pack: bool,
    max_len: int,
    pad_id: int,
    counted: int | None = None,
) -> Batch:
    """The batch of the examples ``ids``/``labels`` (see [Note: packed rows]).

    Args:
        ids: each example's token ids (at most ``max_len`` each).
        labels: each example's labels.
        pack: several examples per row.
        max_len: the longest row when packed.
        pad_id: the token id of padding (its labels are ignored).
        counted: how many of the examples count in ``Batch.examples`` (default all).

    Returns:
        The batch.
    """
    if pack:
        groups = _rows([x.numel() for x in ids], max_len)
        row_ids = [torch.cat([ids[i] for i in g]) for g in groups]
        row_labels = [torch.cat([labels[i] for i in g]) for g in groups]
        row_pos = [torch.cat([torch.arange(ids[i].numel()) for i in g]) for g in groups]
    else:
        row_ids, row_labels = list(ids), list(labels)
        row_pos = [torch.arange(x.numel()) for x in ids]
    length = max(x.numel() for x in row_ids)
    n = len(row_ids)
    input_ids = torch.full((n, length), pad_id, dtype=torch.int64)
    out_labels = torch.full((n, length), IGNORED, dtype=torch.int64)
    position_ids = torch.zeros((n, length), dtype=torch.int64)
    mask = torch.zeros((n, length), dtype=torch.int64)
    for r, (x, y, p) in enumerate(zip(row_ids, row_labels, row_pos, strict=True)):
        k = x.numel()
        input_ids[r, :k], out_labels[r, :k], mask[r, :k] = x, y, 1
        position_ids[r, :k] = p
        position_ids[r, k:] = torch.arange(length - k)  # padding: a segment of its own
    real = int(mask.sum())
    examples = len(ids) if counted is None else counted
    if pack:
        return Batch(input_ids, out_labels, None, position_ids, examples, real)
    return Batch(input_ids, out_labels, mask, None, examples, real)
