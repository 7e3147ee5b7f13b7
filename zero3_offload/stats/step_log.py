"""The ``step`` event: one structured log line per closed step, with this step's figures.

``zero3-offload analyze`` reads these lines (see ``analyze.logs``). Compute and
wait seconds are this step's own, the differences of the timeline's run totals
since the previous ``step`` event, and so are the collectives' operations,
seconds and bytes (``collectives``, by op, from the performance stats); memory
figures are those counted at the end of the step. A step is closed by every
updating ``optimizer_step`` (the ``gradient_accumulation_steps``-th call), also
when fp16 loss scaling or ``skip_nonfinite_steps`` skipped it (``stepped`` false).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from zero3_offload.logging import get_logger
from zero3_offload.stats.disk_io import CountedFile, disk_step_figures
from zero3_offload.stats.pass_clock import PassClock
from zero3_offload.stats.performance import OperationStats, Zero3PerformanceStats
from zero3_offload.stats.step_counter import StepCounter
from zero3_offload.stats.timeline import Timeline, wall_time

__all__ = ["StepLog"]

log = get_logger(__name__)


class StepLog:
    """Closes a step: counts it, records its wall time and logs its ``step`` event.

    Args:
        timeline: this rank's timeline (compute and wait totals).
        stats: this rank's performance stats (step and optimizer times add up there).
        counter: the run's step counts (the step is closed there).
        clock: the passes' clock (its window is the step's start).
    """

    def __init__(
        self,
        *,
        timeline: Timeline,
        stats: Zero3PerformanceStats,
        counter: StepCounter,
        clock: PassClock,
    ) -> None:
        self._timeline = timeline
        self._stats = stats
        self._counter = counter
        self._clock = clock
        self._seen = {"compute": 0.0, "wait": 0.0}  # run totals at the previous step event
        self._comm_seen: dict[str, OperationStats] = {}  # op -> totals at that event

    def close_step(
        self,
        *,
        updating: float,
        stepped: bool,
        memory: Mapping[str, int] | None = None,
        disk_files: Sequence[CountedFile] = (),
        ended: float | None = None,
        **figures: Any,
    ) -> None:
        """Close the step whose updates ran from ``updating`` until now (or ``ended``).

        Args:
            updating: ``time.perf_counter()`` when the updating ``optimizer_step`` began;
                the step itself ran from the window's first training forward.
            stepped: whether the parameters were updated (False: an fp16 skip).
            memory: memory figures counted at the end of the step (fields of the event).
            disk_files: the disk tiers' files: their reads and writes of this step are the
                event's ``disk`` field (none without a tier).
            ended: the end of the step (default: now).
            **figures: further fields of the event (pressure, loss scale, ...).
        """
        ended = time.perf_counter() if ended is None else ended
        if disk_files:
            figures["disk"] = disk_step_figures(disk_files)
        started = self._clock.end_window(ended)
        self._stats.add_optimizer_time(ended - updating)
        self._stats.add_step_time(ended - started)
        per_step = {}
        for kind in self._seen:
            total = self._timeline.seconds(kind)
            per_step[f"{kind}_seconds"] = total - self._seen[kind]
            self._seen[kind] = total
        collectives = {}
        for op, now in self._stats.communication.items():
            delta = now.since(self._comm_seen.get(op, OperationStats()))
            collectives[op] = {
                "operations": delta.operations,
                "seconds": delta.time,
                "bytes": delta.bytes,
            }
            self._comm_seen[op] = attrs.evolve(now)
        log.info(
            "step",
            rank=self._timeline.rank,
            step=self._counter.steps,
            stepped=stepped,
            start=wall_time(started),
            end=wall_time(ended),
            seconds=ended - started,
            **per_step,
            collectives=collectives,
            **(memory or {}),
            **figures,
        )
        self._counter.close_step(updated=stepped)
