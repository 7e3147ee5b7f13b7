"""Parameters (the Rust module's ``parameter_management.rs``): layouts, shards, gathering.

- ``rank_mapping``: which slice of each flat buffer a rank owns;
- ``flat_layout``: each layer's parameters laid end to end, padded;
- ``codec``: the compute copy's compression format (fp16, bf16, int8, nf4);
- ``nf4``: QLoRA's 4-bit NormalFloat code (blocks of 64), and its public pure functions;
- ``store``: this rank's fp32 master shards and their compute copies;
- ``gatherer``: all-gathering layers on the device, binding and releasing them;
- ``meta_init``: materialising meta-device layers one at a time.
"""

from zero3_offload.parameter.codec import CompressedShard, ShardCodec
from zero3_offload.parameter.flat_layout import LayerLayout, ParamSlot, build_layouts
from zero3_offload.parameter.gatherer import GatherHandle, ParameterGatherer
from zero3_offload.parameter.meta_init import (
    InitFn,
    reset_parameters_in_order,
    shard_initial_values,
)
from zero3_offload.parameter.nf4 import (
    NF4_BLOCK,
    NF4_CODE,
    nf4_dequantize,
    nf4_quantize,
    nf4_roundtrip,
)
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.parameter.store import ParameterStore

__all__ = [
    "NF4_BLOCK",
    "NF4_CODE",
    "CompressedShard",
    "GatherHandle",
    "InitFn",
    "LayerLayout",
    "ParamSlot",
    "ParameterGatherer",
    "ParameterStore",
    "ShardCodec",
    "Zero3RankMapping",
    "build_layouts",
    "nf4_dequantize",
    "nf4_quantize",
    "nf4_roundtrip",
    "reset_parameters_in_order",
    "shard_initial_values",
]
