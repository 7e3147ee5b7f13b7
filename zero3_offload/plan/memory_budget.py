"""``MemoryBudget``: a peak resident memory per rank and the micro-batch it is for, given
to ``Zero3CpuOffloadManager.from_pretrained(..., memory_per_rank=MemoryBudget(...))``,
which trains the planner's choice (``config_for_budget``)."""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch.distributed as dist

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.plan.budget_config import config_for_budget
from zero3_offload.train.options import parse_size

__all__ = ["MemoryBudget"]


@attrs.frozen
class MemoryBudget:
    """``memory_per_rank``: bytes or a size such as ``"6GiB"``; ``batch_shape``: the
    (sequences, tokens per sequence) each rank will pass to ``forward``, which the plan is
    for (the search keeps it, the accumulation and the sequence parallelism)."""

    memory_per_rank: int = attrs.field(converter=parse_size)
    batch_shape: tuple[int, int] = attrs.field(converter=tuple)

    def choose(
        self,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        path: str | os.PathLike[str],
        peft_config: Any,
    ) -> Zero3CpuOffloadConfig:
        """The planner's fastest configuration that fits (see ``config_for_budget``)."""
        return config_for_budget(
            config, process_group, path, self.memory_per_rank, self.batch_shape, peft_config
        )
