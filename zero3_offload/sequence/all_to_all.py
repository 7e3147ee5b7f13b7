"""The differentiable all-to-all of Ulysses attention, and the two layouts it moves between.

A tensor laid out ``[S, ...]`` sends its i-th part to rank i of the group and receives
rank i's part for it in place i. That exchange is its own transpose, so its backward
is the same exchange of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from zero3_offload.sequence.sequence_group import SequenceGroup

__all__ = ["AllToAll", "heads_to_sequence", "sequence_to_heads"]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` of a ``[S, ...]`` tensor; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    group.all_to_all(out, x)
    return out


def sequence_to_heads(
    tensors: list[torch.Tensor], group: SequenceGroup, size: int
) -> list[torch.Tensor]:
    """Sequence-sharded ``[B, heads, T/S, D]`` tensors -> head-sharded ``[B, heads/S, T, D]``.

    Tensors of one head dimension travel in one exchange (queries, keys and values
    together); each one's heads must be divisible by ``size``.
    """
    b, _, t, d = tensors[0].shape
    if any(x.shape[0] != b or x.shape[2] != t or x.shape[3] != d for x in tensors):
        return [y for x in tensors for y in sequence_to_heads([x], group, size)]
    counts = [x.shape[1] // size for x in tensors]
    parts = [x.reshape(b, size, c, t, d) for x, c in zip(tensors, counts, strict=True)]
    send = torch.cat(parts, dim=2).transpose(0, 1)  # [S (head group), B, heads/S, T/S, D]
    got = AllToAll.apply(send, group)  # [S (sequence slice), B, heads/S, T/S, D]
    whole = got.permute(1, 2, 0, 3, 4).reshape(b, sum(counts), size * t, d)
    return list(whole.split(counts, dim=1))


def heads_to_sequence(x: torch.Tensor, group: SequenceGroup, size: int) -> torch.Tensor:
    """An attention output ``[B, T, heads/S, D]`` (head-sharded, whole sequence) -> this
    rank's slice of the sequence with every head, ``[B, T/S, heads, D]``."""
    b, whole, h, d = x.shape
    t = whole // size
    send = x.reshape(b, size, t, h, d).transpose(0, 1)  # [S (sequence slice), B, T/S, h, D]
    got = AllToAll.apply(send, group)  # [S (head group), B, T/S, h, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, t, size * h, d)
