"""What a checkpoint records of a peft model, so that ``zero3-offload export`` can write its
adapter directory or its merged model without the model (see [Note: merged saves])."""

from __future__ import annotations

import json
from typing import Any

from torch import nn

__all__ = ["ADAPTER", "base_name", "base_prefix", "lora_modules", "peft_metadata"]

ADAPTER = "default"


def base_prefix(model: nn.Module) -> str:
    """The prefix a peft wrapper puts before its base model's parameter names."""
    base = model.get_base_model()  # type: ignore[operator]
    return next((p + "." for p, m in model.named_modules() if m is base and p), "")


def base_name(name: str, prefix: str) -> str:
    """A peft model's parameter ``name`` in its base model: ``prefix`` and the adapted
    layers' ``.base_layer`` removed."""
    return name.removeprefix(prefix).replace(".base_layer.", ".")


def lora_modules(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per LoRA module (its path in ``model``): ``scaling``, ``fan_in_fan_out``, and
    ``refused``: why its adapter cannot be merged into the base weight (None: it can)."""
    out: dict[str, dict[str, Any]] = {}
    for path, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        adapters = list(module.lora_A.keys())
        base = module.base_layer
        refused = None
        if adapters != [ADAPTER]:
            refused = f"adapters {adapters}: a merge takes one adapter named {ADAPTER!r}"
        elif getattr(module, "use_dora", {}).get(ADAPTER, False):
            refused = "DoRA adapters cannot be merged here"
        elif getattr(module, "lora_bias", {}).get(ADAPTER, False):
            refused = "LoRA biases cannot be merged here"
        elif not isinstance(base, nn.Linear) and type(base).__name__ != "Conv1D":
            refused = f"only adapters of linear layers can be merged, not of {type(base).__name__}"
        out[path] = {
            "scaling": float(module.scaling[ADAPTER]) if ADAPTER in module.scaling else 0.0,
            "fan_in_fan_out": bool(getattr(module, "fan_in_fan_out", False)),
            "refused": refused,
        }
    return out


def peft_metadata(model: object) -> dict[str, Any] | None:
    """A peft model's adapter config (JSON-safe), the base model's name prefix, and its
    :func:`lora_modules`; None for any other model."""
    configs = getattr(model, "peft_config", None)
    base_of = getattr(model, "get_base_model", None)
    if not isinstance(model, nn.Module) or not isinstance(configs, dict) or not callable(base_of):
        return None
    config = configs.get(ADAPTER)
    return {
        "prefix": base_prefix(model),
        "adapter_config": None if config is None else json.loads(json.dumps(
            config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)
        )),
        "modules": lora_modules(model),
    }  # fmt: skip
