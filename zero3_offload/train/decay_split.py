"""The parameter groups ``zero3-offload train`` gives the manager: HF Trainer's default
weight-decay split (no decay for biases and norm weights; see
``optimizer_state.decay_groups``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zero3_offload.config import OptimizerConfig, optimizer_class, optimizer_option_names
from zero3_offload.optimizer_state.decay_groups import decay_param_groups

__all__ = ["trainer_param_groups"]


def trainer_param_groups(
    model: nn.Module, optimizer: OptimizerConfig
) -> list[dict[str, Any]] | None:
    """HF Trainer's split of ``model``'s parameters for ``optimizer``: the decayed ones keep
    the configured weight decay, biases and norm weights get 0. None (one group) when the
    optimizer takes no weight decay or its weight decay is 0: there is nothing to split."""
    if "weight_decay" not in optimizer_option_names(optimizer_class(optimizer.kind)):
        return None
    if optimizer.torch_options().get("weight_decay", 1.0) == 0:
        return None
    return decay_param_groups(model)
