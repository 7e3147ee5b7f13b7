"""The clock of passes, shared by both runners: the accumulation window, pass and compute times.

Chain mode (``forward_pass``/``backward_pass``) and module mode
(``forward``/``backward``) count their passes here, through the same three
calls, so both modes measure the same things the same way:

- :meth:`PassClock.start` at the start of a pass. A training forward
  (:attr:`Phase.FORWARD`) opens the accumulation window if none is open; an
  evaluation forward (under ``torch.no_grad()``) or a generation never does, so
  the next ``step`` event's seconds do not include them.
- :meth:`PassClock.compute` for each layer's (unit's) compute interval.
- :meth:`PassClock.finish` when the pass succeeded: its count and seconds.

The ``step`` event (:class:`~zero3_offload.stats.step_log.StepLog`) ends the
window with :meth:`PassClock.end_window`.
"""

from __future__ import annotations

import time

from zero3_offload.stats.performance import Zero3PerformanceStats
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

__all__ = ["PassClock"]


class PassClock:
    """Times passes and layers' compute for both runners; owns the window's start.

    Args:
        stats: where pass counts, pass seconds and per-layer compute seconds add up.
        timeline: where compute intervals are added.
    """

    def __init__(self, *, stats: Zero3PerformanceStats, timeline: Timeline) -> None:
        self._stats = stats
        self._timeline = timeline
        self._window: float | None = None  # perf_counter at the window's first training forward

    def start(self, phase: Phase) -> float:
        """A pass of ``phase`` starts now; returns the time (``time.perf_counter``)."""
        now = time.perf_counter()
        if phase.trains and self._window is None:
            self._window = now
        return now

    def compute(self, layer: str, phase: Phase, started: float) -> None:
        """``layer``'s compute in ``phase`` ran from ``started`` until now."""
        ended = time.perf_counter()
        self._stats.add_layer_time(layer, phase, ended - started)
        self._timeline.add("compute", layer, phase, started, ended)

    def finish(self, phase: Phase, started: float, *, samples: int = 0) -> None:
        """The pass of ``phase`` that :meth:`start` returned ``started`` for succeeded."""
        self._stats.add_pass(phase, time.perf_counter() - started, samples=samples)

    def end_window(self, ended: float) -> float:
        """Close the accumulation window at ``ended``; returns its start (``ended`` when no
        training forward opened it)."""
        started = self._window if self._window is not None else ended
        self._window = None
        return started

    def reset(self) -> None:
        """Forget the open window (its micro-steps were dropped)."""
        self._window = None
