"""Byte counts of real tensors: every byte figure the library reports comes from here."""

from __future__ import annotations

import torch

__all__ = ["storage_bytes", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes held by ``t``'s elements (``numel() * element_size()``); 0 for None."""
    return 0 if t is None else t.numel() * t.element_size()


def storage_bytes(t: torch.Tensor) -> dict[int, int]:
    """``{storage pointer: bytes}`` of ``t``'s whole storage ({} for sparse or meta tensors).

    Keyed by pointer so that views of one storage are counted once when merged.
    """
    if t.is_sparse or t.device.type == "meta":
        return {}
    storage = t.untyped_storage()
    return {storage.data_ptr(): storage.nbytes()}
