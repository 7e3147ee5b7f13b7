"""Sharded checkpoints: atomic save, load at any world size, no pickles.

[Note: checkpoint format]
A checkpoint is a directory ``step-NNNNNNNN`` (``-micro-K`` when saved inside an
accumulation window) under a root directory whose ``latest`` file names the
newest committed one. It holds ``metadata.json`` (layer order, parameter names,
shapes and offsets, world size, step counters, loss-scaler state, config,
library version) and one safetensors file per rank,
``rank-RRRRR-of-NNNNN.safetensors``, with that rank's 1-D shards:
``{layer}.master`` (fp32), ``{layer}.optim.{key}`` (optimizer state: per-element
moments are shards like the master, ``step`` is a scalar), ``{layer}.grad``
(accumulated gradient, only inside a window).

safetensors rather than ``torch.distributed.checkpoint``: DCP stores its
metadata with pickle, and loading must never unpickle; safetensors files hold
only tensors and a JSON header, and can be read slice by slice, which is what
resharding and streaming consolidation need.

Save is atomic: every rank writes its file into ``.tmp-<name>``; only when all
ranks report success (an all-reduce) does rank 0 write the metadata, rename the
directory into place and replace ``latest`` (write, fsync, ``os.replace``). A
crash before that leaves the previous checkpoint and ``latest`` untouched.

Load at any world size: a layer's flat padded buffer is the concatenation of
the saved shards, so each rank reads exactly the slice ``[r*S', (r+1)*S')`` it
owns now (padding beyond the real elements is zero) from whichever files hold
it, with ``safe_open(...).get_slice``. Everything is read and checked before
any state changes; ranks agree (all-reduce) before committing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from zero3_offload.errors import CheckpointError
from zero3_offload.parameter.flat_layout import LayerLayout

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "METADATA",
    "checkpoint_name",
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


def shard_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def checkpoint_name(step: int, micro: int) -> str:
    return f"step-{step:08d}" + (f"-micro-{micro}" if micro else "")


def layout_metadata(layouts: Mapping[str, LayerLayout]) -> list[dict[str, Any]]:
    """The layer and parameter layout as JSON (world-size independent parts)."""
    return [
        {
            "name": name,
            "numel": lay.numel,
            "params": [
                {"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel}
                for s in lay.slots
            ],
        }
        for name, lay in layouts.items()
    ]


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory for ``path``: itself, or the one its ``latest`` names.

    Raises:
        CheckpointError: when there is no checkpoint there.
    """
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / METADATA).is_file():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which has no {METADATA}")
    raise CheckpointError(f"no checkpoint at {path}: expected {METADATA} or a {LATEST} file")


def read_metadata(directory: Path) -> dict[str, Any]:
    """Parse and check ``metadata.json``; refuse directories with unexpected files.

    Raises:
        CheckpointError: naming the file and what is wrong.
    """
    file = directory / METADATA
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable checkpoint metadata ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} metadata file")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {meta.get('version')} is not supported")
    expected = {METADATA} | {shard_file(r, meta["world_size"]) for r in range(meta["world_size"])}
    for entry in directory.iterdir():
        if entry.name not in expected:
            raise CheckpointError(
                f"{entry}: unexpected file in checkpoint directory {directory}; only "
                f"{METADATA} and rank-*.safetensors are read (never pickles), so refusing to load"
            )
    for name in sorted(expected - {METADATA}):
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing shard file")
    return meta


def open_for_reading(file: Path) -> Any:
    """``safe_open`` with the ``pread`` backend where safetensors offers it."""
    # pread copies only the slices asked for; the default maps the whole file
    # and keeps the pages read resident (docs/benchmarks.md, "consolidate", measures both).
    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # safetensors < 0.7: no backend argument
        return safe_open(str(file), framework="pt")
