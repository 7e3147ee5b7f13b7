"""Sharded checkpoints: atomic save, load at any world size, no pickles.

[Note: checkpoint format]
A checkpoint is a directory ``step-NNNNNNNN`` (``-micro-K`` when saved inside an
accumulation window) under a root directory whose ``latest`` file names the
newest committed one. It holds ``metadata.json`` (layer order, parameter names,
shapes and offsets, world size, step counters, loss-scaler state, config,
library version) and one safetensors file per rank,
``rank-RRRRR-of-NNNNN.safetensors``, with that rank's 1-D shards:
``{layer}.master`` (fp32), ``{layer}.optim.{key}`` (optimizer state: per-element
moments are shards like the master, ``step`` is a scalar), ``{layer}.owned.{param}.{key}``
(the state of a whole parameter a shape-aware optimizer updates, in its owner's file
only, with its own shape; see [Note: owned parameters]), ``{layer}.grad``
(accumulated gradient, only inside a window), and ``{layer}.frozen`` (the frozen
parameters' values as gathers decode them, in their storage dtype or, for a
block-wise format, the compute dtype; laid out as ``frozen_layers`` in the
metadata says, with its ``align``; absent when saved with ``include_frozen=False``).
``metadata.json`` also names each parameter's optimizer class (``param_optimizers``);
a load refuses a parameter whose optimizer differs.

safetensors rather than ``torch.distributed.checkpoint``: DCP stores its
metadata with pickle, and loading must never unpickle; safetensors files hold
only tensors and a JSON header, and can be read slice by slice, which is what
resharding and streaming consolidation need.

Save is atomic and crash-safe (the steps are ``SAVE_STEPS`` in
``checkpoint.atomic_save``): every rank writes its file into ``.tmp-<name>``
(``.part``, fsync, rename); only when all ranks report success (an all-reduce)
does rank 0 fsync that directory, write ``metadata.json`` last (``.part``,
fsync, rename, fsync), write ``.latest.tmp``, rename the directory into place
(a same-named one goes to ``.old-<name>`` first) and rename ``.latest.tmp``
over ``latest`` (fsync of the root after each rename). A directory without
``metadata.json`` is never loadable. A kill at any moment leaves ``latest``
naming a complete checkpoint: while the directory it names is missing (a kill
between the two renames of a same-named save) ``resolve_checkpoint`` falls back
to ``.old-<name>``. A failed write (e.g. a full disk) raises ``CheckpointError``
on every rank and undoes the save. The next successful save deletes
``.tmp-*``, ``.old-*`` and ``.latest.tmp`` left behind.

Load at any world size: a layer's flat padded buffer is the concatenation of
the saved shards, so each rank reads exactly the slice ``[r*S', (r+1)*S')`` it
owns now (padding beyond the real elements is zero) from whichever files hold
it, with ``safe_open(...).get_slice``. A scalar, and a whole parameter's state, is
read from the first file that holds it (owners change with the world size).
Everything is read and checked before any state changes; ranks agree (all-reduce)
before committing.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from zero3_offload.errors import CheckpointError
from zero3_offload.logging import get_logger
from zero3_offload.parameter.flat_layout import LayerLayout

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "METADATA",
    "checkpoint_name",
    "frozen_metadata",
    "layout_metadata",
    "open_for_reading",
    "read_metadata",
    "resolve_checkpoint",
    "shard_file",
]

FORMAT = "zero3_offload-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
# Bounds a hostile metadata file cannot go past: far above any real run.
_MAX_METADATA_BYTES = 64 * 2**20
_MAX_WORLD = 1 << 16
_MAX_ELEMENTS = 1 << 48

log = get_logger(__name__)


def shard_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def checkpoint_name(step: int, micro: int) -> str:
    return f"step-{step:08d}" + (f"-micro-{micro}" if micro else "")


def layout_metadata(layouts: Mapping[str, LayerLayout]) -> list[dict[str, Any]]:
    """The layer and parameter layout as JSON (world-size independent parts)."""
    return [_layout_entry(name, lay) for name, lay in layouts.items()]


def frozen_metadata(layouts: Mapping[str, LayerLayout]) -> list[dict[str, Any]]:
    """The frozen parts' layouts as JSON (see [Note: frozen parameters]): the entries of
    ``frozen_layers``, whose shards are the ``{layer}.frozen`` tensors."""
    return [
        _layout_entry(name, lay.frozen) for name, lay in layouts.items() if lay.frozen is not None
    ]


def _layout_entry(name: str, lay: LayerLayout) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "numel": lay.numel,
        "params": [
            {"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel}
            for s in lay.slots
        ],
    }
    if lay.align != 1:
        entry["align"] = lay.align
    return entry


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory for ``path``: itself, or the one its ``latest`` names.

    When the directory ``latest`` names is missing, its ``.old-<name>`` (kept by
    a same-named save killed before it moved the new directory in) is returned.

    Raises:
        CheckpointError: when there is no checkpoint there.
    """
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text(errors="replace")[:256].strip()
        target = path / name
        if not name or name in (".", "..") or "/" in name or "\\" in name or target.is_symlink():
            raise CheckpointError(
                f"{latest} names {name!r}: not a checkpoint directory inside {path}; refusing"
            )
        if (target / METADATA).is_file():
            return target
        old = path / f".old-{name}"
        if not target.exists() and not old.is_symlink() and (old / METADATA).is_file():
            # A same-named save was killed between its two renames (see atomic_save).
            log.warning("checkpoint_fallback", latest=name, loading=str(old))
            return old
        raise CheckpointError(f"{latest} names {target.name}, which has no {METADATA}")
    raise CheckpointError(f"no checkpoint at {path}: expected {METADATA} or a {LATEST} file")


