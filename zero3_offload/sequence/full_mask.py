"""The attention mask of a whole sequence, as transformers builds it for the model's own
implementation (``masking_utils``): causal, a sliding window, packed rows, padding."""

from __future__ import annotations

import torch

__all__ = ["full_sequence_mask"]


def full_sequence_mask(
    position_ids: torch.Tensor,
    padding: torch.Tensor | None,
    sliding_window: int | None,
    dtype: torch.dtype | None,
) -> torch.Tensor | None:
    """The ``[B, 1, T, T]`` mask of queries (rows) over keys of the whole sequence.

    A query attends to the keys at or before it (within ``sliding_window`` of it when
    given), and only to keys of its own row's segment: with no ``padding`` a row is
    packed where its ``position_ids`` do not go up by one (transformers' rule, applied
    only without a 2D mask); with ``padding`` (``[B, T]``, 0 for a padding token) padding
    keys are left out.

    Args:
        position_ids: ``[B, T]`` positions of the whole sequence.
        padding: the whole sequence's 2D attention mask, or None.
        sliding_window: the layer's window (keys less than this many positions back),
            or None.
        dtype: the float dtype of an additive mask (0 where attended, the dtype's minimum
            elsewhere), as eager attention takes it; None for a boolean mask (True where
            attended), as sdpa takes it, or None when the mask is plain causal (sdpa's
            ``is_causal``).
    """
    batch, length = position_ids.shape
    segments = None
    if padding is None:  # packed rows: where the positions do not go up by one
        first = position_ids[:, :1] - 1
        segments = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        if not bool((segments[:, -1] != 0).any()):
            segments = None
    keys = None if padding is None else padding.to(device=position_ids.device, dtype=torch.bool)
    windowed = sliding_window is not None and length >= sliding_window
    plain = not windowed and segments is None and (keys is None or bool(keys.all()))
    if dtype is None and plain:
        return None  # decided before any [T, T] tensor exists: none at long T
    idx = torch.arange(length, device=position_ids.device)
    allowed = idx[None, :] <= idx[:, None]
    if sliding_window is not None:
        allowed = allowed & (idx[None, :] > idx[:, None] - sliding_window)
    allowed = allowed[None, None].expand(batch, 1, length, length)
    if keys is not None:
        allowed = allowed & keys[:, None, None, :]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    if dtype is None:
        return allowed
    zero = torch.zeros((), device=allowed.device, dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
