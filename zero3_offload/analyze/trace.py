"""Chrome trace-event JSON of the logged intervals, for Perfetto or chrome://tracing.

One process per rank (``pid`` = rank, named "rank N"); one thread track per
worker thread. Intervals on one track must nest or be disjoint for a trace
viewer to draw them, but some workers run several intervals at once (the
"comm" worker's gathers and reduce-scatters overlap each other, and all of
anyio's worker threads share one name), so each worker's intervals are spread
greedily over as few lanes as keep that rule; a worker with several lanes gets
tracks "comm #0", "comm #1", ...
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from zero3_offload.analyze.logs import RunLog, WorkRecord

__all__ = ["Track", "assign_tracks", "build_trace", "origin_of", "write_trace"]

_LOOP = "event-loop"
# Tracks of these workers come first, in this order; others follow by name.
_ORDER = {_LOOP: 0, "comm": 1, "copy": 2}


@attrs.frozen
class Track:
    """One lane of one rank: the intervals drawn on it (they nest or are disjoint)."""

    rank: int
    tid: int  # 1-based, unique within the rank
    name: str
    events: list[WorkRecord]
    instants: list[WorkRecord]  # zero-length intervals (e.g. release)


def _ns(seconds: float, origin: float) -> int:
    return round((seconds - origin) * 1e9)


def _lanes(events: Sequence[WorkRecord], origin: float) -> list[list[WorkRecord]]:
    # Longest first among equal starts, so a shorter interval nests in it.
    ordered = sorted(events, key=lambda w: (_ns(w.start, origin), -_ns(w.end, origin)))
    lanes: list[list[WorkRecord]] = []
    open_ends: list[list[int]] = []  # per lane: ends of the intervals still open, nested
    for w in ordered:
        start, end = _ns(w.start, origin), _ns(w.end, origin)
        for lane, stack in zip(lanes, open_ends, strict=True):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                lane.append(w)
                stack.append(end)
                break
        else:
            lanes.append([w])
            open_ends.append([end])
    return lanes


def origin_of(log: RunLog) -> float:
    """The earliest logged time (epoch seconds), the trace's zero."""
    times = [w.start for w in log.work] + [s.start for s in log.steps]
    return min(times, default=0.0)


def assign_tracks(log: RunLog, origin: float | None = None) -> dict[int, list[Track]]:
    """Every rank's tracks: per worker, lanes in which intervals nest or are disjoint.

    Args:
        log: the records.
        origin: the zero of the nanosecond grid on which overlaps are decided
            (default: :func:`origin_of`), so that the decision matches what a
            trace with that origin shows.
    """
    origin = origin_of(log) if origin is None else origin
    by_worker: dict[int, dict[str, list[WorkRecord]]] = defaultdict(lambda: defaultdict(list))
    for w in log.work:
        by_worker[w.rank][w.worker].append(w)
    tracks: dict[int, list[Track]] = {}
    for rank in sorted(by_worker):
        workers = by_worker[rank]
        out: list[Track] = []
        for worker in sorted(workers, key=lambda n: (_ORDER.get(n, len(_ORDER)), n)):
            spans = [w for w in workers[worker] if w.end > w.start]
            instants = [w for w in workers[worker] if w.end <= w.start]
            lanes = _lanes(spans, origin) or [[]]
            for i, lane in enumerate(lanes):
                name = worker if len(lanes) == 1 else f"{worker} #{i}"
                out.append(Track(rank, len(out) + 1, name, lane, instants if i == 0 else []))
        tracks[rank] = out
    return tracks


def _args(w: WorkRecord) -> dict[str, Any]:
    return {"layer": w.layer, "phase": w.phase, "step": w.step, "bytes": w.nbytes}


def build_trace(log: RunLog) -> dict[str, Any]:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``.

    Complete events (``ph: "X"``) carry ``ts``/``dur`` in microseconds since the
    earliest logged time (``otherData.origin_epoch_s``), on a nanosecond grid.
    Zero-length intervals (``release``) are instant events (``ph: "i"``).
    Step windows appear on a "steps" track of each rank.
    """
    origin = origin_of(log)
    events: list[dict[str, Any]] = []
    for rank, tracks in assign_tracks(log, origin).items():
        events.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for track in tracks:
            events.append(_meta("thread_name", rank, track.tid, {"name": track.name}))
            events.append(_meta("thread_sort_index", rank, track.tid, {"sort_index": track.tid}))
            for w in track.events:
                start, end = _ns(w.start, origin), _ns(w.end, origin)
                events.append(
                    {
                        "name": f"{w.kind} {w.layer}",
                        "cat": w.kind,
                        "ph": "X",
                        "ts": start / 1e3,
                        "dur": (end - start) / 1e3,
                        "pid": rank,
                        "tid": track.tid,
                        "args": _args(w),
                    }
                )
            for w in track.instants:
                events.append(
                    {
                        "name": f"{w.kind} {w.layer}",
                        "cat": w.kind,
                        "ph": "i",
                        "s": "t",
                        "ts": _ns(w.start, origin) / 1e3,
                        "pid": rank,
                        "tid": track.tid,
                        "args": _args(w),
                    }
                )
        steps = [s for s in log.steps if s.rank == rank]
        if steps:
            tid = len(tracks) + 1
            events.append(_meta("thread_name", rank, tid, {"name": "steps"}))
            events.append(_meta("thread_sort_index", rank, tid, {"sort_index": -1}))
            for s in steps:
                start, end = _ns(s.start, origin), _ns(s.end, origin)
                events.append(
                    {
                        "name": f"step {s.step}",
                        "cat": "step",
                        "ph": "X",
                        "ts": start / 1e3,
                        "dur": (end - start) / 1e3,
                        "pid": rank,
                        "tid": tid,
                        "args": {"stepped": s.stepped, "seconds": s.seconds},
                    }
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_epoch_s": origin, "files": list(log.files)},
    }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_trace(log: RunLog, path: str | Path) -> None:
    """Write :func:`build_trace` of ``log`` to ``path`` as JSON.

    Raises:
        OSError: when ``path`` cannot be written.
    """
    with Path(path).open("w", encoding="utf-8") as f:
        json.dump(build_trace(log), f)
