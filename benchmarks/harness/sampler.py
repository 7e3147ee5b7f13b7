"""The one sampler: processes read from outside through ``/proc`` by a thread at an interval;
a step's clock; in-process cases timed round-robin."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "Threads")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The :data:`FIELDS` of ``/proc/<pid>/status`` (bytes; Threads a count); {} once gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            lines = [line.split() for line in f if line.split(":", 1)[0] in FIELDS]
    except OSError:
        return {}
    return {p[0][:-1]: int(p[1]) * (1 if p[0] == "Threads:" else 1024) for p in lines}


class Sampler:
    """Processes (key -> pid, :meth:`watch`) sampled every ``interval_s``: each figure's peak per
    key, and with ``keep`` every sample ``[t (epoch), VmRSS, RssAnon, Threads, open fds]``."""

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
                if not (st := proc_status(pid)):
                    continue
                peaks = self.peaks.setdefault(key, {})
                peaks.update({k: max(peaks.get(k, 0), v) for k, v in st.items()})
                try:
                    fds = len(os.listdir(f"/proc/{pid}/fd")) if self.keep else 0
                except OSError:  # gone since its status was read
                    continue
                row = [round(time.time(), 4), st["VmRSS"], st["RssAnon"], st["Threads"], fds]
                self.samples.setdefault(key, []).extend([row] * self.keep)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class StepClock:
    """A step's phases (``phase(name)`` ends the current one): seconds, the step's, its CPU."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._name: str | None = None
        self._cpu0, self._t0 = time.process_time(), time.perf_counter()
        self._last = self._t0

    def phase(self, name: str | None) -> None:
        now = time.perf_counter()
        if self._name is not None:
            key = f"{self._name}_s"
            self.times[key] = self.times.get(key, 0.0) + now - self._last
        self._name, self._last = name, now

    def stop(self, **extra: Any) -> dict[str, Any]:
        self.phase(None)
        cpu, step = time.process_time() - self._cpu0, self._last - self._t0
        return {**extra, "cpu_s": cpu, **self.times, "step_s": step}


def check_timing(args: Any) -> str | None:
    """The timing rules of in-process suites."""
    if args.repeats < 5 or args.warmup < 1:
        return "need --repeats >= 5 (the median of at least 5) and --warmup >= 1"
    return None


def time_interleaved(cases: Mapping[str, Callable], *, warmup: int, repeats: int) -> dict:
    """Each case's median seconds of ``repeats`` runs round-robin after ``warmup`` untimed."""
    for fn in [f for f in cases.values() for _ in range(warmup)]:
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}
