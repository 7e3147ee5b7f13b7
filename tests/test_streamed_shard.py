"""A checkpoint file written group by group is byte for byte the one safetensors writes;
a failed one leaves nothing behind."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zero3_offload.checkpoint.atomic_save import write_shard_streamed
from zero3_offload.checkpoint.streamed_shard import ShardEntry, write_streamed
from zero3_offload.errors import CheckpointError


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    # Names as the checkpoints have them (layer names with dots and digits), every dtype
    # order the writer knows, 0-dim scalars and an odd byte count.
    for layer in ("block1", "block10", "block2", "model.layers.1", "model.layers.10", "x"):
        out[f"{layer}.master"] = torch.randn(37, generator=gen)
        out[f"{layer}.optim.exp_avg"] = torch.randn(37, generator=gen)
        out[f"{layer}.optim.step"] = torch.tensor(3.0)
        out[f"{layer}.grad"] = torch.randn(5, 2, generator=gen)
    out["x.ids"] = torch.arange(7, dtype=torch.int64)
    out["x.half"] = torch.randn(9, generator=gen).to(torch.bfloat16)
    out["x.f16"] = torch.randn(3, generator=gen).to(torch.float16)
    out["x.bytes"] = torch.arange(5, dtype=torch.uint8)
    out["x.f64"] = torch.randn(2, generator=gen).double()
    return out


def group_of(name: str) -> str:
    return name.rsplit(".optim.", 1)[0].rsplit(".", 1)[0]


async def test_the_streamed_file_is_the_safetensors_file(tmp_path: Path) -> None:
    data = tensors()
    save_file(data, str(tmp_path / "reference.safetensors"))
    entries = [ShardEntry(k, v.dtype, tuple(v.shape), group_of(k)) for k, v in data.items()]
    opened: list[str] = []

    @contextlib.asynccontextmanager
    async def open_group(group: str) -> AsyncIterator[dict[str, torch.Tensor]]:
        opened.append(group)
        yield {k: v for k, v in data.items() if group_of(k) == group}

    async def write(fn: Callable[[], None]) -> None:
        fn()

    await write_streamed(tmp_path / "streamed.safetensors", entries, open_group, write)
    ref = (tmp_path / "reference.safetensors").read_bytes()
    assert (tmp_path / "streamed.safetensors").read_bytes() == ref
    # Each group was opened once, except where the writer's order interleaves groups.
    assert set(opened) == {group_of(k) for k in data}


async def test_a_failed_write_removes_the_partial_file(tmp_path: Path) -> None:
    data = tensors()
    entries = [ShardEntry(k, v.dtype, tuple(v.shape), group_of(k)) for k, v in data.items()]

    @contextlib.asynccontextmanager
    async def open_group(group: str) -> AsyncIterator[dict[str, torch.Tensor]]:
        yield {k: v for k, v in data.items() if group_of(k) == group}

    async def write(fn: Callable[[], None]) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left"):
        await write_shard_streamed(tmp_path, entries, open_group, write, 0, 1)
    assert not any(tmp_path.iterdir())  # neither the partial file nor the final one
