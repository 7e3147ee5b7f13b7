"""Running layers with real autograd: forward, then backward through the kept graph or by
recomputation (what torsh's ``mod.rs`` stands in for with a placeholder linear layer)."""

from zero3_offload.execution.forward_record import ForwardRecord, RngState, SavedStep
from zero3_offload.execution.layer_runner import LayerRunner

__all__ = ["ForwardRecord", "LayerRunner", "RngState", "SavedStep"]
