"""Performance statistics (the Rust module's ``stats.rs``), measured with clocks and CUDA events.

Definitions (all per rank):

- *compute time*: sum of the layers' forward and backward compute intervals on
  the event loop's thread (``time.perf_counter`` around the layer call).
- *step wall time*: from the first training forward (``forward_pass`` or ``forward``
  with autograd on) of an accumulation window
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

from collections.abc import Mapping

import attrs

from zero3_offload.stats.phase import Phase
from zero3_offload.stats.step_counter import StepCounter
from zero3_offload.stats.timeline import Timeline, TimelineEvent

__all__ = ["LayerTimingStats", "OperationStats", "Zero3PerformanceStats"]


# Step times held in memory: enough for a long run's statistics, bounded for a
# run of millions of steps (80 KB).
STEP_TIMES_HELD = 10_000


@attrs.define
class LayerTimingStats:
    """Compute time of one layer, per phase."""

    forward_executions: int = 0
    backward_executions: int = 0
    total_forward_time: float = 0.0
    total_backward_time: float = 0.0


@attrs.define
class OperationStats:
    """Count, seconds and bytes of one kind of operation: a collective (``all_gather``,
    ``reduce_scatter``, ...) or a transfer (``h2d``, ``d2h``, ``disk_read``, ...)."""

    operations: int = 0
    time: float = 0.0
    bytes: int = 0

    def since(self, earlier: OperationStats) -> OperationStats:
        """The operations after ``earlier`` (an earlier copy of the same totals)."""
        return OperationStats(
            operations=self.operations - earlier.operations,
            time=self.time - earlier.time,
            bytes=self.bytes - earlier.bytes,
        )


@attrs.define
class Zero3PerformanceStats:
    """What this rank has done and how long it took."""

    forward_passes: int = 0
    backward_passes: int = 0
    optimizer_steps: int = 0
    """Steps that updated the parameters (:class:`StepCounter`'s ``updates``; filled in
    snapshots)."""
    micro_steps: int = 0
    """``optimizer_step`` calls (:class:`StepCounter`'s ``calls``; filled in snapshots)."""
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
    """Wall time of each closed step (the last ``STEP_TIMES_HELD``)."""
    transfers: dict[str, OperationStats] = attrs.Factory(dict)
    """``"h2d"`` / ``"d2h"`` copies, and the disk tier's ``"disk_read"`` / ``"disk_write"``:
    count, seconds, bytes."""
    layer_timings: dict[str, LayerTimingStats] = attrs.Factory(dict)
    communication: dict[str, OperationStats] = attrs.Factory(dict)
    """Collectives by op (``all_gather``, ``reduce_scatter``, ...): count, seconds, bytes."""
    timeline: list[TimelineEvent] = attrs.Factory(list)
    """The intervals of work of the last ``Timeline.recent_steps`` optimizer steps (filled in
    snapshots from :class:`Timeline`)."""
    prefetch: dict[str, int] = attrs.Factory(dict)
    """Prefetch counters (requests, hits, partial_hits, misses, wasted, cancelled, ...)."""
    prefetch_hit_rate: float = 0.0
    """Fraction of layer uses whose gather started before the layer needed it."""
    gathered_high_water_bytes: int = 0
    """Most bytes of gathered plus in-flight parameter buffers at once."""
    speculative_rollbacks: int = 0
    """Steps whose speculative updates were undone (clipping applied, or inf/nan found;
    filled in snapshots)."""
    nonfinite_skips: int = 0
    """Steps ``skip_nonfinite_steps`` skipped for an inf/nan gradient in this process (fp16
    overflows included; filled in snapshots)."""

    def add_pass(self, phase: Phase, seconds: float, *, samples: int = 0) -> None:
        """Count one forward (any kind) or backward pass of ``seconds``."""
        if phase is Phase.BACKWARD:
            self.backward_passes += 1
            self.total_backward_time += seconds
            return
        self.forward_passes += 1
        self.forward_samples += samples
        self.total_forward_time += seconds

    def add_optimizer_time(self, seconds: float) -> None:
        """Count the seconds of one updating ``optimizer_step``."""
        self.total_optimizer_time += seconds

    def add_layer_time(self, layer: str, phase: Phase, seconds: float) -> None:
        """Count one compute interval of ``layer`` (a forward kind, or backward)."""
        timing = self.layer_timings.setdefault(layer, LayerTimingStats())
        if phase.work is Phase.FORWARD:
            timing.forward_executions += 1
            timing.total_forward_time += seconds
        else:
            timing.backward_executions += 1
            timing.total_backward_time += seconds

    def add_collective(self, op: str, seconds: float, nbytes: int) -> None:
        """Count one completed collective (the collectives' observer)."""
        entry = self.communication.setdefault(op, OperationStats())
        entry.operations += 1
        entry.time += seconds
        entry.bytes += nbytes

    def add_step_time(self, seconds: float) -> None:
        """Count one closed step's wall time."""
        self.total_step_time += seconds
        self.step_times = [*self.step_times[1 - STEP_TIMES_HELD :], seconds]

    def training_efficiency(self) -> float:
        """Compute time / step wall time (0 before the first update)."""
        return self.total_compute_time / self.total_step_time if self.total_step_time else 0.0

    def snapshot(
        self,
        timeline: Timeline,
        *,
        counter: StepCounter,
        prefetch: dict[str, int],
        prefetch_hit_rate: float,
        gathered_high_water_bytes: int,
        speculative_rollbacks: int = 0,
        nonfinite_skips: int = 0,
        disk: Mapping[str, OperationStats] | None = None,
    ) -> Zero3PerformanceStats:
        """An independent copy completed with the timeline's totals and the given figures.

        Args:
            timeline: this rank's timeline (compute, wait and copy totals; recent events).
            counter: the run's step counts.
            prefetch: the prefetcher's counters.
            prefetch_hit_rate: fraction of layer uses whose gather started ahead.
            gathered_high_water_bytes: most gathered plus in-flight parameter bytes.
            speculative_rollbacks: steps whose speculative updates were undone.
            nonfinite_skips: steps skipped for an inf/nan gradient.
            disk: the disk tiers' ``disk_read`` / ``disk_write`` totals (none without a tier).
        """
        totals = timeline.totals()
        copies = {
            kind: OperationStats(operations=count, time=seconds, bytes=nbytes)
            for kind, (count, seconds, nbytes) in totals.items()
            if kind in ("h2d", "d2h")
        }
        return attrs.evolve(
            self,
            optimizer_steps=counter.updates,
            micro_steps=counter.calls,
            speculative_rollbacks=speculative_rollbacks,
            nonfinite_skips=nonfinite_skips,
            layer_timings={k: attrs.evolve(v) for k, v in self.layer_timings.items()},
            communication={k: attrs.evolve(v) for k, v in self.communication.items()},
            transfers={**copies, **(disk or {})},
            step_times=list(self.step_times),
            timeline=timeline.events(),
            prefetch=dict(prefetch),
            prefetch_hit_rate=prefetch_hit_rate,
            gathered_high_water_bytes=gathered_high_water_bytes,
            total_compute_time=totals.get("compute", (0, 0.0, 0))[1],
            exposed_communication_time=totals.get("wait", (0, 0.0, 0))[1],
        )
