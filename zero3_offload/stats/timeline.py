"""Intervals of work on this rank, held in memory and logged as structured events.

Every interval (a layer's compute, a gather, a reduce-scatter, a wait, a CPU
job in a worker thread) is added once, here (:meth:`Timeline.add`): appended to a bounded
in-memory timeline (``get_performance_stats().timeline``) and logged as a
``work`` event with wall-clock ``start``/``end`` (seconds since the epoch, so
logs of several ranks line up), ``seconds``, ``bytes``, the ``worker`` thread
and the optimizer ``step`` it belongs to. ``zero3-offload analyze`` rebuilds
the timeline from these events.

Memory stays flat over a run: the timeline keeps the events of the last
``recent_steps`` optimizer steps only (and at most ``maxlen`` events whatever the
steps), so it is full after ``recent_steps`` steps, whatever the model's size;
run totals per kind are running sums. The log files hold every event.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import attrs

from zero3_offload.logging import get_logger
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.step_counter import StepCounter

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
    phase: str  # a Phase's work value: "forward", "backward", "step" or "rollback"
    start: float
    end: float
    worker: str  # thread name ("event-loop" for the thread that runs the layers)
    nbytes: int = 0
    step: int = 0  # steps closed before this interval began (StepCounter.steps)


class Timeline:
    """The intervals of work of the most recent optimizer steps, appended from any thread.

    Args:
        rank: this rank, carried by every logged event.
        counter: the run's step counts; each event carries ``counter.steps`` (a
            counter of its own when None).
        recent_steps: events of this many most recent steps are held in memory
            (the step in progress and the ones before it); older ones are
            dropped as new events arrive. A step of the default
            ``zero3-offload train`` job adds about 70 events, so the default
            holds about 1,100 of them (about 0.25 MB).
        maxlen: at most this many events are held whatever the steps (oldest
            dropped first), for a model of very many layers or a run that
            never steps (inference); 100,000 events take about 22 MB
            (measured with tracemalloc).
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        counter: StepCounter | None = None,
        recent_steps: int = 16,
        maxlen: int = 100_000,
    ) -> None:
        if recent_steps < 1 or maxlen < 1:
            raise ValueError(f"recent_steps={recent_steps} and maxlen={maxlen} must be >= 1")
        self.rank = rank
        self._counter = counter if counter is not None else StepCounter()
        self._recent_steps = recent_steps
        self._events: deque[TimelineEvent] = deque(maxlen=maxlen)
        # kind -> [count, seconds, bytes] over the whole run (the deque forgets)
        self._totals: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    @property
    def recent_steps(self) -> int:
        """Steps whose events are held in memory."""
        return self._recent_steps

    @property
    def maxlen(self) -> int:
        """Most events held in memory."""
        maxlen = self._events.maxlen
        assert maxlen is not None  # set in __init__
        return maxlen

    def add(
        self,
        kind: str,
        layer: str,
        phase: Phase,
        start: float,
        end: float,
        worker: str = LOOP_THREAD,
        *,
        nbytes: int = 0,
    ) -> None:
        """Add one interval (``time.perf_counter`` seconds) and log it."""
        step = self._counter.steps
        event = TimelineEvent(kind, layer, phase.work.value, start, end, worker, nbytes, step)
        with self._lock:
            events = self._events
            events.append(event)
            # Drop the events of steps before the last recent_steps (added in step order, so
            # they are at the left), and those of steps after this one (a checkpoint of an
            # earlier step was loaded: they belong to a run that no longer exists).
            oldest = step - self._recent_steps + 1
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
            phase=event.phase,
            start=wall_time(start),
            end=wall_time(end),
            seconds=end - start,
            bytes=nbytes,
            worker=worker,
        )

    def totals(self) -> dict[str, tuple[int, float, int]]:
        """(count, seconds, bytes) added per kind since construction."""
        with self._lock:
            return {k: (int(v[0]), v[1], int(v[2])) for k, v in self._totals.items()}

    def seconds(self, kind: str) -> float:
        """Seconds added for ``kind`` since construction."""
        with self._lock:
            return self._totals.get(kind, [0, 0.0, 0])[1]

    def events(self) -> list[TimelineEvent]:
        """A snapshot of the events held (those of the last ``recent_steps`` steps), oldest
        first."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
