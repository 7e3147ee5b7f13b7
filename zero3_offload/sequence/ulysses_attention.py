"""Ulysses attention: the model's own attention implementation over the whole sequence,
between two all-to-alls (see [Note: sequence parallelism])."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zero3_offload.errors import InputError, StateError
from zero3_offload.sequence.all_to_all import heads_to_sequence, sequence_to_heads
from zero3_offload.sequence.head_view import HeadView
from zero3_offload.sequence.input_split import SEQUENCE_KWARG
from zero3_offload.sequence.sequence_batch import SequenceBatch

__all__ = ["ULYSSES", "register_ulysses", "ulysses_attention"]

# The name the wrapper is registered under in transformers' AttentionInterface.
ULYSSES = "zero3_ulysses"


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' interface for a sequence-parallel forward.

    ``query``, ``key`` and ``value`` (``[B, heads, T/S, D]``) hold this rank's slice of
    the sequence. They are exchanged for H/S heads of the whole sequence (key/value heads
    fewer than S are replicated first: each rank gets one), the model's
    implementation (its module's ``eager_attention_forward``, or transformers' sdpa)
    runs on them with the whole sequence's mask (the model's local ``attention_mask``
    is not used: the model builds none for this implementation), and the output is
    exchanged back: ``[B, T/S, heads, D]``, as the model expects. Attention weights are
    not returned.

    Raises:
        StateError: when called without the whole sequence (outside a sequence-parallel
            ``manager.forward``).
        InputError: when the ranks of the group passed different batches (checked at the
            forward's first attention), or S does not divide the heads, or neither divides
            nor is a multiple of the key/value heads.
    """
    batch = kwargs.pop(SEQUENCE_KWARG, None)
    if not isinstance(batch, SequenceBatch):
        raise StateError(
            f"the model's attention is set to {ULYSSES!r} (sequence_parallel_size > 1): run "
            "it through `await manager.forward(...)`, which passes the whole sequence"
        )
    batch.check_same_batch()  # before the first exchange of the forward
    size = batch.size
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size or (kv_heads % size and size % kv_heads):
        raise InputError(
            f"{type(module).__name__} has {heads} attention heads and {kv_heads} key/value "
            f"heads: sequence_parallel_size={size} must divide the heads, and divide or be a "
            "multiple of the key/value heads (each rank attends with heads/S of them over "
            "the whole sequence)"
        )
    seen: nn.Module | HeadView = module
    if kv_heads < size:  # each key/value head replicated over size/kv_heads ranks
        key = key.repeat_interleave(size // kv_heads, dim=1)
        value = value.repeat_interleave(size // kv_heads, dim=1)
        seen = HeadView(module, groups=heads // size)
    q, k, v = sequence_to_heads([query, key, value], batch.group, size)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    eager = batch.implementation == "eager"
    mask = batch.mask(window, q.dtype if eager else None)
    out, _ = _implementation(module, batch.implementation)(seen, q, k, v, mask, **kwargs)
    return heads_to_sequence(out, batch.group, size), None


def _implementation(module: nn.Module, name: str) -> Callable[..., Any]:
    """The model's attention function ``name``: its module's eager function, or sdpa."""
    if name == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise InputError(
                f"{type(module).__name__} has no eager_attention_forward in its module: "
                "set the model's attention to 'sdpa' for sequence parallelism"
            )
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def register_ulysses() -> None:
    """Register :func:`ulysses_attention` in transformers' AttentionInterface as ``ULYSSES``
    (no attention mask is registered for it: models then build none)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ULYSSES not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ULYSSES, ulysses_attention)
