"""A peft model over a transformers directory, each rank reading its slices of the base.

[Note: peft from pretrained]
``from_pretrained(config, pg, path, peft_config=LoraConfig(...))`` builds the base
model on the meta device (see ``integrations.pretrained_load``) and wraps it with
``peft.get_peft_model``. The base weights are frozen, so they form the units' frozen
parts: each rank reads only its slices of them from the safetensors files, straight
into its stored copies (under the base model's names: the peft wrapper's prefix and
``.base_layer`` removed). The adapters are small and not in the files: every rank
materialises them on the CPU and initialises them as peft does
(``reset_lora_parameters`` of each adapted module, in module order, after
``torch.manual_seed(seed)``), so every rank holds the same values and takes its
slices of them. With the same seed, ``get_peft_model`` of the loaded model draws the
same adapter values.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zero3_offload.errors import CheckpointError, ConfigError
from zero3_offload.integrations.peft_metadata import base_name, base_prefix
from zero3_offload.integrations.pretrained_load import PretrainedShards
from zero3_offload.parameter.flat_layout import LayerLayout, param_key

__all__ = ["PeftPretrainedShards", "reset_adapters"]


class PeftPretrainedShards:
    """The peft model of ``peft_config`` over the meta model of ``directory``; pass
    :meth:`shard` as the manager's ``shard_source``. A context manager (closes the files).

    Args:
        directory: a local transformers model directory.
        peft_config: a peft config (e.g. ``LoraConfig``).
        seed: the seed the adapters are initialised from.

    Raises:
        ConfigError: when peft is not installed.
        CheckpointError: as :class:`PretrainedShards`.
    """

    def __init__(self, directory: str | os.PathLike[str], peft_config: Any, *, seed: int) -> None:
        try:
            from peft import get_peft_model
        except ImportError as exc:
            raise ConfigError("peft_config needs peft: pip install 'zero3_offload[hf]'") from exc
        self._base = PretrainedShards(directory)
        self.model: nn.Module = get_peft_model(self._base.model, peft_config)
        self._prefix = base_prefix(self.model)
        self._adapters: dict[str, torch.Tensor] = {}  # peft name -> materialised value
        self._init_adapters(seed)

    @property
    def bytes_read(self) -> int:
        return self._base.bytes_read

    def _init_adapters(self, seed: int) -> None:
        reset_adapters(self.model, seed)
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                if param.is_meta:
                    raise CheckpointError(
                        f"{name} is trainable but neither in the weight files nor an adapter "
                        "this loader initialises"
                    )
                self._adapters[name] = param.detach()

    def shard(self, layer: str, layout: LayerLayout) -> torch.Tensor:
        """This rank's fp32 shard of ``layer``'s trainable or frozen part: adapters from
        their materialised values, base weights read from the files."""
        out = torch.zeros(layout.shard_numel, dtype=torch.float32)
        files = [s for s in layout.slots if param_key(layer, s.name) not in self._adapters]
        if files:
            renamed = {s.name: base_name(param_key(layer, s.name), self._prefix) for s in files}
            self._base.shard_of(layer, layout, names=renamed, out=out)
        for slot in layout.slots:
            value = self._adapters.get(param_key(layer, slot.name))
            if value is None:
                continue
            lo, hi = layout.owned_span(slot)
            if lo < hi:
                piece = value.reshape(-1)[lo - slot.offset : hi - slot.offset]
                out[lo - layout.shard_start : hi - layout.shard_start] = piece
        return out

    def close(self) -> None:
        self._base.close()

    def __enter__(self) -> PeftPretrainedShards:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def reset_adapters(model: nn.Module, seed: int) -> None:
    """Materialise (on the CPU, where on meta) and initialise every LoRA adapter of
    ``model`` as peft does, module by module in ``named_modules()`` order after
    ``torch.manual_seed(seed)``: the adapter values of [Note: peft from pretrained]."""
    torch.manual_seed(seed)
    config = getattr(model, "peft_config", {})
    for _, module in model.named_modules():
        reset = getattr(module, "reset_lora_parameters", None)
        if not callable(reset) or not hasattr(module, "lora_A"):
            continue
        for adapter in list(module.lora_A.keys()):
            for holder in (module.lora_A[adapter], module.lora_B[adapter]):
                if any(p.is_meta for p in holder.parameters()):
                    holder.to_empty(device="cpu")
            with torch.no_grad():
                reset(adapter, getattr(config.get(adapter), "init_lora_weights", True))
