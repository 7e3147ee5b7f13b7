"""Exporting a sharded checkpoint as a transformers model directory, parameter by parameter.

A checkpoint saved by a module-mode manager whose model is a transformers model
records the model's config (``model_config`` in its metadata). Export rebuilds
that config, then streams every parameter, assembled from the slices of the
rank files that hold it (see ``checkpoint.consolidate``), into
``integrations.pretrained_writer``: memory stays near one weight file's worth.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from zero3_offload.checkpoint.consolidate import iter_full_parameters
from zero3_offload.checkpoint.format import read_metadata, resolve_checkpoint
from zero3_offload.errors import CheckpointError, ConfigError
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
) -> list[Path]:
    """Write the checkpoint at ``checkpoint`` as a transformers directory at ``directory``.

    ``AutoModelForCausalLM.from_pretrained(directory)`` loads the result as is.

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
    config = _config(meta, config_dir)
    params = list(iter_full_parameters(checkpoint))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, _, load) in enumerate(params):
            yield name, load()
            if progress is not None:
                progress(i + 1, len(params))

    return write_pretrained(
        directory, config, tensors(), max_shard_bytes=max_shard_bytes, dtype=dtype
    )
