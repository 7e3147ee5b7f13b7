"""Optional adapters for third-party libraries; importing this package does not import them.

Each module imports its library (e.g. ``transformers``) only when one of its functions is
called, or its class is taken from here: ``Zero3Trainer`` (transformers),
``Zero3TrainerMixin`` (none until used on a Trainer), ``Zero3Strategy`` (Lightning). See
docs/integrations.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Zero3Strategy", "Zero3Trainer", "Zero3TrainerMixin", "config_from_deepspeed"]

_WHERE = {
    "Zero3Trainer": "zero3_offload.integrations.trainer",
    "Zero3TrainerMixin": "zero3_offload.integrations.trainer_mixin",
    "Zero3Strategy": "zero3_offload.integrations.lightning_strategy",
    "config_from_deepspeed": "zero3_offload.integrations.trainer_settings",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
