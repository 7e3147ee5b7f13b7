"""Reading this rank's slices of a checkpoint saved at any world size (resharding).

See [Note: checkpoint format] in ``checkpoint.format``: a layer's flat padded
buffer is the concatenation of the saved shards, so each rank reads exactly
the range it owns now from whichever files hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload.checkpoint.format import METADATA, layout_metadata, read_metadata
from zero3_offload.checkpoint.shard_reader import ShardReader
from zero3_offload.errors import CheckpointError
from zero3_offload.parameter.flat_layout import LayerLayout

__all__ = ["LoadedShards", "read_shards"]


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
    reader = ShardReader(directory, world)
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
