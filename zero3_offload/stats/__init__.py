"""Statistics (the Rust module's ``stats.rs``): performance figures, the timeline, the step
counts, the passes' clock and the step log.

Everything here is measured (clocks, CUDA events, tensor sizes), never estimated.
"""

from zero3_offload.stats.layer_seconds import layer_seconds
from zero3_offload.stats.pass_clock import PassClock
from zero3_offload.stats.performance import (
    LayerTimingStats,
    OperationStats,
    Zero3PerformanceStats,
)
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.step_counter import StepCounter
from zero3_offload.stats.step_log import StepLog
from zero3_offload.stats.tensor_bytes import storage_bytes, tensor_bytes
from zero3_offload.stats.timeline import Timeline, TimelineEvent

__all__ = [
    "LayerTimingStats",
    "OperationStats",
    "PassClock",
    "Phase",
    "StepCounter",
    "StepLog",
    "Timeline",
    "TimelineEvent",
    "Zero3PerformanceStats",
    "layer_seconds",
    "storage_bytes",
    "tensor_bytes",
]
