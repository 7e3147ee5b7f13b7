"""Reading this rank's slices of a checkpoint saved at any world size (resharding).

See [Note: checkpoint format] in ``checkpoint.format``: a layer's flat padded
buffer is the concatenation of the saved shards, so each rank reads exactly
the range it owns now from whichever files hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload.checkpoint.format import (
    METADATA,
    frozen_metadata,
    layout_metadata,
    read_metadata,
)
from zero3_offload.checkpoint.shard_reader import ShardReader
from zero3_offload.config import BUILTIN_OPTIMIZERS
from zero3_offload.errors import CheckpointError
from zero3_offload.parameter.flat_layout import LayerLayout, saved_shard_numel

__all__ = ["LoadedShards", "read_shards"]


@attrs.define
class LoadedShards:
    """This rank's slices of a checkpoint, read and checked, not yet applied.

    Read eagerly, every layer's master and state are in ``masters`` and ``optim``.
    Read as a stream (``read_shards(..., streamed=True)``), those are empty and
    :meth:`layer` reads one layer's slices when asked, so no more than one layer
    is in memory at a time; the files were checked when this was made.
    """

    masters: dict[str, torch.Tensor]  # layer -> 1D fp32 [new shard_numel]
    optim: dict[str, dict[str, torch.Tensor]]  # layer -> state key -> tensor
    grads: dict[str, torch.Tensor]  # layer -> 1D fp32 (only inside a window)
    meta: dict[str, Any]
    # layer -> "<param>.<key>" -> the state of a whole parameter this rank owns now
    owned: dict[str, dict[str, torch.Tensor]] = attrs.Factory(dict)
    names: list[str] = attrs.Factory(list)  # the layers with parameters, in order
    # layer -> this rank's frozen shard (fp32 values); empty when saved without them
    frozen: dict[str, torch.Tensor] = attrs.Factory(dict)
    read_layer: Callable[[str], tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None

    def layer(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``name``'s master slice and optimizer state (read now when streamed).

        Raises:
            CheckpointError: a streamed read failed.
        """
        if self.read_layer is not None:
            return self.read_layer(name)
        return self.masters[name], self.optim.get(name, {})


def _read_frozen(
    reader: ShardReader, meta: dict[str, Any], layouts: Mapping[str, LayerLayout], file: Path
) -> dict[str, torch.Tensor]:
    """This rank's frozen shards (see [Note: frozen parameters]), read from a checkpoint
    saved with them; {} for one saved without them."""
    saved = meta.get("frozen_layers", [])
    if not meta.get("frozen_saved", False):
        return {}
    _check_parts(saved, frozen_metadata(layouts), file, "frozen parameters")
    out = {}
    for entry in saved:
        lay = layouts[entry["name"]].frozen
        assert lay is not None
        old_shard = saved_shard_numel(entry["numel"], reader.world, entry.get("align", 1))
        key = f"{entry['name']}.frozen"
        out[entry["name"]] = reader.flat_range(key, old_shard, lay.shard_start, lay.shard_end)
    return out


def _check_layout(meta: dict[str, Any], layouts: Mapping[str, LayerLayout], file: Path) -> None:
    _check_parts(meta["layers"], layout_metadata(layouts), file, "layers")


def _check_parts(
    saved_entries: list[dict[str, Any]], our_entries: list[dict[str, Any]], file: Path, what: str
) -> None:
    saved = {layer["name"]: layer for layer in saved_entries}
    ours = {layer["name"]: layer for layer in our_entries}
    if saved.keys() != ours.keys():
        raise CheckpointError(
            f"{file}: {what} differ from the model's: checkpoint has {sorted(saved)}, "
            f"model has {sorted(ours)}"
        )
    for name, layer in ours.items():
        if saved[name]["params"] != layer["params"] or saved[name].get("align", 1) != layer.get(
            "align", 1
        ):
            have = [(p["name"], p["shape"]) for p in saved[name]["params"]]
            want = [(p["name"], p["shape"]) for p in layer["params"]]
            raise CheckpointError(
                f"{file}: layer {name!r} differs: checkpoint parameters {have}, model {want}"
            )


def _check_optimizers(
    meta: dict[str, Any], optimizer_kind: str, current: Mapping[str, str], file: Path
) -> None:
    """Every parameter's optimizer class is the one it was saved with."""
    saved_kind = meta["optimizer"]["kind"]
    saved = meta.get("param_optimizers") or {}
    if not current or not saved:  # without parameter groups' records: the config's kind
        if BUILTIN_OPTIMIZERS.get(saved_kind, saved_kind) != BUILTIN_OPTIMIZERS.get(
            optimizer_kind, optimizer_kind
        ):
            raise CheckpointError(
                f"{file}: saved with optimizer {saved_kind!r}, the manager uses {optimizer_kind!r}"
            )
        return
    for name, label in current.items():
        if saved.get(name) != label:
            raise CheckpointError(
                f"{file}: parameter {name} was trained with optimizer {saved.get(name)!r}, "
                f"the manager updates it with {label!r}; give it the same optimizer"
            )


