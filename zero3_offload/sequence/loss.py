"""The loss of a whole sequence from one rank's slice of it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["sequence_loss"]

IGNORE_INDEX = -100


def sequence_loss(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The whole sequence's mean token loss, its gradient through this rank's slice only.

    ``labels`` are this rank's slice of the labels already shifted (the label of each
    position is the next token; -100 is ignored), as transformers' causal-LM loss shifts
    them. The slice's sum of cross entropies (logits in fp32) and its count of valid
    tokens are summed over the group (one all-reduce): the result is ``sum / count`` of
    the whole sequence on every rank, with the other ranks' sums detached.
    """
    vocab = logits.shape[-1]
    local = F.cross_entropy(
        logits.float().reshape(-1, vocab),
        labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    totals = torch.stack(
        [local.detach().double(), (labels != IGNORE_INDEX).sum().double().to(local.device)]
    )
    dist.all_reduce(totals, group=group)
    others = (totals[0] - local.detach().double()).to(local.dtype)
    return (local + others) / totals[1].to(local.dtype)
