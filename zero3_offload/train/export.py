"""``--export DIR``: the trained model's directory, ready to load and to generate with.

``manager.save_pretrained`` writes the weights (a collective): the transformers model,
or for a peft model (``--lora``, ``--peft-config``) its adapter directory, or with
``--export-merged`` the base model with the adapters merged (see [Note: adapter
saves] and [Note: merged saves]). Then rank 0 adds what generating needs, taken from
``--model``: the tokenizer (``save_pretrained``, with its chat template) and the
model's ``generation_config.json`` (copied as is). Every rank learns whether that
worked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio.to_thread

from zero3_offload.errors import CheckpointError
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.train.options import TrainOptions

__all__ = ["export_model"]

_GENERATION_CONFIG = "generation_config.json"


async def export_model(
    manager: Zero3CpuOffloadManager, opts: TrainOptions, tokenizer: Any | None
) -> tuple[Path, list[str]]:
    """Write ``opts.export`` (a collective); the directory and what it holds besides the
    weights (``tokenizer``, ``chat template``, ``generation_config.json``).

    Raises:
        CheckpointError: when writing failed on any rank (every rank raises).
        OSError: when the directory cannot be written.
    """
    assert opts.export is not None and opts.model is not None
    path = await manager.save_pretrained(opts.export, merged=opts.export_merged)
    extras: list[str] = []
    error: BaseException | None = None
    if manager.rank == 0:
        try:
            extras = await anyio.to_thread.run_sync(_add_files, path, Path(opts.model), tokenizer)
        except (OSError, ValueError, TypeError) as exc:
            error = exc
    if not await manager.engine.comm.agree(error is None, what="the export's tokenizer files"):
        raise CheckpointError(
            f"writing the tokenizer and generation config to {path} failed on rank 0"
            + (f": {error}" if error is not None else "")
        ) from error
    return path, extras


def _add_files(path: Path, source: Path, tokenizer: Any | None) -> list[str]:
    extras = []
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
        extras.append("tokenizer")
        if getattr(tokenizer, "chat_template", None):
            extras.append("chat template")
    if (source / _GENERATION_CONFIG).is_file():
        shutil.copyfile(source / _GENERATION_CONFIG, path / _GENERATION_CONFIG)
        extras.append(_GENERATION_CONFIG)
    return extras
