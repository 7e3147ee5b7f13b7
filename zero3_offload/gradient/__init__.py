"""Gradients (the Rust module's ``gradient_management.rs``): reduce-scatter and the gradient
store."""

from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.gradient.reducer import GradientReducer, GradientSlot, PendingGradient
from zero3_offload.gradient.store import GradientStore

__all__ = ["GradientBuffers", "GradientReducer", "GradientSlot", "GradientStore", "PendingGradient"]
