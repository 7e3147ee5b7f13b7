"""The loss of a whole sequence from one rank's slice of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zero3_offload.sequence.sequence_group import SequenceGroup

__all__ = ["sequence_loss", "whole_sequence_loss"]

IGNORE_INDEX = -100


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The whole sequence's mean token loss from this rank's slice's logits (see
    :func:`whole_sequence_loss`); the slice's cross entropies are computed in fp32."""
    vocab = logits.shape[-1]
    local = F.cross_entropy(
        logits.float().reshape(-1, vocab),
        labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return whole_sequence_loss(local, labels, group)


def whole_sequence_loss(
    local: torch.Tensor, labels: torch.Tensor, group: SequenceGroup
) -> torch.Tensor:
    """The whole sequence's mean token loss, its gradient through this rank's slice only.

    ``local`` is the sum of this rank's slice's per-token cross entropies; ``labels`` the
    slice of the labels already shifted (the label of each position is the next token;
    -100 is ignored), as transformers' causal-LM loss shifts them. The slice's sum and
    its count of valid tokens are summed over the group (one all-reduce): the result is
    ``sum / count`` of the whole sequence on every rank, with the other ranks' sums
    detached.
    """
    totals = torch.stack(
        [local.detach().double(), (labels != IGNORE_INDEX).sum().double().to(local.device)]
    )
    group.all_reduce(totals)
    others = (totals[0] - local.detach().double()).to(local.dtype)
    return (local + others) / totals[1].to(local.dtype)
