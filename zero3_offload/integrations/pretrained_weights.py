"""Reading element ranges of the safetensors weights of a local transformers model directory.

[Note: reading pretrained weights by slices]
Under ZeRO-3 a rank keeps only its shard of each layer's flat buffer: a range of
elements of the concatenation of the layer's flattened parameters. To load a
pretrained model, each rank asks :class:`PretrainedWeights` for elements
``[start, end)`` of each parameter that its shards overlap, so a rank reads only the
slices of its shards and no rank holds the whole model. The files are
memory-mapped; a range is read as at most ``2 * ndim - 1`` rectangular slices that
together hold exactly its elements, so only the bytes of the range are read, never a
whole tensor.

The directory is untrusted input: the index must be well-formed JSON, every file it
names must be a regular file inside the directory (no absolute paths, no ``..``, no
symlinks that resolve outside), every name it lists must be in the file it names, and
every header must parse. All of this is checked when the directory is opened, before
any tensor is read; failures raise :class:`~zero3_offload.errors.CheckpointError`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError

from zero3_offload.checkpoint.format import open_for_reading
from zero3_offload.errors import CheckpointError, StateError
from zero3_offload.logging import get_logger

__all__ = ["READ_ELEMENTS", "PretrainedWeights"]

_log = get_logger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype codes -> names of torch dtypes (looked up lazily: some are recent).
_DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class _Entry(NamedTuple):
    file: int  # index into PretrainedWeights._paths / _handles
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code, e.g. "BF16"


def _inside(root: Path, real_root: Path, file: object, source: Path) -> Path:
    """The path of weight file ``file`` named by ``source``, checked to be inside ``root``."""
    if not isinstance(file, str) or not file:
        raise CheckpointError(f"{source}: a weight file name is not a non-empty string: {file!r}")
    relative = Path(file)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(
            f"{source}: weight file {file!r} is outside the model directory {root}"
        )
    path = root / relative
    try:
        real = path.resolve()
        regular = real.is_file()
    except (OSError, ValueError) as exc:  # ValueError: e.g. an embedded NUL byte
        raise CheckpointError(f"{source}: cannot resolve weight file {file!r} ({exc})") from exc
    if not real.is_relative_to(real_root):
        raise CheckpointError(
            f"{source}: weight file {file!r} resolves to {real}, outside the model directory {root}"
        )
    if not regular:
        raise CheckpointError(f"{path}: missing (or not a regular file), named by {source}")
    return path


def _read_weight_map(index: Path) -> dict[str, str]:
    """The validated ``weight_map`` (tensor name -> file name) of a sharded model's index."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON
        raise CheckpointError(f"{index}: unreadable index ({exc})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' object naming the weight files")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: the file of {name!r} is not a string: {file!r}")
    return weight_map


# A read's slice holds this many elements at most (16 MiB of fp32): it is a tensor of its
# own until it is copied into the result.
READ_ELEMENTS = 1 << 22


def _boxes(shape: tuple[int, ...], start: int, end: int) -> Iterator[tuple[slice, ...]]:
    """Index tuples of rectangular slices that hold exactly elements ``[start, end)`` of the
    row-major flattened tensor of ``shape``, in order, none of more than ``READ_ELEMENTS``
    elements: whole rows of a dimension in runs that fit, a row larger than that in
    pieces of its own.

    Requires ``len(shape) >= 1`` and ``0 <= start < end <= prod(shape)``.
    """
    if len(shape) == 1:
        for lo in range(start, end, READ_ELEMENTS):
            yield (slice(lo, min(lo + READ_ELEMENTS, end)),)
        return
    row = math.prod(shape[1:])
    first, last = start // row, end // row  # row ``last`` holds element ``end`` (excluded)
    if first == last:  # inside one row
        for rest in _boxes(shape[1:], start - first * row, end - first * row):
            yield (slice(first, first + 1), *rest)
        return
    if start % row:  # the end of a partial first row
        for rest in _boxes(shape[1:], start % row, row):
            yield (slice(first, first + 1), *rest)
        first += 1
    if row > READ_ELEMENTS:  # whole rows, each in pieces
        for r in range(first, last):
            for rest in _boxes(shape[1:], 0, row):
                yield (slice(r, r + 1), *rest)
    else:  # whole rows, as many at a time as fit
        rows = READ_ELEMENTS // row
        for lo in range(first, last, rows):
            yield (slice(lo, min(lo + rows, last)),)
    if end % row:  # the start of a partial last row
        for rest in _boxes(shape[1:], 0, end % row):
            yield (slice(last, last + 1), *rest)


