"""``BudgetChooser``: what ``Zero3CpuOffloadManager.from_pretrained(memory_per_rank=...)``
takes: an object that replaces a configuration's memory options with those chosen for a
memory budget (``zero3_offload.plan.MemoryBudget``, whose planner sits above the manager:
it calibrates by running managers)."""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from zero3_offload.config import Zero3CpuOffloadConfig

__all__ = ["BudgetChooser"]


@runtime_checkable
class BudgetChooser(Protocol):
    """Chooses a manager's configuration for a memory budget, the same on every rank."""

    def choose(
        self,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        path: str | os.PathLike[str],
        peft_config: Any,
    ) -> Zero3CpuOffloadConfig:
        """``config`` with the chosen memory options for the model directory ``path``
        (a collective over ``process_group``)."""
        ...
