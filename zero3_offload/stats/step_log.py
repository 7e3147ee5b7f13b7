"""The ``step`` event: one structured log line per optimizer step, with this step's figures.

``zero3-offload analyze`` reads these lines (see ``analyze.logs``). Compute and
wait seconds are this step's own, the differences of the timeline's run totals
since the previous ``step`` event, and so are the collectives' operations,
seconds and bytes (``collectives``, by op, from the performance stats); memory
figures are those counted at the end of the step.
"""

from __future__ import annotations

from typing import Any

import attrs

from zero3_offload.logging import get_logger
from zero3_offload.stats.performance import CommunicationStats, Zero3PerformanceStats
from zero3_offload.stats.timeline import Timeline, wall_time

__all__ = ["StepLog"]

log = get_logger(__name__)


class StepLog:
    """Closes a step: records its wall time in the stats and logs its ``step`` event.

    Args:
        timeline: this rank's timeline (its ``step`` counter advances here).
        stats: this rank's performance stats (the step time is recorded there).
    """

    def __init__(self, timeline: Timeline, stats: Zero3PerformanceStats) -> None:
        self._timeline = timeline
        self._stats = stats
        self._seen = {"compute": 0.0, "wait": 0.0}  # run totals at the previous step event
        self._comm_seen: dict[str, CommunicationStats] = {}  # op -> totals at that event

    def close_step(self, *, started: float, ended: float, stepped: bool, **figures: Any) -> None:
        """Log the step that ran from ``started`` to ``ended`` (``time.perf_counter``).

        Args:
            started: the first forward of the accumulation window.
            ended: the end of the updating ``optimizer_step``.
            stepped: whether the parameters were updated (False: an fp16 skip).
            **figures: further fields of the event (memory bytes, pressure, ...).
        """
        self._stats.record_step(ended - started)
        per_step = {}
        for kind in self._seen:
            total = self._timeline.seconds(kind)
            per_step[f"{kind}_seconds"] = total - self._seen[kind]
            self._seen[kind] = total
        collectives = {}
        for op, now in self._stats.communication.items():
            seen = self._comm_seen.get(op, CommunicationStats())
            collectives[op] = {
                "operations": now.operations - seen.operations,
                "seconds": now.time - seen.time,
                "bytes": now.bytes - seen.bytes,
            }
            self._comm_seen[op] = attrs.evolve(now)
        log.info(
            "step",
            rank=self._timeline.rank,
            step=self._timeline.step,
            stepped=stepped,
            start=wall_time(started),
            end=wall_time(ended),
            seconds=ended - started,
            **per_step,
            collectives=collectives,
            **figures,
        )
        self._timeline.step += 1
