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
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zero3_offload.comm import Collectives
from zero3_offload.errors import CheckpointError
from zero3_offload.parameter_management import LayerLayout

__all__ = [
    "LoadedShards",
    "agree",
    "checkpoint_name",
    "commit_save",
    "layout_metadata",
    "open_for_reading",
    "prepare_save",
    "read_shards",
    "resolve_checkpoint",
    "shard_file",
    "write_shard",
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


async def agree(comm: Collectives, ok: bool) -> bool:
    """True when every rank passed ``ok`` (an all-reduce of failure counts)."""
    flag = torch.tensor([0.0 if ok else 1.0], device=comm.device)
    await comm.all_reduce_sum(flag)
    return flag.item() == 0


def _fsync_dir(path: Path) -> None:
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
    if not await agree(comm, error is None):
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
    if not await agree(comm, wrote):
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
            _fsync_dir(root)
        except OSError as exc:
            error = exc
    if not await agree(comm, error is None):
        raise CheckpointError(f"committing {final} failed: {error or 'see rank 0'}")
    return final


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


@attrs.define
class LoadedShards:
    """This rank's slices of a checkpoint, read and checked, not yet applied."""

    masters: dict[str, torch.Tensor]  # layer -> 1D fp32 [new shard_numel]
    optim: dict[str, dict[str, torch.Tensor]]  # layer -> state key -> tensor
    grads: dict[str, torch.Tensor]  # layer -> 1D fp32 (only inside a window)
    meta: dict[str, Any]


def _check_layout(meta: dict[str, Any], layouts: Mapping[str, LayerLayout], file: Path) -> None:
    saved = {layer["name"]: layer for layer in meta["layers"]}
    ours = {layer["name"]: layer for layer in layout_metadata(layouts)}
    if saved.keys() != ours.keys():
        raise CheckpointError(
            f"{file}: layers differ from the model's: checkpoint has {sorted(saved)}, "
            f"model has {sorted(ours)}"
        )
    for name, layer in ours.items():
        if saved[name]["params"] != layer["params"]:
            have = [(p["name"], p["shape"]) for p in saved[name]["params"]]
            want = [(p["name"], p["shape"]) for p in layer["params"]]
            raise CheckpointError(
                f"{file}: layer {name!r} differs: checkpoint parameters {have}, model {want}"
            )


def open_for_reading(file: Path) -> Any:
    """``safe_open`` with the ``pread`` backend where safetensors offers it."""
    # pread copies only the slices asked for; the default maps the whole file
    # and keeps the pages read resident (see benchmarks/bench_consolidate.py).
    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # safetensors < 0.7: no backend argument
        return safe_open(str(file), framework="pt")


class _Reader:
    """Reads ranges of saved flat shards from the per-rank files."""

    def __init__(self, directory: Path, world: int) -> None:
        self._files = [directory / shard_file(r, world) for r in range(world)]
        self._handles: dict[int, Any] = {}
        self.world = world

    def _open(self, rank: int) -> Any:
        if rank not in self._handles:
            try:
                self._handles[rank] = open_for_reading(self._files[rank])
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{self._files[rank]}: unreadable shard ({exc})") from exc
        return self._handles[rank]

    def keys(self, rank: int) -> set[str]:
        return set(self._open(rank).keys())

    def scalar(self, key: str) -> torch.Tensor:
        try:
            return self._open(0).get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{self._files[0]}: cannot read {key} ({exc})") from exc

    def flat_range(self, key: str, old_shard: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flat buffer that ``key``'s shards make up."""
        out = torch.zeros(end - start, dtype=torch.float32)
        if old_shard == 0:
            return out
        for q in range(start // old_shard, min(self.world, -(-end // old_shard))):
            lo, hi = max(start, q * old_shard), min(end, (q + 1) * old_shard)
            if lo >= hi:
                continue
            try:
                piece = self._open(q).get_slice(key)[lo - q * old_shard : hi - q * old_shard]
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{self._files[q]}: cannot read {key} ({exc})") from exc
            if piece.numel() != hi - lo:
                raise CheckpointError(f"{self._files[q]}: {key} is truncated")
            out[lo - start : hi - start] = piece
        return out


def read_shards(
    directory: Path, layouts: Mapping[str, LayerLayout], *, optimizer_kind: str
) -> LoadedShards:
    """Read this rank's slices (per its current layouts) of the checkpoint in ``directory``.

    Raises:
        CheckpointError: for missing, truncated or corrupt files, another model's
            checkpoint, or another optimizer's state.
    """
    meta = read_metadata(directory)
    _check_layout(meta, layouts, directory / METADATA)
    if meta["optimizer"]["kind"] != optimizer_kind:
        raise CheckpointError(
            f"{directory / METADATA}: saved with optimizer {meta['optimizer']['kind']!r}, "
            f"the manager uses {optimizer_kind!r}"
        )
    world = meta["world_size"]
    reader = _Reader(directory, world)
    keys = reader.keys(0)
    masters, optim, grads = {}, {}, {}
    for name, lay in layouts.items():
        if not lay.numel:
            continue
        old_shard = -(-lay.numel // world)
        span = (lay.shard_start, lay.shard_end)
        masters[name] = reader.flat_range(f"{name}.master", old_shard, *span)
        state = {}
        for key in sorted(k for k in keys if k.startswith(f"{name}.optim.")):
            field = key.removeprefix(f"{name}.optim.")
            if field in meta["scalar_state"]:
                state[field] = reader.scalar(key)
            else:
                state[field] = reader.flat_range(key, old_shard, *span)
        optim[name] = state
        if f"{name}.grad" in keys:
            grads[name] = reader.flat_range(f"{name}.grad", old_shard, *span)
    return LoadedShards(masters=masters, optim=optim, grads=grads, meta=meta)
