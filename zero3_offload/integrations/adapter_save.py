"""``save_pretrained`` of a peft model: the adapter directory ``PeftModel.from_pretrained`` loads.

[Note: adapter saves]
A peft model (LoRA, ...) trains only its adapter parameters; the base model's are
frozen (see [Note: frozen parameters]). Its ``save_pretrained`` writes what peft's own
``save_pretrained`` writes: ``adapter_config.json`` and ``adapter_model.safetensors``
with the adapter's parameters named as peft names them (the adapter name removed).
Only the trainable parts of the units are gathered (every rank takes part; rank 0
writes), so the base model's values never leave their shards. The names and the
selection are peft's own (``get_peft_model_state_dict`` over the gathered values).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch
from torch import nn

from zero3_offload.checkpoint.full_state import FullState
from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import CheckpointError
from zero3_offload.logging import get_logger

__all__ = ["is_peft_model", "save_adapter"]

log = get_logger(__name__)

_ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a peft model (it has adapters and a base model)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


async def save_adapter(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    full_state: FullState,
    comm: Collectives,
    dtype: torch.dtype,
) -> Path:
    """Write ``model``'s adapter directory from the shards (a collective; see [Note:
    adapter saves]).

    Raises:
        CheckpointError: when ``directory`` is not empty, or writing failed on rank 0
            (every rank raises).
    """
    trainable: dict[str, torch.Tensor] = {}
    for name in full_state.layers():
        trainable.update(await full_state.layer(name, frozen=False))
    target = Path(directory)
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            await anyio.to_thread.run_sync(_write, target, model, trainable, dtype)
        except (OSError, ValueError, RuntimeError, CheckpointError) as exc:
            error = exc
    if not await comm.agree(error is None, what="save_pretrained's outcome"):
        raise CheckpointError(
            f"save_pretrained of the adapter to {os.fspath(directory)} failed on rank 0"
            + (f": {error}" if error is not None else "")
        ) from error
    log.info("adapter_saved", rank=comm.rank, path=os.fspath(directory), tensors=len(trainable))
    return target


def _write(
    target: Path, model: Any, trainable: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} is not empty: save_pretrained writes a new directory")
    state = get_peft_model_state_dict(model, state_dict=trainable)
    target.mkdir(parents=True, exist_ok=True)
    for adapter, config in model.peft_config.items():
        if adapter != "default":
            continue
        config.save_pretrained(os.fspath(target))
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(tensors, os.fspath(target / _ADAPTER_WEIGHTS), metadata={"format": "pt"})
