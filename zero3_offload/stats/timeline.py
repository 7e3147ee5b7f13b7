"""Intervals of work on this rank, kept in memory and logged as structured events.

Every interval (a layer's compute, a gather, a reduce-scatter, a wait, a CPU
job in a worker thread) is recorded once, here: appended to a bounded
in-memory timeline (``get_performance_stats().timeline``) and logged as a
``work`` event with wall-clock ``start``/``end`` (seconds since the epoch, so
logs of several ranks line up), ``seconds``, ``bytes``, the ``worker`` thread
and the optimizer ``step`` it belongs to. ``zero3-offload analyze`` rebuilds
the timeline from these events.

Memory stays flat over a run: the timeline keeps the events of the last
``steps_kept`` optimizer steps only (and at most ``maxlen`` events whatever the
steps), so it is full after ``steps_kept`` steps, whatever the model's size;
run totals per kind are running sums. The log files hold every event.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import attrs

from zero3_offload.logging import get_logger

__all__ = ["LOOP_THREAD", "Timeline", "TimelineEvent", "wall_time"]

log = get_logger(__name__)

LOOP_THREAD = "event-loop"
_WALL_OFFSET = time.time() - time.perf_counter()


def wall_time(perf: float) -> float:
    """Seconds since the epoch of a ``time.perf_counter()`` reading of this process."""
    return _WALL_OFFSET + perf


@attrs.frozen
class TimelineEvent:
    """One interval of work on this rank (``time.perf_counter`` seconds)."""

    kind: str  # compute, gather, wait, reduce-scatter, release, cpu-optimizer, compress, ...
    layer: str
    phase: str  # "forward", "backward" or "step"
    start: float
    end: float
    worker: str  # thread name ("event-loop" for the thread that runs the layers)
    nbytes: int = 0
    step: int = 0  # optimizer updates completed before this interval began


class Timeline:
    """The intervals of work of the most recent optimizer steps, appended from any thread.

    Args:
        rank: this rank, carried by every logged event.
        steps_kept: events of this many most recent steps are kept in memory
            (the step in progress and the ones before it); older ones are
            dropped as new events arrive. A step of the default
            ``zero3-offload train`` job records about 70 events, so the default
            keeps about 1,100 of them (about 0.25 MB).
        maxlen: at most this many events are kept whatever the steps (oldest
            dropped first), for a model of very many layers or a run that
            never steps (inference); 100,000 events take about 22 MB
            (measured with tracemalloc).
    """

    def __init__(self, *, rank: int = 0, steps_kept: int = 16, maxlen: int = 100_000) -> None:
        if steps_kept < 1 or maxlen < 1:
            raise ValueError(f"steps_kept={steps_kept} and maxlen={maxlen} must be >= 1")
        self.rank = rank
        self.step = 0  # optimizer steps closed (StepLog advances it; checkpoints restore it)
        self._steps_kept = steps_kept
        self._events: deque[TimelineEvent] = deque(maxlen=maxlen)
        # kind -> [count, seconds, bytes] over the whole run (the deque forgets)
        self._totals: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    @property
    def steps_kept(self) -> int:
        """Steps whose events are kept in memory."""
        return self._steps_kept

    @property
    def maxlen(self) -> int:
        """Most events kept in memory."""
        maxlen = self._events.maxlen
        assert maxlen is not None  # set in __init__
        return maxlen

    def record(
        self,
        kind: str,
        layer: str,
        phase: str,
        start: float,
        end: float,
        worker: str = LOOP_THREAD,
        *,
        nbytes: int = 0,
    ) -> None:
        """Record one interval (``time.perf_counter`` seconds) and log it."""
        event = TimelineEvent(kind, layer, phase, start, end, worker, nbytes, self.step)
        with self._lock:
            events = self._events
            events.append(event)
            # Drop the events of steps before the last steps_kept (recorded in step order, so
            # they are at the left), and those of steps after this one (a checkpoint of an
            # earlier step was loaded: they belong to a run that no longer exists).
            oldest, step = self.step - self._steps_kept + 1, self.step
            while events and not oldest <= events[0].step <= step:
                events.popleft()
            total = self._totals.setdefault(kind, [0, 0.0, 0])
            total[0] += 1
            total[1] += end - start
            total[2] += nbytes
        log.info(
            "work",
            rank=self.rank,
            step=event.step,
            kind=kind,
            layer=layer,
            phase=phase,
            start=wall_time(start),
            end=wall_time(end),
            seconds=end - start,
            bytes=nbytes,
            worker=worker,
        )

    def totals(self) -> dict[str, tuple[int, float, int]]:
        """(count, seconds, bytes) recorded per kind since construction."""
        with self._lock:
            return {k: (int(v[0]), v[1], int(v[2])) for k, v in self._totals.items()}

    def seconds(self, kind: str) -> float:
        """Seconds recorded for ``kind`` since construction."""
        with self._lock:
            return self._totals.get(kind, [0, 0.0, 0])[1]

    def events(self) -> list[TimelineEvent]:
        """A snapshot of the events kept (those of the last ``steps_kept`` steps), oldest
        first."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
