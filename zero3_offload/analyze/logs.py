"""Reading the JSON-lines logs that ranks write (one object per line).

The library logs a ``work`` event per interval and a ``step`` event per
optimizer update (see :mod:`zero3_offload.stats.timeline` and
:mod:`zero3_offload.stats.step_log`), and ``zero3-offload train`` a ``train_step``
event per step (its loss, tokens/s, valid tokens, padding fraction and examples
seen); every other event is only counted. A line that is not a JSON
object, or lacks a key its event type needs, is skipped and reported as
:class:`SkippedLine` (file, line number, reason) rather than stopping the
analysis, since the last line of a log whose process died is often cut short.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "RunLog",
    "SkippedLine",
    "StepRecord",
    "TrainStepRecord",
    "WorkRecord",
    "parse_record",
    "read_logs",
]


@attrs.frozen
class WorkRecord:
    """One interval of work on one rank (a ``work`` event)."""

    rank: int
    step: int  # optimizer updates completed on this rank when it was recorded
    kind: str  # compute, wait, gather, reduce-scatter, release, cpu-optimizer, h2d, ...
    layer: str
    phase: str  # forward, backward or step
    start: float  # wall clock, seconds since the epoch
    end: float
    seconds: float  # measured duration (what the library summed into its stats)
    nbytes: int
    worker: str  # thread ("event-loop", "comm", "copy" or a worker thread's name)


@attrs.frozen
class StepRecord:
    """The end of one optimizer update on one rank (a ``step`` event)."""

    rank: int
    step: int
    stepped: bool  # False when fp16 loss scaling skipped the update
    start: float  # first forward of the accumulation window (epoch seconds)
    end: float  # end of the optimizer step
    seconds: float
    compute_seconds: float  # this step's layer compute
    wait_seconds: float  # this step's waits of the compute thread (exposed communication)
    prefetch_hit_rate: float  # since the manager was built
    gathered_high_water_bytes: int
    process_rss_bytes: int | None = None
    device_allocated_bytes: int | None = None
    cpu_memory_used: int | None = None
    gpu_memory_used: int | None = None


@attrs.frozen
class TrainStepRecord:
    """One step of ``zero3-offload train`` as one rank logged it (a ``train_step`` event).

    The figures are the whole step's, summed over the ranks; the fields after
    ``seconds`` are absent (None) in logs of older versions.
    """

    rank: int
    step: int
    loss: float  # the step's global token mean (NaN without a learned token)
    seconds: float
    tokens_per_s: float | None = None  # tokens of examples or text windows, not padding
    valid_tokens: int | None = None  # learned (unmasked) label tokens
    padding_fraction: float | None = None
    examples_seen: int | None = None  # a run on examples: global examples consumed so far


@attrs.frozen
class SkippedLine:
    """A line that could not be used."""

    path: str
    line: int  # 1-based
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@attrs.define
class RunLog:
    """Every usable record of one or more log files, ranks merged."""

    files: list[str] = attrs.Factory(list)
    work: list[WorkRecord] = attrs.Factory(list)
    steps: list[StepRecord] = attrs.Factory(list)
    train_steps: list[TrainStepRecord] = attrs.Factory(list)
    other_events: Counter[str] = attrs.Factory(Counter)
    skipped: list[SkippedLine] = attrs.Factory(list)

    @property
    def ranks(self) -> list[int]:
        """Ranks that logged a work or step event, ascending."""
        return sorted({w.rank for w in self.work} | {s.rank for s in self.steps})


class _BadRecord(ValueError):
    pass


_NUMBER = (int, float)
# key -> accepted types, per event type; ints are also accepted for float fields.
_WORK_KEYS: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "step": (int,),
    "kind": (str,),
    "layer": (str,),
    "phase": (str,),
    "start": _NUMBER,
    "end": _NUMBER,
    "seconds": _NUMBER,
    "bytes": (int,),
    "worker": (str,),
}
_STEP_KEYS: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "step": (int,),
    "stepped": (bool,),
    "start": _NUMBER,
    "end": _NUMBER,
    "seconds": _NUMBER,
    "compute_seconds": _NUMBER,
    "wait_seconds": _NUMBER,
    "prefetch_hit_rate": _NUMBER,
    "gathered_high_water_bytes": (int,),
}
_STEP_OPTIONAL = (
    "process_rss_bytes",
    "device_allocated_bytes",
    "cpu_memory_used",
    "gpu_memory_used",
)


def _checked(obj: Mapping[str, Any], keys: Mapping[str, tuple[type, ...]]) -> dict[str, Any]:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise _BadRecord(f"{obj['event']} event lacks {', '.join(map(repr, missing))}")
    for key, types in keys.items():
        value = obj[key]
        # bool is an int subclass: accept it only where a bool is wanted.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise _BadRecord(
                f"{obj['event']} event has {key}={value!r}, expected {types[0].__name__}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise _BadRecord(f"{obj['event']} event has {key}={value!r}, expected a finite number")
    if obj["end"] < obj["start"]:
        raise _BadRecord(f"{obj['event']} event ends ({obj['end']}) before it starts")
    return {k: obj[k] for k in keys}


def _optional_int(obj: Mapping[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _optional_float(obj: Mapping[str, Any], key: str) -> float | None:
    value = obj.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def _train_step(obj: Mapping[str, Any]) -> TrainStepRecord:
    for key in ("rank", "step"):
        if not isinstance(obj.get(key), int) or isinstance(obj.get(key), bool):
            raise _BadRecord(f"train_step event has {key}={obj.get(key)!r}, expected int")
    loss, seconds = _optional_float(obj, "loss"), _optional_float(obj, "seconds")
    if loss is None or seconds is None:
        raise _BadRecord("train_step event lacks a numeric 'loss' or 'seconds'")
    return TrainStepRecord(
        rank=obj["rank"],
        step=obj["step"],
        loss=loss,
        seconds=seconds,
        tokens_per_s=_optional_float(obj, "tokens_per_s"),
        valid_tokens=_optional_int(obj, "valid_tokens"),
        padding_fraction=_optional_float(obj, "padding_fraction"),
        examples_seen=_optional_int(obj, "examples_seen"),
    )


def parse_record(text: str) -> WorkRecord | StepRecord | TrainStepRecord | str:
    """Parse one line.

    Returns:
        A :class:`WorkRecord`, :class:`StepRecord` or :class:`TrainStepRecord`, or
        the event name of any other event.

    Raises:
        ValueError: with the reason when the line is not usable.
    """
    try:
        obj = json.loads(text)  # NaN (a loss without learned tokens) is accepted
    except json.JSONDecodeError as exc:
        raise _BadRecord(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _BadRecord(f"a JSON {type(obj).__name__}, not an object")
    event = obj.get("event")
    if not isinstance(event, str):
        raise _BadRecord("no 'event' name")
    if event == "work":
        v = _checked(obj, _WORK_KEYS)
        return WorkRecord(
            rank=v["rank"],
            step=v["step"],
            kind=v["kind"],
            layer=v["layer"],
            phase=v["phase"],
            start=float(v["start"]),
            end=float(v["end"]),
            seconds=float(v["seconds"]),
            nbytes=v["bytes"],
            worker=v["worker"],
        )
    if event == "step":
        v = _checked(obj, _STEP_KEYS)
        return StepRecord(
            rank=v["rank"],
            step=v["step"],
            stepped=v["stepped"],
            start=float(v["start"]),
            end=float(v["end"]),
            seconds=float(v["seconds"]),
            compute_seconds=float(v["compute_seconds"]),
            wait_seconds=float(v["wait_seconds"]),
            prefetch_hit_rate=float(v["prefetch_hit_rate"]),
            gathered_high_water_bytes=v["gathered_high_water_bytes"],
            **{k: _optional_int(obj, k) for k in _STEP_OPTIONAL},
        )
    if event == "train_step":
        return _train_step(obj)
    return event


def _read_lines(log: RunLog, name: str, lines: Iterable[str]) -> None:
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            record = parse_record(text)
        except ValueError as exc:
            log.skipped.append(SkippedLine(name, number, str(exc)))
            continue
        if isinstance(record, WorkRecord):
            log.work.append(record)
        elif isinstance(record, StepRecord):
            log.steps.append(record)
        elif isinstance(record, TrainStepRecord):
            log.train_steps.append(record)
        else:
            log.other_events[record] += 1


def read_logs(paths: Iterable[str | Path]) -> RunLog:
    """Read JSON-lines logs of any ranks (a file may hold several ranks).

    Args:
        paths: log files, as written by ``zero3_offload.logging.configure(json_path=...)``.

    Returns:
        The usable records, sorted by rank and start time, and the skipped lines.

    Raises:
        OSError: when a file cannot be read (e.g. it does not exist).
    """
    log = RunLog()
    for path in paths:
        name = str(path)
        # Undecodable bytes become U+FFFD, so such a line fails as bad JSON.
        with Path(path).open(encoding="utf-8", errors="replace") as f:
            _read_lines(log, name, f)
        log.files.append(name)
    log.work.sort(key=lambda w: (w.rank, w.start, -w.end))
    log.steps.sort(key=lambda s: (s.rank, s.end))
    log.train_steps.sort(key=lambda s: (s.rank, s.step))
    return log