class PretrainedWeights:
    """An index of the safetensors weights of a local transformers model directory.

    Reads ``model.safetensors`` when present (as ``from_pretrained`` does), else
    ``model.safetensors.index.json`` and the shard files it names. See
    [Note: reading pretrained weights by slices]. Use as a context manager, or call
    :meth:`close`, to close the files.

    Args:
        directory: the model directory, as written by ``save_pretrained``.

    Raises:
        CheckpointError: when the directory, index or a file header is missing, malformed
            or names a file outside the directory, or the index lists a name that its
            file does not hold.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._paths: list[Path] = []
        self._handles: list[Any] = []
        self._entries: dict[str, _Entry] = {}
        self._closed = False
        try:
            self._index()
        except BaseException:
            self.close()
            raise
        _log.debug(
            "indexed pretrained weights",
            directory=str(self.directory),
            files=len(self._paths),
            tensors=len(self._entries),
        )

    def _index(self) -> None:
        root = self.directory
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory")
        real_root = root.resolve()
        single, index = root / _SINGLE_FILE, root / _INDEX_FILE
        if single.exists() or single.is_symlink():
            file = self._open(_inside(root, real_root, _SINGLE_FILE, root))
            held = self._handles[file].keys()  # safe_open handles are not iterable
            for name in held:
                self._entries[name] = self._describe(file, name)
            return
        if not index.is_file():
            raise CheckpointError(
                f"{root}: neither {_SINGLE_FILE} nor {_INDEX_FILE} (only safetensors weights "
                "are read)"
            )
        names_by_file: dict[str, list[str]] = {}
        for name, file in _read_weight_map(index).items():
            names_by_file.setdefault(file, []).append(name)
        for file_name, names in names_by_file.items():
            file = self._open(_inside(root, real_root, file_name, index))
            held = set(self._handles[file].keys())
            for name in names:
                if name not in held:
                    raise CheckpointError(f"{index}: lists {name!r} in {file_name}, which lacks it")
                self._entries[name] = self._describe(file, name)

    def _open(self, path: Path) -> int:
        """Open ``path``; its position in ``_paths`` and ``_handles``."""
        try:
            handle = open_for_reading(path)  # pread: only the slices asked for are copied
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
        self._paths.append(path)
        self._handles.append(handle)
        return len(self._handles) - 1

    def _describe(self, file: int, name: str) -> _Entry:
        try:
            piece = self._handles[file].get_slice(name)
            return _Entry(file, tuple(piece.get_shape()), piece.get_dtype())
        except SafetensorError as exc:
            raise CheckpointError(f"{self._paths[file]}: cannot read {name!r} ({exc})") from exc

    def _entry(self, name: str) -> _Entry:
        if self._closed:
            raise StateError(f"PretrainedWeights({self.directory}) is closed")
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.directory}: the weights hold no tensor {name!r}")
        return entry

    def names(self) -> list[str]:
        """The names of all tensors, sorted."""
        return sorted(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``.

        Raises:
            CheckpointError: when there is no tensor ``name``.
        """
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype in which tensor ``name`` is stored.

        Raises:
            CheckpointError: when there is no tensor ``name``, or its dtype is not one
                this version of torch has.
        """
        code = self._entry(name).dtype
        dtype = getattr(torch, _DTYPE_NAMES.get(code, ""), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{self.directory}: {name!r} has unsupported dtype {code}")
        return dtype

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def read_flat(
        self, name: str, start: int, end: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened in row-major order.

        Reads only those elements from the file (see
        [Note: reading pretrained weights by slices]); memory is the result plus one
        slice of the stored tensor at a time (at most ``READ_ELEMENTS`` elements).

        Args:
            out: a 1D float32 CPU tensor of ``end - start`` elements to write them into
                (a view of a larger buffer: no new result is allocated).

        Returns:
            ``out``, or a new contiguous float32 CPU tensor of ``end - start`` elements.

        Raises:
            CheckpointError: when there is no tensor ``name``, the range is not within
                ``[0, numel]``, or the file cannot be read.
            StateError: ``out`` is not 1D float32 of ``end - start`` elements.
        """
        entry = self._entry(name)
        self.dtype(name)  # refuse dtypes that torch lacks before reading
        numel = math.prod(entry.shape)
        for bound in (start, end):
            if not isinstance(bound, int) or isinstance(bound, bool):
                raise CheckpointError(f"{name!r}: range bounds must be ints, got {bound!r}")
        if not 0 <= start <= end <= numel:
            raise CheckpointError(
                f"{name!r}: range [{start}, {end}) is not within its {numel} elements"
            )
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (end - start,):
            raise StateError(
                f"{name!r}: read_flat writes {end - start} float32 elements, got a "
                f"{out.dtype} tensor of shape {tuple(out.shape)}"
            )
        if start == end:
            return out
        path, handle = self._paths[entry.file], self._handles[entry.file]
        try:
            if not entry.shape:  # 0-dim: one element
                out.copy_(handle.get_tensor(name).reshape(1))
                return out
            stored = handle.get_slice(name)
            filled = 0
            for box in _boxes(entry.shape, start, end):
                piece = stored[box].reshape(-1)
                out[filled : filled + piece.numel()].copy_(piece)
                filled += piece.numel()
                del piece  # not alive while the next slice is read
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot read {name!r} ({exc})") from exc
        if filled != end - start:
            raise CheckpointError(f"{path}: {name!r} read {filled} of {end - start} elements")
        return out

    def close(self) -> None:
        """Close the files; later reads raise :class:`~zero3_offload.errors.StateError`."""
        self._closed = True
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.__exit__(None, None, None)

    def __enter__(self) -> PretrainedWeights:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
