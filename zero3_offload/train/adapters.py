"""The peft config of a ``zero3-offload train`` run: from ``--lora`` or ``--peft-config``.

``--peft-config FILE`` reads a LoRA adapter config as peft's ``save_pretrained`` writes
it (``adapter_config.json``, or a directory holding one): its ``peft_type`` must be
``LORA``, and without a ``task_type`` the adapters are those of a causal LM.
``base_model_name_or_path`` in the file is ignored: the base is ``--model``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zero3_offload.train.options import TrainOptions
from zero3_offload.train.sources import OptionError

__all__ = ["peft_config_of", "read_peft_config"]

_CONFIG_FILE = "adapter_config.json"


def read_peft_config(path: str) -> Any:
    """The ``peft.LoraConfig`` of the file (or directory) ``path``.

    Raises:
        OptionError: ``--peft-config PATH: ...`` for a missing or unreadable file, JSON
            that is not a LoRA config, a key peft does not know, or peft not installed.
    """
    file = Path(path)
    if file.is_dir():
        file = file / _CONFIG_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise OptionError(f"--peft-config {path}: cannot read {file}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OptionError(f"--peft-config {path}: {file} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OptionError(f"--peft-config {path}: expected a JSON object of LoraConfig fields")
    kind = data.get("peft_type", "LORA")
    if kind != "LORA":
        raise OptionError(
            f"--peft-config {path}: peft_type {kind!r}: zero3-offload train takes LoRA "
            "adapters (peft_type LORA)"
        )
    try:
        from peft import LoraConfig
    except ImportError:
        raise OptionError(
            f"--peft-config {path}: needs peft: pip install 'zero3_offload[hf]'"
        ) from None
    fields = {k: v for k, v in data.items() if k not in ("peft_type", "base_model_name_or_path")}
    fields.setdefault("task_type", "CAUSAL_LM")
    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"--peft-config {path}: not a LoraConfig: {exc}") from None


def peft_config_of(opts: TrainOptions) -> Any | None:
    """The peft config of ``--lora`` or ``--peft-config``; None without adapters.

    Raises:
        OptionError: as :func:`read_peft_config`.
        ConfigError: ``--lora`` without peft installed.
    """
    if opts.lora is not None:
        return opts.lora.to_peft()
    if opts.peft_config is not None:
        return read_peft_config(opts.peft_config)
    return None
