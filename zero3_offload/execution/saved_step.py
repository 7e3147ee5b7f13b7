"""What a chain-mode training forward saves for the backward of one layer use.

See [Note: saved activations] and [Note: backward by recomputation] in
``execution.layer_runner``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

__all__ = ["RngState", "SavedStep"]


@attrs.frozen
class RngState:
    """The generator states a layer's forward ran with (for its recomputation)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


@attrs.define
class SavedStep:
    """What backward needs from one layer's forward.

    ``inp`` is the layer input (detached; with saved activations a leaf that
    requires grad when floating), or None when it was offloaded: ``stored`` then stands
    for it (see [Note: activation offload] in ``execution.activation_offload``).
    ``out`` is the output with its graph (saved activations) or None (recomputation,
    then ``rng`` is set, and ``products`` when the layer saved its products).
    """

    inp: torch.Tensor | None
    out: torch.Tensor | None
    rng: RngState | None
    saved: dict[int, int]  # storage pointer -> bytes, of what this step saves for backward
    # the recomputation's context that hands back the products the forward saved
    # (see [Note: saved products] in ``execution.product_saving``), or None
    products: AbstractContextManager[Any] | None = None
    stored: object = None  # the offloaded input's stand-in (``inp`` is None then)
