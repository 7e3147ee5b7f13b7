"""Running layers with real autograd: forward, then backward through the kept graph or by
recomputation (where torsh's ``mod.rs`` runs a fixed linear layer instead of the model)."""

from zero3_offload.execution.forward_record import ForwardRecord, RngState, SavedStep
from zero3_offload.execution.layer_runner import LayerRunner

__all__ = ["ForwardRecord", "LayerRunner", "RngState", "SavedStep"]