def read_shards(
    directory: Path,
    layouts: Mapping[str, LayerLayout],
    *,
    optimizer_kind: str,
    streamed: bool = False,
    param_optimizers: Mapping[str, str] | None = None,
    owned: Mapping[str, list[str]] | None = None,
    uneven: bool = False,
) -> LoadedShards:
    """Read this rank's slices (per its current layouts) of the checkpoint in ``directory``.

    With ``streamed``, only the gradient slices are read now; the files are checked
    (every rank's holds the same tensors, in the saved shapes) and each layer's master
    and state are read when :meth:`LoadedShards.layer` asks for them.

    Args:
        directory: the checkpoint directory.
        layouts: this rank's layouts now.
        optimizer_kind: the config's optimizer kind.
        streamed: read each layer's master and state when asked (the disk tier).
        param_optimizers: each parameter's optimizer class now (see [Note: parameter
            groups]); they must be the ones saved.
        owned: layer -> names (in the layer) of the whole parameters this rank owns now;
            their state is read from whichever rank's file holds it (see [Note: owned
            parameters]), so it loads at any world size.
        uneven: the ranks' files may hold different tensors (parameter groups cut the
            shards into segments, or whole parameters are owned): read every file's keys.

    Raises:
        CheckpointError: for missing, truncated or corrupt files, another model's
            checkpoint, or another optimizer's state.
    """
    meta = read_metadata(directory)
    _check_layout(meta, layouts, directory / METADATA)
    _check_optimizers(meta, optimizer_kind, param_optimizers or {}, directory / METADATA)
    world = meta["world_size"]
    reader = ShardReader(directory, world)
    # Every rank's file holds the same tensors unless the state is uneven across ranks
    # (segmented shards, whole parameters): then every file's keys are read.
    keys = reader.layer_keys() if uneven else reader.keys(0)
    with_params = {name: lay for name, lay in layouts.items() if lay.numel}
    # Each layer's shard length in the saved world (the saved files' tensor length).
    old_shards = {name: -(-lay.numel // world) for name, lay in with_params.items()}

    def read_layer(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lay, old_shard = with_params[name], old_shards[name]
        span = (lay.shard_start, lay.shard_end)
        state = {}
        for key in sorted(k for k in keys if k.startswith(f"{name}.optim.")):
            field = key.removeprefix(f"{name}.optim.")
            if field in meta["scalar_state"]:
                state[field] = reader.scalar(key)
            else:
                state[field] = reader.flat_range(key, old_shard, *span)
        return reader.flat_range(f"{name}.master", old_shard, *span), state

    grads = {}
    for name, lay in with_params.items():
        if f"{name}.grad" in keys:
            grads[name] = reader.flat_range(
                f"{name}.grad", old_shards[name], lay.shard_start, lay.shard_end
            )
    loaded = LoadedShards(
        masters={},
        optim={},
        grads=grads,
        meta=meta,
        names=list(with_params),
        frozen=_read_frozen(reader, meta, layouts, directory / METADATA),
    )
    for name, params in (owned or {}).items():
        found = {}
        for param in params:
            prefix = f"{name}.owned.{param}."
            for key in keys:
                field = key.removeprefix(prefix)
                if key.startswith(prefix) and "." not in field:
                    found[f"{param}.{field}"] = reader.whole(key)
        if found:
            loaded.owned[name] = found
    if streamed:
        _check_shapes(reader, old_shards, reader.keys(0), meta)
        loaded.read_layer = read_layer
        return loaded
    for name in with_params:
        loaded.masters[name], loaded.optim[name] = read_layer(name)
    return loaded


def _check_shapes(
    reader: ShardReader,
    old_shards: Mapping[str, int],
    keys: set[str],
    meta: dict[str, Any],
) -> None:
    """Every rank's file holds ``keys`` with the saved shard's shape (``old_shards``: each
    layer's saved shard length; a streamed load reads the data later, so what can be
    checked without reading it is checked now)."""
    world = reader.world
    for rank in range(world):
        if reader.keys(rank) != keys:
            raise CheckpointError(f"{reader.file(rank)}: holds other tensors than rank 0's file")
    for name, old_shard in old_shards.items():
        shape = [old_shard]
        optim = f"{name}.optim."
        flat = [
            k
            for k in keys
            if k in (f"{name}.master", f"{name}.grad")
            or (k.startswith(optim) and k.removeprefix(optim) not in meta["scalar_state"])
        ]
        for key in flat:
            for rank in range(world):
                if reader.shape(rank, key) != shape:
                    raise CheckpointError(
                        f"{reader.file(rank)}: {key} has shape {reader.shape(rank, key)}, "
                        f"the checkpoint's layout says {shape}"
                    )
