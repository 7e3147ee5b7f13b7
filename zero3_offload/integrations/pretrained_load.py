"""Loading a local transformers model directory into a manager, each rank reading its slices.

The model is built from ``config.json`` with its parameters on the meta device
(buffers such as rotary ``inv_freq`` real, tied weights tied; see
``integrations.meta_model``). Then, unit by unit, each rank reads from the
safetensors files only the elements of its own shard of the unit's flat
buffer (see ``integrations.pretrained_weights``): no rank ever holds a full
copy of the weights, nor of a unit.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from zero3_offload.errors import CheckpointError
from zero3_offload.integrations.meta_model import build_model_from_directory
from zero3_offload.integrations.pretrained_weights import PretrainedWeights
from zero3_offload.parameter.flat_layout import LayerLayout, param_key

__all__ = ["PretrainedShards"]


class PretrainedShards:
    """A model built on meta from a transformers directory, and its weights read by shard.

    Use as a context manager (the weight files are closed at exit); pass
    :meth:`shard` as the manager's ``shard_source``.

    Args:
        directory: a local transformers model directory (``config.json`` and
            ``model.safetensors`` or ``model.safetensors.index.json`` + shards).

    Raises:
        CheckpointError: for a missing or hostile directory or weight file.
        ConfigError: when transformers is not installed or cannot build the config.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.model: nn.Module = build_model_from_directory(directory, on_meta=True)
        self.weights = PretrainedWeights(directory)
        self.directory = directory
        self.bytes_read = 0  # fp32 bytes of the slices this rank read

    def shard(self, layer: str, layout: LayerLayout) -> torch.Tensor:
        """This rank's fp32 shard of ``layer``'s flat buffer, read from the weight files.

        Raises:
            CheckpointError: when a parameter is missing from the files or has another shape.
        """
        return self.shard_of(layer, layout)

    def shard_of(
        self,
        layer: str,
        layout: LayerLayout,
        *,
        names: dict[str, str] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`shard`, with ``names`` (slot name -> name in the files) for the slots
        to read: the others are left as they are (zero in a new shard); None reads every
        slot under its own name. ``out``: the fp32 shard to read into (``shard_numel``
        elements), instead of a new one; each slice is read straight into its place.

        Raises:
            CheckpointError: when a parameter is missing from the files or has another shape.
        """
        if out is None:
            out = torch.zeros(layout.shard_numel, dtype=torch.float32)
        for slot in layout.slots:
            if names is not None and slot.name not in names:
                continue
            lo, hi = layout.owned_span(slot)
            name = names[slot.name] if names is not None else param_key(layer, slot.name)
            if name not in self.weights:
                raise CheckpointError(
                    f"{name} is missing from the weights of {self.directory}: the directory "
                    "does not hold this model's parameters"
                )
            if tuple(self.weights.shape(name)) != tuple(slot.shape):
                raise CheckpointError(
                    f"{name} has shape {self.weights.shape(name)} in {self.directory} but "
                    f"{tuple(slot.shape)} in the model built from its config.json"
                )
            if lo >= hi:
                continue
            place = out[lo - layout.shard_start : hi - layout.shard_start]
            self.weights.read_flat(name, lo - slot.offset, hi - slot.offset, out=place)
            self.bytes_read += place.numel() * place.element_size()
        return out

    def close(self) -> None:
        self.weights.close()

    def __enter__(self) -> PretrainedShards:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
