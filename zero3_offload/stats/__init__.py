"""Statistics (torsh's ``stats.rs``): performance figures, the timeline, the step log.

Everything here is measured (clocks, CUDA events, tensor sizes), never estimated.
"""

from zero3_offload.stats.performance import (
    CommunicationStats,
    LayerTimingStats,
    TransferStats,
    Zero3PerformanceStats,
)
from zero3_offload.stats.step_log import StepLog
from zero3_offload.stats.tensor_bytes import storage_bytes, tensor_bytes
from zero3_offload.stats.timeline import Timeline, TimelineEvent

__all__ = [
    "CommunicationStats",
    "LayerTimingStats",
    "StepLog",
    "Timeline",
    "TimelineEvent",
    "TransferStats",
    "Zero3PerformanceStats",
    "storage_bytes",
    "tensor_bytes",
]
