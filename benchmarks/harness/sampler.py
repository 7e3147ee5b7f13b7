"""The one sampler: processes read from outside through ``/proc`` (memory, threads, open fds) by a
thread at an interval, marks of a process's own memory and CPU time, the clock of a step's
phases, and in-process cases timed round-robin.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads")
SAMPLE = ("t", "rss_bytes", "anon_bytes", "threads", "fds")  # a kept sample's fields


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The :data:`FIELDS` of ``/proc/<pid>/status`` (bytes; Threads a count); {} once gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            lines = [line.split() for line in f if line.split(":", 1)[0] in FIELDS]
    except OSError:
        return {}
    return {p[0][:-1]: int(p[1]) * (1 if p[0] == "Threads:" else 1024) for p in lines}


def open_fds(pid: int | str) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Sampler:
    """Processes (key -> pid, added with :meth:`watch`) sampled every ``interval_s``: each
    figure's peak per key, and with ``keep`` every sample (:data:`SAMPLE`, ``t`` the epoch)."""

    def __init__(self, interval_s: float, *, keep: bool = False) -> None:
        self.interval_s, self.keep, self.pids = interval_s, keep, {}
        self.peaks: dict[Any, dict[str, int]] = {}
        self.samples: dict[Any, list[list[float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, key: Any, pid: int) -> None:
        self.pids = {**self.pids, key: pid}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for key, pid in self.pids.items():
                status = proc_status(pid)
                if not status:
                    continue
                peaks = self.peaks.setdefault(key, {})
                for field, value in status.items():
                    peaks[field] = max(peaks.get(field, 0), value)
                if self.keep and (fds := open_fds(pid)) is not None:
                    row = [round(time.time(), 4), status["VmRSS"], status["RssAnon"]]
                    self.samples.setdefault(key, []).append([*row, status["Threads"], fds])

    def stop(self) -> Sampler:
        self._stop.set()
        self._thread.join()
        return self


def mark() -> dict[str, Any]:
    """This process's ``VmHWM`` and ``VmRSS``, CPU time and wall clock now."""
    st, cpu, wall = proc_status(), time.process_time(), time.perf_counter()
    return {
        "hwm_bytes": st.get("VmHWM"),
        "rss_bytes": st.get("VmRSS"),
        "cpu_s": cpu,
        "wall_s": wall,
    }


class StepClock:
    """The phases of one step: ``phase(name)`` ends the current phase and starts ``name``; the
    record has each phase's seconds, the step's, its CPU seconds (all threads) and its start
    (``t0``, the epoch: samples taken from outside line up with it)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._name: str | None = None
        self._cpu0, self._t0, self._wall0 = time.process_time(), time.perf_counter(), time.time()
        self._last = self._t0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def phase(self, name: str | None) -> None:
        now = time.perf_counter()
        if self._name is not None:
            key = f"{self._name}_s"
            self.times[key] = self.times.get(key, 0.0) + now - self._last
        self._name, self._last = name, now

    def stop(self, **extra: Any) -> dict[str, Any]:
        self.phase(None)
        cpu, step = time.process_time() - self._cpu0, self._last - self._t0
        return {**extra, "cpu_s": cpu, **self.times, "step_s": step, "t0": self._wall0}


def check_timing(args: Any) -> str | None:
    """The timing rules of in-process suites."""
    if args.repeats < 5 or args.warmup < 1:
        return "need --repeats >= 5 (the median of at least 5) and --warmup >= 1"
    return None


def time_interleaved(cases: Mapping[str, Callable], *, warmup: int, repeats: int) -> dict:
    """Each case's ``{"median_s", "min_s", "max_s", "repeats"}``: ``repeats`` timed runs
    round-robin after ``warmup`` untimed runs of each."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    out = {}
    for name, s in samples.items():
        out[name] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
        out[name]["repeats"] = len(s)
    return out
