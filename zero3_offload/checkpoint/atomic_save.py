"""Saving a checkpoint atomically: every rank writes, rank 0 commits when all succeeded.

See [Note: checkpoint format] in ``checkpoint.format``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zero3_offload.checkpoint.format import LATEST, METADATA, shard_file
from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import CheckpointError

__all__ = ["commit_save", "fsync_path", "prepare_save", "write_shard"]


def fsync_path(path: Path) -> None:
    """Flush a file's, or a directory's entries', data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def prepare_save(root: Path, name: str, comm: Collectives) -> Path:
    """Rank 0 (re)creates the hidden temporary directory; every rank waits for it.

    Raises:
        CheckpointError: when the directory cannot be created.
    """
    tmp = root / f".tmp-{name}"
    error = None
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that crashed
            tmp.mkdir()
        except OSError as exc:
            error = exc
    if not await comm.agree(error is None):
        raise CheckpointError(f"cannot create checkpoint directory {tmp}: {error or 'see rank 0'}")
    return tmp


def write_shard(tmp: Path, tensors: Mapping[str, torch.Tensor], rank: int, world: int) -> Path:
    """Write this rank's tensors into ``tmp`` (written, fsynced, renamed into place)."""
    final = tmp / shard_file(rank, world)
    part = final.with_suffix(".part")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(part))
    with part.open("rb") as fh:
        os.fsync(fh.fileno())
    part.replace(final)
    return final


async def commit_save(
    root: Path, tmp: Path, name: str, metadata: dict[str, Any], comm: Collectives, wrote: bool
) -> Path:
    """Commit when every rank ``wrote``; else remove the temporary directory.

    Raises:
        CheckpointError: when a rank failed or the commit failed; the previous
            checkpoint and ``latest`` are unchanged then.
    """
    final = root / name
    if not await comm.agree(wrote):
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving {final} failed on a rank; the previous checkpoint is kept")
    error = None
    if comm.rank == 0:
        try:
            (tmp / METADATA).write_text(json.dumps(metadata, indent=1))
            old = root / f".old-{name}"
            if final.exists():
                final.replace(old)  # same-named checkpoint: replaced only on success
            tmp.replace(final)
            shutil.rmtree(old, ignore_errors=True)
            latest_tmp = root / f".{LATEST}.tmp"
            latest_tmp.write_text(name + "\n")
            with latest_tmp.open("rb") as fh:
                os.fsync(fh.fileno())
            latest_tmp.replace(root / LATEST)
            fsync_path(root)
        except OSError as exc:
            error = exc
    if not await comm.agree(error is None):
        raise CheckpointError(f"committing {final} failed: {error or 'see rank 0'}")
    return final
