"""Performance statistics, measured with monotonic clocks.

Times are wall-clock seconds from ``time.perf_counter`` around the awaited
work on this rank; communication figures come from the collectives themselves
(bytes of the tensors moved, launch-to-completion time).
"""

from __future__ import annotations

import threading
from collections import deque

import attrs

__all__ = [
    "CommunicationStats",
    "LayerTimingStats",
    "Timeline",
    "TimelineEvent",
    "Zero3PerformanceStats",
]


@attrs.frozen
class TimelineEvent:
    """One interval of work on this rank (``time.perf_counter`` seconds)."""

    kind: str  # e.g. "compute", "gather", "reduce-scatter", "cpu-optimizer", "compress"
    layer: str
    phase: str  # "forward", "backward" or "step"
    start: float
    end: float
    worker: str  # thread name (the event loop's thread for compute)


class Timeline:
    """The most recent intervals of work, appended from any thread.

    Args:
        maxlen: how many events are kept (oldest dropped first).
    """

    def __init__(self, maxlen: int = 100_000) -> None:
        self._events: deque[TimelineEvent] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def record(
        self, kind: str, layer: str, phase: str, start: float, end: float, worker: str
    ) -> None:
        with self._lock:
            self._events.append(TimelineEvent(kind, layer, phase, start, end, worker))

    def events(self) -> list[TimelineEvent]:
        """A snapshot, oldest first."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


@attrs.define
class LayerTimingStats:
    """Compute time of one layer, per phase."""

    forward_executions: int = 0
    backward_executions: int = 0
    total_forward_time: float = 0.0
    total_backward_time: float = 0.0

    def average_forward_time(self) -> float:
        return self.total_forward_time / self.forward_executions if self.forward_executions else 0.0

    def average_backward_time(self) -> float:
        return (
            self.total_backward_time / self.backward_executions if self.backward_executions else 0.0
        )


@attrs.define
class CommunicationStats:
    """Operations, seconds and bytes of one kind of collective."""

    operations: int = 0
    time: float = 0.0
    bytes: int = 0

    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes / self.time if self.time > 0 else 0.0


@attrs.define
class Zero3PerformanceStats:
    """What this rank has done and how long it took."""

    forward_passes: int = 0
    backward_passes: int = 0
    optimizer_steps: int = 0
    micro_steps: int = 0
    total_forward_time: float = 0.0
    total_backward_time: float = 0.0
    total_optimizer_time: float = 0.0
    forward_samples: int = 0
    layer_timings: dict[str, LayerTimingStats] = attrs.Factory(dict)
    communication: dict[str, CommunicationStats] = attrs.Factory(dict)
    timeline: list[TimelineEvent] = attrs.Factory(list)
    """Recent intervals of work (filled in snapshots from :class:`Timeline`)."""
    prefetch: dict[str, int] = attrs.Factory(dict)
    """Prefetch counters (requests, hits, partial_hits, misses, wasted, cancelled, ...)."""
    prefetch_hit_rate: float = 0.0
    """Fraction of layer uses whose gather started before the layer needed it."""
    gathered_high_water_bytes: int = 0
    """Most bytes of gathered plus in-flight parameter buffers at once."""

    def record_layer(self, layer: str, phase: str, seconds: float) -> None:
        timing = self.layer_timings.setdefault(layer, LayerTimingStats())
        if phase == "forward":
            timing.forward_executions += 1
            timing.total_forward_time += seconds
        else:
            timing.backward_executions += 1
            timing.total_backward_time += seconds

    def record_communication(self, op: str, seconds: float, nbytes: int) -> None:
        entry = self.communication.setdefault(op, CommunicationStats())
        entry.operations += 1
        entry.time += seconds
        entry.bytes += nbytes

    def average_forward_time(self) -> float:
        return self.total_forward_time / self.forward_passes if self.forward_passes else 0.0

    def average_backward_time(self) -> float:
        return self.total_backward_time / self.backward_passes if self.backward_passes else 0.0

    def average_optimizer_time(self) -> float:
        return self.total_optimizer_time / self.optimizer_steps if self.optimizer_steps else 0.0

    def copy(self) -> Zero3PerformanceStats:
        """An independent snapshot."""
        return attrs.evolve(
            self,
            layer_timings={k: attrs.evolve(v) for k, v in self.layer_timings.items()},
            communication={k: attrs.evolve(v) for k, v in self.communication.items()},
            prefetch=dict(self.prefetch),
        )
