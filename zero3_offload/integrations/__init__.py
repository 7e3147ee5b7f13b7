"""Optional adapters for third-party libraries; importing this package does not import them.

Each module imports its library (e.g. ``transformers``) only when one of its functions is
called. The framework classes are taken from here, each importing its framework on first
use: ``Zero3Trainer`` (transformers), ``Zero3TrainerMixin`` (nothing until it is used on a
Trainer), ``Zero3Strategy`` (Lightning) and ``config_from_deepspeed``; they live in
``zero3_offload.frameworks``, above the manager (docs/integrations.md).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Zero3Strategy", "Zero3Trainer", "Zero3TrainerMixin", "config_from_deepspeed"]

# Named by string: the framework modules sit above the manager, which imports this package.
_WHERE = {
    "Zero3Trainer": "zero3_offload.frameworks.trainer",
    "Zero3TrainerMixin": "zero3_offload.frameworks.trainer_mixin",
    "Zero3Strategy": "zero3_offload.frameworks.lightning_strategy",
    "config_from_deepspeed": "zero3_offload.frameworks.trainer_settings",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
