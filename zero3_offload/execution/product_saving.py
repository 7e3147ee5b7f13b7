"""Selective activation checkpointing: a recomputed layer that keeps its products' outputs.

[Note: saved products]
With ``activation_checkpointing`` a layer saves only its input for backward,
which reruns the layer's whole forward: about a third more compute. The layers
``selective_checkpointing_units`` picks also save, during the forward, the
outputs of their matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``)
except low-rank ones: those whose output rows are more than ``LOW_RANK`` times
as long as the dimension they contract, such as a LoRA adapter's rank-r
up-projection (r elements summed into each of its many outputs, cheap to
compute again for the bytes it would hold). Their recomputation in backward
takes the saved outputs from the cache instead of computing them again and
reruns only the rest: norms, activations, attention, RoPE, the low-rank
products. This is PyTorch's selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with that
policy. Every value backward uses is the one the forward computed, so the
results are bitwise those of full recomputation. Each saved output's bytes are
counted from the tensor as it is saved, into the pass's saved bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from zero3_offload.errors import ConfigError

__all__ = ["LOW_RANK", "ProductSaving", "saves_product"]

LOW_RANK = 4
"""A product is recomputed, not saved, when its output rows are more than this many
times as long as the dimension it contracts."""

_aten = torch.ops.aten
# product op -> the position of its left operand (its last dimension is contracted,
# the right operand's last dimension is the output rows')
_PRODUCTS = {
    _aten.mm.default: 0,
    _aten.addmm.default: 1,
    _aten.bmm.default: 0,
    _aten.baddbmm.default: 1,
}


def saves_product(op: Any, args: Sequence[Any]) -> bool:
    """Whether a selectively checkpointed layer saves the output of ``op(*args)``: a
    matrix product that is not low-rank (see [Note: saved products])."""
    left = _PRODUCTS.get(op)
    return left is not None and args[left].shape[-1] * LOW_RANK >= args[left + 1].shape[-1]


class ProductSaving:
    """Which checkpointed layers save their matrix products (the last ``count`` of
    them), and the pair of contexts each such layer's forward and recomputation run in.

    Args:
        count: how many checkpointed layers, the last ones, save their products.

    Raises:
        ConfigError: when this torch does not show the policy an op's output.
    """

    def __init__(self, count: int) -> None:
        if "op_output" not in inspect.signature(SelectiveCheckpointContext).parameters:
            raise ConfigError(
                "selective_checkpointing_units needs a torch whose selective checkpointing "
                f"shows the policy each op's output (torch >= 2.6); this is {torch.__version__}"
            )
        self.count = count

    def chosen(self, checkpointed: Sequence[str]) -> frozenset[str]:
        """The layers of ``checkpointed`` (in forward order) that save their products."""
        return frozenset(checkpointed[max(len(checkpointed) - self.count, 0) :])

    def contexts(
        self, record: Callable[[torch.Tensor], None]
    ) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        """A new ``(forward, recomputation)`` pair of contexts sharing one cache: the
        forward's saves the products that are not low-rank, calling ``record`` with each
        output it saves; the recomputation's hands them back."""

        def policy(
            ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
        ) -> CheckpointPolicy:
            if not saves_product(op, args):
                return CheckpointPolicy.PREFER_RECOMPUTE
            if not ctx.is_recompute:
                record(ctx.op_output)
            return CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(policy)
