"""Prefetch (the Rust module's ``prefetch.rs``): the trace of pass orders and the look-ahead
scheduler."""

from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.prefetch.status import PrefetchMetrics, PrefetchQueueStatus
from zero3_offload.prefetch.trace import PassTrace

__all__ = [
    "PassTrace",
    "PrefetchMetrics",
    "PrefetchQueueStatus",
    "PrefetchScheduler",
]
