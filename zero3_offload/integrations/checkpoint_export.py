"""Exporting a sharded checkpoint as a transformers model directory, parameter by parameter.

A checkpoint saved by a module-mode manager whose model is a transformers model
records the model's config (``model_config`` in its metadata). Export rebuilds
that config, then streams every parameter, assembled from the slices of the
rank files that hold it (see ``checkpoint.consolidate``), into
``integrations.pretrained_writer``: memory stays near one weight file's worth.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from zero3_offload.checkpoint.consolidate import iter_full_parameters
from zero3_offload.checkpoint.format import read_metadata, resolve_checkpoint
from zero3_offload.errors import CheckpointError, ConfigError, InputError
from zero3_offload.integrations.lora_merge import LoraMerge
from zero3_offload.integrations.peft_metadata import ADAPTER
from zero3_offload.integrations.pretrained_writer import write_pretrained
from zero3_offload.integrations.require import require_transformers

__all__ = ["export_checkpoint"]


def _config(meta: dict[str, Any], config_dir: str | os.PathLike[str] | None) -> Any:
    transformers = require_transformers()
    if config_dir is not None:
        return transformers.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    saved = meta.get("model_config")
    if not isinstance(saved, dict) or not isinstance(saved.get("model_type"), str):
        raise CheckpointError(
            "this checkpoint records no transformers model config (it was saved from another "
            "kind of model, or by an older version): pass the directory of the model's "
            "config.json as --config"
        )
    fields = {k: v for k, v in saved.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(saved["model_type"], **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot rebuild the model config of the checkpoint: {exc}") from exc


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    config_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    merged: bool = False,
) -> list[Path]:
    """Write the checkpoint at ``checkpoint`` as a transformers directory at ``directory``.

    ``AutoModelForCausalLM.from_pretrained(directory)`` loads the result as is. A
    checkpoint of a peft model is written as its adapter directory (what
    ``PeftModel.from_pretrained`` loads), or with ``merged`` as its base model with the
    LoRA adapters merged (see [Note: merged saves]).

    Args:
        checkpoint: a checkpoint directory, or a root whose ``latest`` names one.
        directory: the target (must not exist or be empty).
        config_dir: a directory with the model's ``config.json``, for checkpoints
            that do not record it.
        max_shard_bytes: largest weight file.
        dtype: dtype of the stored weights.
        progress: ``progress(done, total)`` after each parameter.

    Returns:
        The files written.

    Raises:
        CheckpointError: for an unreadable checkpoint or a failed write.
        ConfigError: when transformers is missing or the config cannot be rebuilt.
    """
    meta = read_metadata(resolve_checkpoint(checkpoint))
    peft = meta.get("peft")
    if peft is not None and not _peft_record(peft):
        raise CheckpointError("the checkpoint's peft record is malformed; refusing to export it")
    if merged and not isinstance(peft, dict):
        raise InputError("--merged applies to checkpoints of peft models: this one has no adapters")
    params = list(iter_full_parameters(checkpoint))
    if isinstance(peft, dict) and not merged:
        return [_write_adapter(Path(directory), peft, params, dtype)]
    config = _config(meta, config_dir)
    merge = None if not merged else LoraMerge(prefix=peft["prefix"], modules=peft["modules"])
    loads = {name: load for name, _, load in params}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, _, load) in enumerate(params):
            if merge is None:
                yield name, load()
            elif not merge.is_adapter(name):
                owner, value = merge.adapter_of(name), load()
                if owner is not None:
                    a = loads[f"{owner}.lora_A.{ADAPTER}.weight"]()
                    b = loads[f"{owner}.lora_B.{ADAPTER}.weight"]()
                    value = merge.merge(owner, value, a, b)
                yield merge.base_name(name), value
            if progress is not None:
                progress(i + 1, len(params))

    return write_pretrained(
        directory, config, tensors(), max_shard_bytes=max_shard_bytes, dtype=dtype
    )


def _write_adapter(
    target: Path,
    peft: dict[str, Any],
    params: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]],
    dtype: torch.dtype,
) -> Path:
    """The adapter directory of a peft checkpoint: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (the adapter's tensors, named as peft names them)."""
    from safetensors.torch import save_file

    if peft.get("adapter_config") is None:
        raise CheckpointError("the checkpoint records no adapter config named 'default'")
    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} is not empty: export writes a new directory")
    tensors = {
        name.replace(f".{ADAPTER}.", "."): load().to(dtype).contiguous()
        for name, _, load in params
        if ".lora_" in name
    }
    try:
        target.mkdir(parents=True, exist_ok=True)
        (target / "adapter_config.json").write_text(
            json.dumps(peft["adapter_config"], indent=2, sort_keys=True)
        )
        weights = target / "adapter_model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
    except OSError as exc:
        raise CheckpointError(f"cannot write the adapter directory {target}: {exc}") from exc
    return weights


def _peft_record(peft: object) -> bool:
    """Whether a checkpoint's ``peft`` metadata has the fields and types export reads."""
    if not isinstance(peft, dict) or not isinstance(peft.get("prefix"), str):
        return False
    modules = peft.get("modules")
    config = peft.get("adapter_config")
    return (
        isinstance(modules, dict)
        and (config is None or isinstance(config, dict))
        and all(
            isinstance(m, dict)
            and isinstance(m.get("scaling"), (int, float))
            and isinstance(m.get("fan_in_fan_out"), bool)
            and (m.get("refused") is None or isinstance(m.get("refused"), str))
            for m in modules.values()
        )
    )
