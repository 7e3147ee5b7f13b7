"""Importing optional third-party libraries with an actionable error when they are missing."""

from __future__ import annotations

import importlib
import types

from zero3_offload.errors import ConfigError

__all__ = ["require_module", "require_transformers"]


def require_transformers() -> types.ModuleType:
    """Import and return the ``transformers`` module.

    Returns:
        The imported ``transformers`` package.

    Raises:
        ConfigError: when ``transformers`` cannot be imported; the message says how to
            install it. The import error is chained.
    """
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ConfigError(
            "this feature needs the transformers library, which could not be imported "
            f"({exc}); install it with: pip install 'zero3_offload[hf]'"
        ) from exc


def require_module(name: str, feature: str) -> types.ModuleType:
    """Import and return the module ``name`` of the ``hf`` extra (``datasets``, ``pyarrow``).

    Args:
        name: the module to import.
        feature: what needs it, for the message (e.g. ``"reading data.parquet"``).

    Returns:
        The imported module.

    Raises:
        ConfigError: when ``name`` cannot be imported; the message names ``feature`` and
            says how to install it. The import error is chained.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(
            f"{feature} needs the {name} library, which could not be imported ({exc}); "
            "install it with: pip install 'zero3_offload[hf]'"
        ) from exc
