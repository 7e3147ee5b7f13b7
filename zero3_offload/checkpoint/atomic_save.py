"""Saving a checkpoint atomically: every rank writes, rank 0 commits when all succeeded.

See [Note: checkpoint format] in ``checkpoint.format`` and "Crash safety" in
docs/checkpoints.md. A save runs these module-level steps, in this order
(``SAVE_STEPS``; the indented ones run inside the one above them, on rank 0):

- ``prepare_save`` (every rank):
    ``_make_temp_dir``: create ``ROOT/.tmp-NAME`` (removing one a crashed save
    of the same name left);
- ``write_shard`` (every rank): its file written as ``.part``, fsynced, renamed;
- ``commit_save`` (every rank): the ranks agree that every write succeeded, then
    ``_write_metadata``: fsync the temporary directory (the rank files'
    entries), then write ``metadata.json`` (``.part``, fsync, rename, fsync the
    directory). Last, so a directory without it is never loadable;
    ``_stage_latest``: write and fsync ``ROOT/.latest.tmp`` naming NAME. The
    last write that needs disk space: a full disk fails by here, when nothing
    visible has changed;
    ``_retire_old``: a same-named checkpoint is renamed to ``.old-NAME``
    (``resolve_checkpoint`` falls back to it while NAME is missing);
    ``_move_into_place``: rename ``.tmp-NAME`` to NAME, fsync ROOT;
    ``_point_latest``: rename ``.latest.tmp`` over ``latest``, fsync ROOT: the commit;
    ``_remove_leftovers``: delete every ``.tmp-*``, ``.old-*`` and ``.latest.tmp``
    (this save's and crashed saves');
  then the ranks agree that the commit succeeded.

A process killed between any two steps leaves ``latest`` naming a complete
checkpoint: the previous one up to ``_point_latest`` (a same-named one is
replaced by ``_move_into_place``), the new one from there on. A step that
fails undoes what the save changed and every rank raises ``CheckpointError``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zero3_offload.checkpoint.format import LATEST, METADATA, shard_file
from zero3_offload.checkpoint.streamed_shard import ShardEntry, write_streamed
from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import CheckpointError
from zero3_offload.logging import get_logger

__all__ = [
    "SAVE_STEPS",
    "commit_save",
    "fsync_path",
    "prepare_save",
    "write_shard",
    "write_shard_streamed",
]

SAVE_STEPS = (
    "prepare_save",
    "_make_temp_dir",
    "write_shard",
    "commit_save",
    "_write_metadata",
    "_stage_latest",
    "_retire_old",
    "_move_into_place",
    "_point_latest",
    "_remove_leftovers",
)

_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_LATEST_TMP = f".{LATEST}.tmp"
_PART = ".part"
# How a failed save left the root, as every rank's error message says.
_OUTCOMES = (
    "the previous checkpoint is kept",
    "{root}/latest names it, but it may not be on the disk yet",  # only an fsync failed
    "the previous checkpoint may need repair: check {root}",  # undoing the commit failed
)

log = get_logger(__name__)


def fsync_path(path: Path) -> None:
    """Flush a file's, or a directory's entries', data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it.

    Raises:
        CheckpointError: naming ``path`` (e.g. a full disk); a partial file is removed.
    """
    try:
        path.write_bytes(data)
        fsync_path(path)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _make_temp_dir(root: Path, name: str) -> Path:
    tmp = root / f"{_TMP_PREFIX}{name}"
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that crashed
    tmp.mkdir()
    return tmp


async def prepare_save(root: Path, name: str, comm: Collectives) -> Path:
    """Rank 0 (re)creates the hidden temporary directory; every rank waits for it.

    Raises:
        CheckpointError: when the directory cannot be created.
    """
    tmp = root / f"{_TMP_PREFIX}{name}"
    error = None
    if comm.rank == 0:
        try:
            _make_temp_dir(root, name)
        except OSError as exc:
            error = exc
    if not await comm.agree(error is None, what="the checkpoint's temporary directory"):
        raise CheckpointError(
            f"cannot create checkpoint directory {tmp}: {error or 'see rank 0'}; "
            "the previous checkpoint is kept"
        )
    return tmp


def write_shard(tmp: Path, tensors: Mapping[str, torch.Tensor], rank: int, world: int) -> Path:
    """Write this rank's tensors into ``tmp`` (written, fsynced, renamed into place).

    Raises:
        CheckpointError: naming the file, when it cannot be written (e.g. a full
            disk); the partial file is removed.
    """
    final = tmp / shard_file(rank, world)
    part = final.with_suffix(_PART)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(part))
        fsync_path(part)
        part.replace(final)
    except Exception as exc:  # safetensors reports a full disk as SafetensorError
        part.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {part}: {exc}") from exc
    return final


async def write_shard_streamed(
    tmp: Path,
    entries: Sequence[ShardEntry],
    open_group: Callable[[str], AbstractAsyncContextManager[dict[str, torch.Tensor]]],
    write: Callable[[Callable[[], None]], Awaitable[None]],
    rank: int,
    world: int,
) -> Path:
    """:func:`write_shard` for tensors that are not all in memory at once: written group
    by group (see ``checkpoint.streamed_shard``), the same file.

    Raises:
        CheckpointError: naming the file, when it cannot be written; the partial file
            is removed.
    """
    final = tmp / shard_file(rank, world)
    part = final.with_suffix(_PART)
    try:
        await write_streamed(part, entries, open_group, write)
        part.replace(final)
    except Exception as exc:  # a full disk, or the disk tier's read of a layer
        part.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {part}: {exc}") from exc
    return final


def _write_metadata(tmp: Path, metadata: dict[str, Any]) -> None:
    fsync_path(tmp)  # the rank files' renames are durable before the metadata exists
    part = tmp / f"{METADATA}{_PART}"
    _write_durably(part, json.dumps(metadata, indent=1).encode())
    part.replace(tmp / METADATA)
    fsync_path(tmp)


def _stage_latest(root: Path, name: str) -> None:
    _write_durably(root / _LATEST_TMP, (name + "\n").encode())


def _retire_old(root: Path, name: str) -> None:
    final, old = root / name, root / f"{_OLD_PREFIX}{name}"
    if not final.exists():
        # A kept .old-NAME is what ``latest`` falls back to while NAME is missing.
        return
    if old.exists():
        shutil.rmtree(old)  # NAME is complete, so this is a leftover
    final.replace(old)
    fsync_path(root)


def _move_into_place(root: Path, tmp: Path, name: str) -> None:
    tmp.replace(root / name)
    fsync_path(root)


def _point_latest(root: Path) -> None:
    (root / _LATEST_TMP).replace(root / LATEST)
    fsync_path(root)


def _remove_leftovers(root: Path) -> None:
    """Delete what this and crashed saves left, once ``latest`` names the new directory.

    Never raises: the checkpoint is committed; what is left goes at the next save.
    """
    try:
        for entry in root.iterdir():
            if entry.name.startswith((_TMP_PREFIX, _OLD_PREFIX, _LATEST_TMP)):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    except OSError as exc:
        log.warning("checkpoint_leftovers_kept", root=str(root), error=str(exc))


def _undo(root: Path, tmp: Path, name: str) -> None:
    """Put back what a commit that failed before ``latest`` moved changed.

    Renames only, each leaving a loadable state if the process dies in between.
    """
    final, old = root / name, root / f"{_OLD_PREFIX}{name}"
    if not tmp.exists() and final.exists():
        final.replace(tmp)  # the new directory, moved in but never named by ``latest``
    if not final.exists() and old.exists():
        old.replace(final)
    shutil.rmtree(tmp, ignore_errors=True)
    (root / _LATEST_TMP).unlink(missing_ok=True)


def _commit(root: Path, tmp: Path, name: str, metadata: dict[str, Any], done: list[str]) -> None:
    """Rank 0's steps of a commit; ``done`` gets each step's name as it starts."""
    done.append("_write_metadata")
    _write_metadata(tmp, metadata)
    done.append("_stage_latest")
    _stage_latest(root, name)
    done.append("_retire_old")
    _retire_old(root, name)
    done.append("_move_into_place")
    _move_into_place(root, tmp, name)
    done.append("_point_latest")
    _point_latest(root)
    done.append("_remove_leftovers")
    _remove_leftovers(root)


def _step_path(step: str, root: Path, tmp: Path, name: str) -> Path:
    """What ``step`` writes or renames (for the other ranks' error message)."""
    return {
        "_write_metadata": tmp / f"{METADATA}{_PART}",
        "_stage_latest": root / _LATEST_TMP,
        "_retire_old": root / name,
        "_move_into_place": tmp,
        "_point_latest": root / LATEST,
    }.get(step, root)


async def _share_codes(comm: Collectives, code: int) -> list[int]:
    """Every rank's ``code`` (0: success), in rank order (a collective)."""
    codes = torch.zeros(comm.world_size, device=comm.device)
    codes[comm.rank] = float(code)
    await comm.all_reduce_sum(codes, what="every rank's save outcome")
    return [int(c) for c in codes.tolist()]


async def commit_save(
    root: Path,
    tmp: Path,
    name: str,
    metadata: dict[str, Any],
    comm: Collectives,
    error: Exception | None,
) -> Path:
    """Commit when no rank's write failed (``error`` is this rank's); else clean up.

    Raises:
        CheckpointError: on every rank when a rank's write or the commit failed,
            naming the file that failed; the previous checkpoint and ``latest``
            are unchanged then (what the save wrote is removed, a same-named
            checkpoint put back), as the message says.
    """
    final = root / name
    codes = await _share_codes(comm, int(error is not None))
    if any(codes):
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        why = [str(error)] if error is not None else []
        why += [
            f"rank {r} could not write {(tmp / shard_file(r, comm.world_size)).with_suffix(_PART)}"
            for r, code in enumerate(codes)
            if code and r != comm.rank
        ]
        raise CheckpointError(f"saving {final} failed: {'; '.join(why)}; {_OUTCOMES[0]}") from error
    # Rank 0 tells the others which step failed and how it left the root (an
    # index into _OUTCOMES); the code is 0 when the commit succeeded.
    commit_error: Exception | None = None
    done: list[str] = []
    outcome = 0
    if comm.rank == 0:
        try:
            _commit(root, tmp, name, metadata, done)
        except (OSError, CheckpointError) as exc:
            commit_error = exc
            if done[-1] == "_point_latest" and not (root / _LATEST_TMP).exists():
                outcome = 1  # only the fsync after the rename failed
            else:
                try:
                    _undo(root, tmp, name)
                except OSError as undo_exc:
                    outcome = 2
                    commit_error = CheckpointError(f"{exc}; undoing it failed: {undo_exc}")
    code = 0
    if commit_error is not None:
        code = 1 + SAVE_STEPS.index(done[-1]) + len(SAVE_STEPS) * outcome
    code = (await _share_codes(comm, code))[0]
    if code:
        outcome, step = divmod(code - 1, len(SAVE_STEPS))
        what = SAVE_STEPS[step]
        why = commit_error or f"rank 0 failed at {what} ({_step_path(what, root, tmp, name)})"
        raise CheckpointError(
            f"committing {final} failed: {why}; {_OUTCOMES[outcome].format(root=root)}"
        ) from commit_error
    return final
