"""Intervals of work on this rank, kept in memory and logged as structured events.

Every interval (a layer's compute, a gather, a reduce-scatter, a wait, a CPU
job in a worker thread) is recorded once, here: appended to a bounded
in-memory timeline (``get_performance_stats().timeline``) and logged as a
``work`` event with wall-clock ``start``/``end`` (seconds since the epoch, so
logs of several ranks line up), ``seconds``, ``bytes``, the ``worker`` thread
and the optimizer ``step`` it belongs to. ``zero3-offload analyze`` rebuilds
the timeline from these events.
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
    """The most recent intervals of work, appended from any thread.

    Args:
        rank: this rank, carried by every logged event.
        maxlen: how many events are kept in memory (oldest dropped first); the
            default holds about 80 steps of a 100-layer model (a dozen events
            per layer and step) in about 22 MB (measured with tracemalloc).
    """

    def __init__(self, *, rank: int = 0, maxlen: int = 100_000) -> None:
        self.rank = rank
        self.step = 0  # optimizer steps closed (StepLog advances it; checkpoints restore it)
        self._events: deque[TimelineEvent] = deque(maxlen=maxlen)
        # kind -> [count, seconds, bytes] over the whole run (the deque forgets)
        self._totals: dict[str, list[float]] = {}
        self._lock = threading.Lock()

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
            self._events.append(event)
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
        """A snapshot, oldest first."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
