"""Merging LoRA adapters into their base weights, by name (see [Note: merged saves])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zero3_offload.errors import InputError
from zero3_offload.integrations.peft_metadata import ADAPTER, base_name

__all__ = ["LoraMerge"]


class LoraMerge:
    """Turns a peft model's parameters (by its names) into the base model's, merged.

    Args:
        prefix: the peft wrapper's prefix of the base model's names.
        modules: :func:`~zero3_offload.integrations.peft_metadata.lora_modules` of the model.

    Raises:
        InputError: when an adapter cannot be merged (naming the module and why).
    """

    def __init__(self, *, prefix: str, modules: Mapping[str, Mapping[str, Any]]) -> None:
        refused = {path: m["refused"] for path, m in modules.items() if m["refused"]}
        if refused:
            path, why = next(iter(refused.items()))
            raise InputError(f"{path}: {why} ({len(refused)} such modules)")
        self._prefix = prefix
        self._modules = modules

    def is_adapter(self, name: str) -> bool:
        return ".lora_" in name

    def base_name(self, name: str) -> str:
        """``name`` in the base model: the prefix and ``.base_layer`` removed."""
        return base_name(name, self._prefix)

    def adapter_of(self, name: str) -> str | None:
        """The LoRA module whose base weight ``name`` is (None: not an adapted weight)."""
        path, _, leaf = name.rpartition(".")
        owner = path.removesuffix(".base_layer")
        if leaf == "weight" and path.endswith(".base_layer") and owner in self._modules:
            return owner
        return None

    def merge(
        self, owner: str, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        """``weight + scaling * B @ A`` (transposed for ``fan_in_fan_out``), as peft merges."""
        module = self._modules[owner]
        delta = b.float() @ a.float()
        if module["fan_in_fan_out"]:
            delta = delta.T
        return weight + delta * module["scaling"]

    def merged(self, values: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The base model's ``(name, value)`` for a unit's ``values`` (peft names)."""
        out = []
        for name, tensor in values.items():
            if self.is_adapter(name):
                continue
            owner = self.adapter_of(name)
            if owner is not None:
                a = values[f"{owner}.lora_A.{ADAPTER}.weight"]
                b = values[f"{owner}.lora_B.{ADAPTER}.weight"]
                tensor = self.merge(owner, tensor, a, b)
            out.append((self.base_name(name), tensor))
        return out
