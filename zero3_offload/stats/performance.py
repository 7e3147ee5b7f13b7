"""Performance statistics (torsh's ``stats.rs``), measured with monotonic clocks and CUDA events.

Definitions (all per rank):

- *compute time*: sum of the layers' forward and backward compute intervals on
  the event loop's thread (``time.perf_counter`` around the layer call).
- *step wall time*: from the first ``forward_pass`` of an accumulation window
  to the end of the ``optimizer_step`` that updates.
- *training efficiency*: compute time / step wall time.
- *exposed communication*: time the compute thread waited for a gather, a
  reduce-scatter or a copy to finish (the ``wait`` intervals), i.e. the
  communication that did not overlap with compute.
- *collective time*: launch-to-completion of each collective, from the
  collective itself, with the bytes of the tensors it moved.
- *transfers*: host-to-device copies of compute copies and device-to-host
  copies of gradient shards, timed with CUDA events (none on a CPU device).
"""

from __future__ import annotations

import attrs

from zero3_offload.stats.timeline import Timeline, TimelineEvent

__all__ = [
    "CommunicationStats",
    "LayerTimingStats",
    "TransferStats",
    "Zero3PerformanceStats",
]


# Step times kept in memory: enough for a long run's statistics, bounded for a
# run of millions of steps (80 KB).
STEP_TIMES_KEPT = 10_000


@attrs.define
class LayerTimingStats:
    """Compute time of one layer, per phase."""

    forward_executions: int = 0
    backward_executions: int = 0
    total_forward_time: float = 0.0
    total_backward_time: float = 0.0


@attrs.define
class CommunicationStats:
    """Operations, seconds and bytes of one kind of collective."""

    operations: int = 0
    time: float = 0.0
    bytes: int = 0


@attrs.define
class TransferStats:
    """Copies in one direction between host and device."""

    transfers: int = 0
    time: float = 0.0
    bytes: int = 0


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
    total_step_time: float = 0.0
    """Sum of step wall times (see the module docstring)."""
    total_compute_time: float = 0.0
    """Sum of layer compute intervals."""
    exposed_communication_time: float = 0.0
    """Sum of the compute thread's waits on gathers, reduce-scatters and copies."""
    step_times: list[float] = attrs.Factory(list)
    """Wall time of each update step (the last ``STEP_TIMES_KEPT``)."""
    transfers: dict[str, TransferStats] = attrs.Factory(dict)
    """``"h2d"`` / ``"d2h"`` copies, and the disk tier's ``"disk_read"`` / ``"disk_write"``:
    count, seconds, bytes."""
    layer_timings: dict[str, LayerTimingStats] = attrs.Factory(dict)
    communication: dict[str, CommunicationStats] = attrs.Factory(dict)
    timeline: list[TimelineEvent] = attrs.Factory(list)
    """The intervals of work of the last ``Timeline.steps_kept`` optimizer steps (filled in
    snapshots from :class:`Timeline`)."""
    prefetch: dict[str, int] = attrs.Factory(dict)
    """Prefetch counters (requests, hits, partial_hits, misses, wasted, cancelled, ...)."""
    prefetch_hit_rate: float = 0.0
    """Fraction of layer uses whose gather started before the layer needed it."""
    gathered_high_water_bytes: int = 0
    """Most bytes of gathered plus in-flight parameter buffers at once."""
    speculative_rollbacks: int = 0
    """Steps whose speculative updates were undone (clipping applied, or inf/nan found)."""

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

    def record_step(self, seconds: float) -> None:
        self.total_step_time += seconds
        self.step_times = [*self.step_times[1 - STEP_TIMES_KEPT :], seconds]

    def training_efficiency(self) -> float:
        """Compute time / step wall time (0 before the first update)."""
        return self.total_compute_time / self.total_step_time if self.total_step_time else 0.0

    def snapshot(
        self,
        timeline: Timeline,
        *,
        prefetch: dict[str, int],
        prefetch_hit_rate: float,
        gathered_high_water_bytes: int,
    ) -> Zero3PerformanceStats:
        """An independent copy completed with the timeline's totals and the given figures.

        Args:
            timeline: this rank's timeline (compute, wait and copy totals; recent events).
            prefetch: the prefetcher's counters.
            prefetch_hit_rate: fraction of layer uses whose gather started ahead.
            gathered_high_water_bytes: most gathered plus in-flight parameter bytes.
        """
        totals = timeline.totals()
        return attrs.evolve(
            self,
            layer_timings={k: attrs.evolve(v) for k, v in self.layer_timings.items()},
            communication={k: attrs.evolve(v) for k, v in self.communication.items()},
            transfers={
                kind: TransferStats(transfers=count, time=seconds, bytes=nbytes)
                for kind, (count, seconds, nbytes) in totals.items()
                if kind in ("h2d", "d2h")
            },
            step_times=list(self.step_times),
            timeline=timeline.events(),
            prefetch=dict(prefetch),
            prefetch_hit_rate=prefetch_hit_rate,
            gathered_high_water_bytes=gathered_high_water_bytes,
            total_compute_time=totals.get("compute", (0, 0.0, 0))[1],
            exposed_communication_time=totals.get("wait", (0, 0.0, 0))[1],
        )
