"""Running the passes with real autograd (where the Rust module runs a fixed linear layer
instead of the model): ``ChainRunner`` for chains of layers, ``ModuleRunner`` for a model's
own code, one ``PassResult`` for both, and the landing of their reduce-scatters."""

from zero3_offload.execution.chain_runner import ChainRunner
from zero3_offload.execution.gradient_landing import GradientLanding
from zero3_offload.execution.layer_runner import LayerRunner
from zero3_offload.execution.module_runner import ModuleRunner
from zero3_offload.execution.pass_result import PassResult
from zero3_offload.execution.saved_step import RngState, SavedStep

__all__ = [
    "ChainRunner",
    "GradientLanding",
    "LayerRunner",
    "ModuleRunner",
    "PassResult",
    "RngState",
    "SavedStep",
]
