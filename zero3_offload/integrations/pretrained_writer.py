"""Writing a model directory that transformers' ``from_pretrained`` loads, from streamed tensors.

[Note: streamed pretrained writes]
:func:`write_pretrained` takes ``(name, tensor)`` pairs one at a time (e.g. as a
ZeRO-3 run gathers one layer after another) and packs them into shards of at most
``max_shard_bytes`` (a tensor larger than that gets a shard of its own), writing each
shard as soon as it is full: it holds at most one shard's tensors. The number of
shards is known only at the end, so shards are written under provisional names and
renamed then: ``model.safetensors`` when there is one, else
``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``, the
layout and names ``save_pretrained`` writes. Everything is written, fsynced, into a
hidden temporary directory beside the target, which is renamed into place at the
end: a failure leaves no partial model directory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from zero3_offload.checkpoint.atomic_save import fsync_path
from zero3_offload.errors import CheckpointError, InputError
from zero3_offload.logging import get_logger

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["write_pretrained"]

_log = get_logger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def _io(action: str, path: Path) -> Iterator[None]:
    """Raise file-system errors of the body as CheckpointError naming ``path``."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot {action} {path}: {exc}") from exc


def _owned_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor`` (floating point cast to ``dtype``) that shares no
    storage: views of larger buffers and tied names are then saved as separate tensors."""
    out = torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    out.copy_(tensor.detach())
    return out


def _checked_pair(item: object, seen: set[str]) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise InputError(f"tensors must yield (name, tensor) pairs, got {item!r:.80}")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise InputError(f"tensor names must be non-empty strings, got {name!r}")
    if name in seen:
        raise InputError(f"tensor {name!r} is given twice")
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_meta:
        raise InputError(f"{name}: is on the meta device and has no values to write")
    return name, tensor


def _stored_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    itemsize = (dtype if tensor.is_floating_point() else tensor.dtype).itemsize
    return tensor.numel() * itemsize


def _write_shards(
    tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int, dtype: torch.dtype
) -> tuple[list[tuple[Path, list[str]]], int, int]:
    """Write the shards under provisional names: (path, names) of each, total bytes and
    total elements. See [Note: streamed pretrained writes]."""
    shards: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total_bytes = total_numel = 0
    seen: set[str] = set()

    def flush() -> None:
        path = tmp / f"shard-{len(shards):05d}.safetensors.part"
        with _io("write", path):
            save_file(current, str(path), metadata={"format": "pt"})
        shards.append((path, list(current)))
        current.clear()

    for item in tensors:
        name, tensor = _checked_pair(item, seen)
        size = _stored_bytes(tensor, dtype)
        if current and current_bytes + size > max_shard_bytes:
            flush()
            current_bytes = 0
        current[name] = _owned_copy(tensor, dtype)
        seen.add(name)
        current_bytes += size
        total_bytes += size
        total_numel += tensor.numel()
    if not seen:
        raise InputError("tensors yielded nothing to write")
    flush()
    return shards, total_bytes, total_numel


def _replace_target(tmp: Path, target: Path) -> None:
    with _io("replace", target):
        if target.is_dir() and not target.is_symlink():
            target.rmdir()  # empty: checked before writing
        tmp.rename(target)
        fsync_path(target.parent)


def write_pretrained(
    directory: str | os.PathLike[str],
    config: PretrainedConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype = torch.float32,
) -> list[Path]:
    """Write a model directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    Streams ``tensors`` into safetensors shards (metadata ``{"format": "pt"}``), writes
    the index when there is more than one shard, then ``config.save_pretrained``, all in
    a temporary directory renamed to ``directory`` at the end. See
    [Note: streamed pretrained writes]. The config is saved from a copy whose dtype
    field is set to ``dtype``, so that ``from_pretrained`` loads the weights as written.

    Args:
        directory: the model directory to create; it must not exist, or be empty.
        config: the model's transformers config (``PretrainedConfig``).
        tensors: ``(name, tensor)`` pairs with the names ``from_pretrained`` expects
            (those of ``model.named_parameters()``, which lists a tied parameter once);
            read one at a time.
        max_shard_bytes: the most bytes of tensor data in one shard file.
        dtype: the dtype in which floating-point tensors are written (others keep theirs).

    Returns:
        The files written in ``directory``: the weight files in shard order, then the
        index (when sharded), then the config files.

    Raises:
        InputError: for an invalid argument, a duplicate name, a meta tensor, or no tensors.
        CheckpointError: when ``directory`` exists and is not an empty directory, or a
            file cannot be written; nothing is left at ``directory`` then.
    """
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool):
        raise InputError(f"max_shard_bytes must be an int, got {max_shard_bytes!r}")
    if max_shard_bytes <= 0:
        raise InputError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not callable(getattr(config, "save_pretrained", None)):
        raise InputError(f"config must be a transformers config, got {type(config).__name__}")
    target = Path(directory)
    with _io("inspect", target):
        in_the_way = target.is_symlink() or (
            target.exists() and not (target.is_dir() and not any(target.iterdir()))
        )
    if in_the_way:
        raise CheckpointError(f"{target}: exists and is not an empty directory; remove it first")
    with _io("create the directory beside", target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    committed = False
    try:
        shards, total_bytes, total_numel = _write_shards(tmp, tensors, max_shard_bytes, dtype)
        if len(shards) == 1:
            weight_files = [_SINGLE_FILE]
        else:
            weight_files = [
                f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
            ]
        for (part, _), file in zip(shards, weight_files, strict=True):
            with _io("rename", part):
                part.rename(tmp / file)
        written = list(weight_files)
        if len(shards) > 1:
            index = {
                "metadata": {"total_parameters": total_numel, "total_size": total_bytes},
                "weight_map": {
                    name: file
                    for (_, names), file in zip(shards, weight_files, strict=True)
                    for name in names
                },
            }
            with _io("write", tmp / _INDEX_FILE):
                (tmp / _INDEX_FILE).write_text(
                    json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8"
                )
            written.append(_INDEX_FILE)
        saved_config = copy.deepcopy(config)
        # transformers >= 4.56 names the field ``dtype``; older, ``torch_dtype``.
        setattr(saved_config, "dtype" if hasattr(saved_config, "dtype") else "torch_dtype", dtype)
        with _io("write the config into", tmp):
            saved_config.save_pretrained(str(tmp))
            written += sorted(p.name for p in tmp.iterdir() if p.name not in written)
            for file in written:
                fsync_path(tmp / file)
            fsync_path(tmp)
        _replace_target(tmp, target)
        committed = True
    finally:
        if not committed:
            try:
                shutil.rmtree(tmp)
            except OSError as exc:  # the error being raised matters more; report this one
                _log.warning("cannot remove temporary directory", path=str(tmp), error=str(exc))
    _log.info(
        "wrote pretrained model", directory=str(target), shards=len(shards), bytes=total_bytes
    )
    return [target / file for file in written]
