"""``save_pretrained`` of a ZeRO-3 run: units gathered one at a time, rank 0 writes them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch

from zero3_offload.checkpoint.full_state import FullState
from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import CheckpointError, Zero3Error
from zero3_offload.integrations.merged_lora_state import MergedLoraState
from zero3_offload.integrations.pretrained_writer import write_pretrained
from zero3_offload.logging import get_logger

__all__ = ["save_pretrained"]

log = get_logger(__name__)


async def save_pretrained(
    directory: str | os.PathLike[str],
    *,
    model_config: Any,
    full_state: FullState | MergedLoraState,
    comm: Collectives,
    max_shard_bytes: int,
    dtype: torch.dtype,
) -> Path:
    """Write a transformers model directory from the shards (a collective).

    Every rank gathers each unit in turn; rank 0 writes them from a worker thread
    as they arrive (see [Note: streamed pretrained writes]), holding at most one
    shard file's tensors. After a failure on rank 0 the other ranks still take part
    in the remaining gathers, then every rank raises.

    Raises:
        CheckpointError: when writing failed on rank 0 (every rank raises).
    """
    names = full_state.layers()
    done: list[str] = []
    error: BaseException | None = None
    if comm.rank == 0:
        loop = asyncio.get_running_loop()

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                future = asyncio.run_coroutine_threadsafe(full_state.layer(name), loop)
                done.append(name)
                yield from future.result()

        def write() -> object:
            return write_pretrained(
                directory, model_config, tensors(), max_shard_bytes=max_shard_bytes, dtype=dtype
            )

        try:
            await anyio.to_thread.run_sync(write)
        except Zero3Error as exc:
            error = exc
    # Every rank takes part in every gather, also after rank 0 failed.
    for name in names[len(done) :]:
        await full_state.layer(name)
    if not await comm.agree(error is None, what="save_pretrained's outcome"):
        raise CheckpointError(
            f"save_pretrained to {os.fspath(directory)} failed on rank 0"
            + (f": {error}" if error is not None else "")
        ) from error
    log.info("pretrained_saved", rank=comm.rank, path=os.fspath(directory))
    return Path(directory)
