"""A rank's checkpoint file written group by group, for state that is not all in memory.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype,
shape and byte range) and the data. The header needs only dtypes and shapes, so it
is written first and the data follow in the header's order, one group of tensors at
a time: with the disk tier (see [Note: disk tier]) a layer's master and state are
read into memory for the moment they are written. The bytes are those
``safetensors.torch.save_file`` writes for the same tensors (tensors ordered by
dtype, widest first, then name; the header padded with spaces to 8 bytes;
tested), so the checkpoint format is the same whichever way a file was written.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import attrs
import torch

__all__ = ["ShardEntry", "write_streamed"]

# safetensors' dtype names; its writer orders tensors by dtype (descending in its enum:
# I64, F64, F32, I32, BF16, F16, I16, I8, U8, BOOL of those here), then by name.
_NAMES = {
    torch.float64: ("F64", 8),
    torch.int64: ("I64", 8),
    torch.float32: ("F32", 4),
    torch.int32: ("I32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.int16: ("I16", 2),
    torch.int8: ("I8", 1),
    torch.uint8: ("U8", 1),
    torch.bool: ("BOOL", 1),
}
_RANK = {"I64": 0, "F64": 1, "F32": 2, "I32": 3, "BF16": 4, "F16": 5, "I16": 6, "I8": 7}
_RANK.update(U8=8, BOOL=9)


@attrs.frozen
class ShardEntry:
    """One tensor of the file: its name, dtype and shape, and the group whose
    ``open()`` gives it (the same group for the tensors read together)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    group: str


def _ordered(entries: Sequence[ShardEntry]) -> list[ShardEntry]:
    return sorted(entries, key=lambda e: (_RANK[_NAMES[e.dtype][0]], e.name))


def _header(entries: list[ShardEntry]) -> bytes:
    offset, fields = 0, []
    for e in entries:
        name, size = _NAMES[e.dtype]
        nbytes = size
        for dim in e.shape:
            nbytes *= dim
        info = {"dtype": name, "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        fields.append(json.dumps(e.name) + ":" + json.dumps(info, separators=(",", ":")))
        offset += nbytes
    text = ("{" + ",".join(fields) + "}").encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


async def write_streamed(
    path: Path,
    entries: Sequence[ShardEntry],
    open_group: Callable[[str], AbstractAsyncContextManager[dict[str, torch.Tensor]]],
    write: Callable[[Callable[[], None]], Awaitable[None]],
) -> None:
    """Write ``entries`` into ``path`` and fsync it: the header, then each group's
    tensors while ``open_group(group)`` holds them (a dict by entry name); ``write(fn)``
    runs the blocking write ``fn`` (in the caller's worker threads). A failure is
    raised as it is; ``atomic_save.write_shard_streamed`` removes the partial file and
    reports it."""
    ordered = _ordered(entries)
    with open(path, "wb") as f:
        f.write(_header(ordered))
        k = 0
        while k < len(ordered):
            group = ordered[k].group
            end = k
            while end < len(ordered) and ordered[end].group == group:
                end += 1
            async with open_group(group) as tensors:
                parts = [tensors[e.name] for e in ordered[k:end]]

                def put(parts: list[torch.Tensor] = parts) -> None:
                    for t in parts:
                        f.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy())

                await write(put)
            k = end
        f.flush()
        os.fsync(f.fileno())
