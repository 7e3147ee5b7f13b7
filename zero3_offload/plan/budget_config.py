"""``config_for_budget()``: a manager's configuration chosen by the planner for a memory
budget per rank, a model directory and a micro-batch shape, the same on every rank
(``Zero3CpuOffloadManager.from_pretrained(..., memory_per_rank=MemoryBudget(...))``
calls it)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from zero3_offload import logging as zlogging
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError
from zero3_offload.plan.budget_search import choose_config
from zero3_offload.plan.calibrate import load_or_measure
from zero3_offload.plan.planner import local_ranks
from zero3_offload.train.options import TrainOptions, parse_size

__all__ = ["config_for_budget"]

log = zlogging.get_logger(__name__)

# What a micro-batch shape fixes: the search keeps the caller's batch and accumulation.
_FIXED = ("gradient_accumulation_steps", "sequence_parallel_size", "batch_split")


def config_for_budget(
    config: Zero3CpuOffloadConfig,
    process_group: dist.ProcessGroup,
    path: str | os.PathLike[str],
    memory_per_rank: int | str | None,
    batch_shape: tuple[int, int] | None,
    peft_config: Any = None,
) -> Zero3CpuOffloadConfig:
    """``config`` with the memory options the planner chooses for ``memory_per_rank``
    bytes per rank (an integer, or a size such as ``"6GiB"``); ``config`` itself when
    ``memory_per_rank`` is None. A collective: rank 0 plans and broadcasts its choice.

    The micro-batch ``batch_shape`` (sequences, tokens per sequence) is the caller's,
    so the search keeps it, the accumulation and the sequence parallelism as given.

    Raises:
        ConfigError: no ``batch_shape``, or no configuration fits (the message names
            the smallest peak and what holds it), or rank 0 could not plan (e.g. an
            unreadable ``config.json``); raised on every rank.
    """
    if memory_per_rank is None:
        return config
    budget = parse_size(memory_per_rank)
    if batch_shape is None:
        raise ConfigError(
            "memory_per_rank needs batch_shape=(sequences, tokens): the micro-batch each "
            "rank passes to forward, which the plan is for"
        )
    chosen: list[Any] = [None]
    failure: Exception | None = None
    if process_group.rank() == 0:
        try:
            opts = TrainOptions(
                model=str(path),
                world_size=process_group.size(),
                batch_size=batch_shape[0],
                seq_len=batch_shape[1],
            )
            # Figures measured, if they must be, in a process of their own.
            calibration = load_or_measure(local_ranks(opts.world_size), isolated=True)
            choice = choose_config(
                opts, config, budget, fixed=_FIXED, calibration=calibration, peft_config=peft_config
            )
            chosen[0] = choice.chosen.zero3.to_dict()
            log.info(
                "memory_per_rank_chosen",
                budget=budget,
                peak=choice.chosen.plan.host_peak_bytes,
                changes=choice.chosen.changes,
            )
        except Exception as exc:  # every rank raises it, not rank 0 alone
            failure = exc
            chosen[0] = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(chosen, src=0, group=process_group)
    if isinstance(chosen[0], str):
        raise ConfigError(f"memory_per_rank={memory_per_rank}: {chosen[0]}") from failure
    return Zero3CpuOffloadConfig.from_dict(chosen[0])
