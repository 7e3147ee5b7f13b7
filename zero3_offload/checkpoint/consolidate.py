"""Consolidate a sharded checkpoint into one full fp32 state dict, tensor by tensor.

The output loads with ``model.load_state_dict(..., strict=True)`` into the plain
model (names as in ``model.named_parameters()``). A tied parameter (an embedding
shared with the LM head) is stored once, under its first name, as
``named_parameters()`` lists it: load such a model with ``strict=False`` (the
tie carries the value to the other name), or export it with
``zero3-offload export``. For safetensors output the
header (every name, shape and byte range) is known from the checkpoint's
metadata before any data is read, so the file is written in one pass: each
parameter is assembled from the slices of the rank files that hold it
(``safe_open(...).get_slice``), written, and dropped before the next one. Peak
memory stays near the largest parameter, not the model. ``.pt`` output needs
``torch.save`` of a whole dict, so it holds the full model in memory.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zero3_offload.checkpoint.format import read_metadata, resolve_checkpoint
from zero3_offload.checkpoint.shard_reader import ShardReader
from zero3_offload.errors import CheckpointError
from zero3_offload.parameter.flat_layout import param_key, saved_shard_numel

__all__ = ["consolidate_checkpoint", "iter_full_parameters"]

# safetensors requires the data to start at a multiple of 8 bytes: the JSON
# header is padded with spaces to that.
_ALIGN = 8
_FP32_BYTES = 4


def iter_full_parameters(
    path: str | os.PathLike[str],
) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """(name, shape, load) for every parameter of the checkpoint at ``path``.

    ``load()`` reads just that parameter's elements from the rank files.

    Raises:
        CheckpointError: for a missing or unreadable checkpoint.
    """
    directory = resolve_checkpoint(path)
    meta = read_metadata(directory)
    world = meta["world_size"]
    reader = ShardReader(directory, world)
    parts = [(layer, "master") for layer in meta["layers"]]
    if meta.get("frozen_saved", False):  # see [Note: frozen parameters]
        parts += [(layer, "frozen") for layer in meta.get("frozen_layers", [])]
    for layer, kind in parts:
        shard = saved_shard_numel(layer["numel"], world, layer.get("align", 1))
        key = f"{layer['name']}.{kind}"
        for param in layer["params"]:
            shape = tuple(param["shape"])
            load = functools.partial(
                _load_param, reader, key, shard, param["offset"], param["numel"], shape
            )
            yield param_key(layer["name"], param["name"]), shape, load


def _load_param(
    reader: ShardReader, key: str, shard: int, start: int, numel: int, shape: tuple[int, ...]
) -> torch.Tensor:
    return reader.flat_range(key, shard, start, start + numel).view(shape)


def consolidate_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fmt: str = "safetensors",
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the full fp32 parameters of a sharded checkpoint to one file.

    Args:
        path: a checkpoint directory or a root with a ``latest`` pointer.
        out: the output file (written to ``out.part`` first, then renamed).
        fmt: ``"safetensors"`` (streamed) or ``"pt"`` (``torch.save``; needs the
            whole model in memory).
        progress: called as ``progress(done, total)`` after each parameter.

    Returns:
        The written file.

    Raises:
        CheckpointError: for an unreadable checkpoint or an unknown format.
    """
    if fmt not in ("safetensors", "pt"):
        raise CheckpointError(f"fmt={fmt!r} is invalid: use 'safetensors' or 'pt'")
    params = list(iter_full_parameters(path))
    out = Path(out)
    part = out.with_name(out.name + ".part")
    try:
        if fmt == "pt":
            state = {}
            for i, (name, _, load) in enumerate(params):
                state[name] = load()
                if progress:
                    progress(i + 1, len(params))
            torch.save(state, part)
        else:
            _write_safetensors(part, params, progress)
        part.replace(out)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {out}: {exc}") from exc
    return out


def _write_safetensors(
    part: Path,
    params: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]],
    progress: Callable[[int, int], None] | None,
) -> None:
    # safetensors layout: u64 little-endian header length, JSON header with each
    # tensor's dtype/shape/[begin, end) byte offsets into the data, then the data.
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in params:
        nbytes = _FP32_BYTES * _numel(shape)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _ALIGN)
    with part.open("wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for i, (_, _, load) in enumerate(params):
            fh.write(load().contiguous().numpy().data)  # no extra copy of the tensor
            if progress:
                progress(i + 1, len(params))
        fh.flush()
        os.fsync(fh.fileno())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
