"""Cutting a batch's sequences into this rank's slice (sequence parallelism)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zero3_offload.errors import InputError
from zero3_offload.sequence.loss import IGNORE_INDEX
from zero3_offload.sequence.sequence_batch import SequenceBatch
from zero3_offload.sequence.sequence_group import SequenceGroup

__all__ = ["SEQUENCE_KWARG", "split_sequence"]

# The keyword argument that carries the whole sequence (a SequenceBatch) down to attention.
SEQUENCE_KWARG = "zero3_sequence"
# Inputs of the whole sequence that cannot be cut (or mean nothing for a slice).
_REFUSED = ("inputs_embeds", "cache", "past_key_values", "cache_position")
# Below 2**20: a fingerprint's square summed over the group is exact in float64.
_FINGERPRINT_MODULUS = 1_000_003


def split_sequence(
    kwargs: dict[str, Any],
    *,
    rank: int,
    size: int,
    group: SequenceGroup,
    implementation: str,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """This rank's slice of a batch of whole sequences, and its slice of the shifted labels.

    ``input_ids`` (``[B, T]``) and ``position_ids`` (``[B or 1, T]``; ``0..T-1`` when not
    given, as transformers' decoders count them) are cut into S equal slices along the
    sequence, this rank keeping slice ``rank``. ``labels`` are shifted first (position i
    predicts token i+1; the last position -100), so the last token of one slice
    predicts the first of the next; they are not passed to the model. A length S does
    not divide is padded at the end up to a multiple of S (token 0, positions going on,
    labels -100, padding-mask 0): causal attention keeps the real tokens from seeing
    the padding, so nothing changes for them. ``attention_mask`` (the 2D padding mask)
    stays whole, with the position ids, in the :class:`SequenceBatch` passed under
    ``SEQUENCE_KWARG``. The KV cache is off.

    Raises:
        InputError: without ``input_ids`` as a 2D tensor; for ``inputs_embeds``, a cache, a
            4D ``attention_mask``, or inputs whose shapes differ from ``input_ids``'.
    """
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InputError(
            "sequence_parallel_size > 1 needs input_ids=, a [batch, sequence] tensor, as a "
            "keyword argument of forward: the manager cuts it into each rank's slice"
        )
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise InputError(
                f"{name}= is not supported with sequence_parallel_size > 1: pass input_ids "
                "(and position_ids, attention_mask, labels) of the whole sequence"
            )
    batch, length = ids.shape
    labels = _whole(kwargs.pop("labels", None), "labels", batch, length)
    padding = _whole(kwargs.pop("attention_mask", None), "attention_mask", batch, length)
    positions = kwargs.pop("position_ids", None)
    if positions is None:
        positions = torch.arange(length, device=ids.device)[None]
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == 1:
        positions = positions.expand(batch, -1)  # one row of positions for every row
    positions = _whole(positions, "position_ids", batch, length)
    assert positions is not None  # given or made above
    shifted = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    pad = -length % size
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        steps = torch.arange(1, pad + 1, device=positions.device)
        positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
        shifted = None if shifted is None else F.pad(shifted, (0, pad), value=IGNORE_INDEX)
        if padding is not None:  # any dtype (bool included): zeros are padding
            padding = torch.cat([padding, padding.new_zeros(batch, pad)], dim=1)
    part = (length + pad) // size
    cut = slice(rank * part, (rank + 1) * part)
    kwargs.update(
        input_ids=ids[:, cut],
        position_ids=positions[:, cut],
        use_cache=False,
        **{
            SEQUENCE_KWARG: SequenceBatch(
                group=group,
                size=size,
                implementation=implementation,
                position_ids=positions,
                padding=padding,
                fingerprint=_fingerprint(ids, shifted, positions, padding),
            )
        },
    )
    return kwargs, None if shifted is None else shifted[:, cut]


def _whole(value: object, name: str, batch: int, length: int) -> torch.Tensor | None:
    """``value`` checked to be a ``[batch, length]`` tensor (or None)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch, length):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InputError(
            f"{name} must be a [batch, sequence] tensor like input_ids {(batch, length)} "
            f"with sequence_parallel_size > 1, got {shape}"
        )
    return value


def _fingerprint(*tensors: torch.Tensor | None) -> int:
    """An order-sensitive digest of ``tensors``' values, in ``[0, 2**20)``."""
    digest = 0
    for t in tensors:
        if t is None:
            continue
        flat = t.reshape(-1).long()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device)
        digest = (digest * 31 + int((flat * weights).sum())) % _FINGERPRINT_MODULUS
    return digest
