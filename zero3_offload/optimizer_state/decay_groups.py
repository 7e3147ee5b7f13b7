"""HF Trainer's default weight-decay split as torch parameter groups, without transformers.

transformers' ``Trainer.get_decay_parameter_names`` decays every parameter except
those of ``nn.LayerNorm`` modules and those whose lower-cased full name matches
``bias``, ``layernorm``, ``rmsnorm``, ``(^|.)norm($|.)`` or ``_norm($|.)`` (so RMSNorm
weights such as Llama's ``input_layernorm.weight`` and ``model.norm.weight`` are not
decayed). :func:`decay_param_groups` gives the same split, as the parameter groups
``Zero3CpuOffloadManager(..., param_groups=...)`` takes.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["decay_param_groups", "decay_parameter_names"]

_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_NO_DECAY = tuple(re.compile(p) for p in _PATTERNS)


def _names(module: nn.Module) -> list[str]:
    """transformers' ``get_parameter_names(module, [nn.LayerNorm], patterns)``: children
    first (their parameters with the child's name in front), then the module's own."""
    out = []
    for child_name, child in module.named_children():
        for name in _names(child):
            full = f"{child_name}.{name}"
            if not isinstance(child, nn.LayerNorm) and not any(
                p.search(full.lower()) for p in _NO_DECAY
            ):
                out.append(full)
    out += [k for k in module._parameters if not any(p.search(k.lower()) for p in _NO_DECAY)]
    return out


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names (as in ``model.named_parameters()``) of the parameters HF Trainer decays."""
    named = dict(model.named_parameters())
    return [name for name in _names(model) if name in named]


def decay_param_groups(model: nn.Module, weight_decay: float | None = None) -> list[dict[str, Any]]:
    """Two parameter groups by name: the decayed ones (with ``weight_decay``, or the
    config's when None), the others (biases, norm weights) with weight decay 0. Frozen
    parameters are left out."""
    decay = set(decay_parameter_names(model))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    decayed: dict[str, Any] = {"params": [n for n in names if n in decay]}
    if weight_decay is not None:
        decayed["weight_decay"] = weight_decay
    return [decayed, {"params": [n for n in names if n not in decay], "weight_decay": 0.0}]
