"""The full values of a LoRA peft model with its adapters merged into the base weights.

[Note: merged saves]
``save_pretrained(directory, merged=True)`` of a LoRA model writes the base model's
transformers directory with ``W + scaling * B @ A`` in place of every adapted weight
(transposed for ``fan_in_fan_out`` layers such as GPT-2's ``Conv1D``), as peft's
``merge_and_unload()`` computes it, under the base model's names. It streams like
any pretrained save: units are gathered one at a time and each unit's weights are
merged as they arrive, so no rank ever holds more than a unit. Adapters other than
plain LoRA on linear layers (DoRA, LoRA biases, embedding adapters, several active
adapters) are refused, naming the module.
"""

from __future__ import annotations

import torch
from torch import nn

from zero3_offload.checkpoint.full_state import FullState
from zero3_offload.errors import InputError
from zero3_offload.integrations.lora_merge import LoraMerge
from zero3_offload.integrations.peft_metadata import peft_metadata

__all__ = ["MergedLoraState"]


class MergedLoraState:
    """Per unit, the merged full values of ``model`` (a LoRA peft model) under the base
    model's parameter names; the interface ``pretrained_save.save_pretrained`` reads.

    Args:
        model: the peft model (its modules give each adapter's scaling and layout).
        full_state: the gathered full values, by the peft model's names.

    Raises:
        InputError: for an adapter this cannot merge (see [Note: merged saves]).
    """

    def __init__(self, *, model: nn.Module, full_state: FullState) -> None:
        self._full = full_state
        meta = peft_metadata(model)
        if meta is None:
            raise InputError(f"{type(model).__name__} is not a peft model: it has no adapters")
        self._merge = LoraMerge(prefix=meta["prefix"], modules=meta["modules"])

    def layers(self) -> list[str]:
        return self._full.layers()

    async def layer(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """``(base model name, fp32 CPU tensor)`` of unit ``name``, adapters merged (a
        collective)."""
        return self._merge.merged(dict(await self._full.layer(name)))
