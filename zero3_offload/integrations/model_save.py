"""Which directory ``save_pretrained`` writes: a transformers model, a peft adapter, or a
peft model with its adapters merged."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from zero3_offload.checkpoint.full_state import FullState
from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import InputError
from zero3_offload.integrations.adapter_save import is_peft_model, save_adapter
from zero3_offload.integrations.merged_lora_state import MergedLoraState
from zero3_offload.integrations.pretrained_save import save_pretrained

__all__ = ["save_model"]


async def save_model(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    full_state: FullState,
    comm: Collectives,
    max_shard_bytes: int,
    dtype: torch.dtype,
    merged: bool,
) -> Path:
    """Write ``model``'s directory (a collective): a peft model's adapter (see [Note:
    adapter saves]), or with ``merged`` its base model with the adapters merged (see
    [Note: merged saves]); any other model as itself.

    Raises:
        InputError: ``merged`` for a model without adapters, or an adapter that cannot
            be merged.
        CheckpointError: when writing failed on rank 0 (every rank raises).
    """
    peft = is_peft_model(model)
    if merged and not peft:
        raise InputError("merged=True applies to peft models: this model has no adapters")
    if peft and not merged:
        return await save_adapter(
            directory, model=model, full_state=full_state, comm=comm, dtype=dtype
        )
    values: FullState | MergedLoraState = full_state
    if merged:
        values = MergedLoraState(model=model, full_state=full_state)
        model = model.get_base_model()  # type: ignore[operator]
    return await save_pretrained(
        directory,
        model_config=model.config,
        full_state=values,
        comm=comm,
        max_shard_bytes=max_shard_bytes,
        dtype=dtype,
    )
