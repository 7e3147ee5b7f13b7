"""Optimizer state (the Rust module's ``optimizer_state.rs``): per-shard optimizers, the step
runner, loss scaling."""

from zero3_offload.optimizer_state.loss_scaler import LossScaler
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.optimizer_state.step_runner import StepRunner

__all__ = ["LossScaler", "ShardOptimizers", "StepRunner"]