def read_metadata(directory: Path) -> dict[str, Any]:
    """Parse and check ``metadata.json``; refuse directories with unexpected files.

    Raises:
        CheckpointError: naming the file and what is wrong.
    """
    file = directory / METADATA
    try:
        if file.is_symlink():
            raise ValueError("a symlink; refusing to follow it")
        if file.stat().st_size > _MAX_METADATA_BYTES:
            raise ValueError(f"larger than {_MAX_METADATA_BYTES} bytes")
        meta = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file}: unreadable checkpoint metadata ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} metadata file")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {meta.get('version')} is not supported")
    _check_schema(meta, file)
    expected = {METADATA} | {shard_file(r, meta["world_size"]) for r in range(meta["world_size"])}
    for entry in directory.iterdir():
        if entry.name not in expected:
            raise CheckpointError(
                f"{entry}: unexpected file in checkpoint directory {directory}; only "
                f"{METADATA} and rank-*.safetensors are read (never pickles), so refusing to load"
            )
        if entry.is_symlink():
            raise CheckpointError(f"{entry}: a symlink in checkpoint directory; refusing")
    for name in sorted(expected - {METADATA}):
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing shard file")
    return meta


def _check_schema(meta: dict[str, Any], file: Path) -> None:
    """Refuse metadata whose fields have the wrong types or impossible sizes, before
    anything is allocated from them (a hostile file could ask for terabytes)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: {what}; refusing to load")

    def count(value: object, limit: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit

    if not count(meta.get("world_size"), _MAX_WORLD) or meta["world_size"] < 1:
        raise bad(f"world_size {meta.get('world_size')!r} is not an int in [1, {_MAX_WORLD}]")
    layers, optimizer = meta.get("layers"), meta.get("optimizer")
    if not isinstance(layers, list) or not isinstance(optimizer, dict):
        raise bad("layers must be a list and optimizer an object")
    if not isinstance(optimizer.get("kind"), str):
        raise bad("optimizer.kind must be a string")
    param_optimizers = meta.get("param_optimizers", {})
    if not isinstance(param_optimizers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in param_optimizers.items()
    ):
        raise bad("param_optimizers must map parameter names to optimizer names")
    scalars = meta.get("scalar_state", [])
    if not isinstance(scalars, list) or not all(isinstance(k, str) for k in scalars):
        raise bad("scalar_state must be a list of strings")
    frozen = meta.get("frozen_layers", [])
    if not isinstance(frozen, list):
        raise bad("frozen_layers must be a list")
    for layer in [*layers, *frozen]:
        if not isinstance(layer, dict) or not isinstance(layer.get("name"), str):
            raise bad(f"layer entry {str(layer)[:80]} has no name")
        numel, params = layer.get("numel"), layer.get("params")
        if not count(layer.get("align", 1), _MAX_ELEMENTS) or layer.get("align", 1) < 1:
            raise bad(f"layer {layer['name']!r}: align {layer.get('align')!r} is invalid")
        if not count(numel, _MAX_ELEMENTS) or not isinstance(params, list):
            raise bad(f"layer {layer['name']!r}: numel {numel!r} or params out of range")
        for param in params:
            shape = param.get("shape") if isinstance(param, dict) else None
            if (
                not isinstance(shape, list)
                or not isinstance(param.get("name"), str)
                or not all(count(d, _MAX_ELEMENTS) for d in shape)
                or not count(param.get("offset"), numel)
                or param.get("numel") != math.prod(shape)
                or param["offset"] + param["numel"] > numel
            ):
                raise bad(f"layer {layer['name']!r}: parameter entry {str(param)[:120]} is invalid")


def open_for_reading(file: Path) -> Any:
    """``safe_open`` with the ``pread`` backend where safetensors offers it."""
    # pread copies only the slices asked for; the default maps the whole file
    # and keeps the pages read resident (docs/benchmarks.md, "consolidate", measures both).
    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # safetensors < 0.7: no backend argument
        return safe_open(str(file), framework="pt")
