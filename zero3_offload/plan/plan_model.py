"""``plan()``: the planner's Python face, for a model directory and a run's options."""

from __future__ import annotations

import os
from typing import Any

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.plan.calibrate import load_or_measure
from zero3_offload.plan.calibration import Calibration
from zero3_offload.plan.planner import local_ranks, plan_run
from zero3_offload.plan.run_plan import RunPlan
from zero3_offload.train.options import TrainOptions

__all__ = ["plan"]


def plan(
    model: str | os.PathLike[str],
    zero3: Zero3CpuOffloadConfig | None = None,
    *,
    calibration: Calibration | None = None,
    **train: Any,
) -> RunPlan:
    """Predict a run of ``zero3-offload train --model MODEL`` (see [Note: the plan's
    memory model]).

    Args:
        model: a local transformers directory (only its ``config.json`` is read).
        zero3: the configuration (default: ``Zero3CpuOffloadConfig()``).
        calibration: this machine's figures (default: cached, measured when missing).
        **train: fields of :class:`~zero3_offload.train.options.TrainOptions`:
            ``world_size``, ``batch_size``, ``seq_len``, ``lora``, ``peft_config``,
            ``freeze``, ``corpus_mb``, ...

    Raises:
        ConfigError: a bad option, or a model that cannot be built from its config.
        CheckpointError: no readable ``config.json``.
    """
    opts = TrainOptions(model=str(model), **train)
    cal = calibration or load_or_measure(local_ranks(opts.world_size))
    return plan_run(opts, zero3 or Zero3CpuOffloadConfig(), cal)
