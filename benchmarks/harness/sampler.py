"""The one memory/time sampler: ``/proc/<pid>/status`` memory figures, their peaks per phase from a
sampling thread, marks (memory, CPU and wall time at a named point) and per-step phase clocks;
a process's thread and open-file counts.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The :data:`FIELDS` of ``/proc/<pid>/status`` in bytes; empty once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            lines = [line.split() for line in f if line.split(":", 1)[0] in FIELDS]
    except OSError:
        return {}
    return {parts[0].rstrip(":"): int(parts[1]) * 1024 for parts in lines}


def proc_counts(pid: int | str = "self") -> dict[str, int]:
    """``threads`` (``Threads`` of ``/proc/<pid>/status``) and ``fds`` (entries of
    ``/proc/<pid>/fd``) of a process, read from outside it; empty once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        return {"threads": threads, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, StopIteration):
        return {}


class Sampler:
    """Peaks of a process's memory figures per phase, sampled every ``interval_s``; marks."""

    def __init__(self, pid: int | str = "self", interval_s: float | None = None) -> None:
        self.pid, self.phase, self.samples = pid, "all", 0
        self.peaks: dict[str, dict[str, int]] = {}
        self.marks: dict[str, dict[str, Any]] = {}
        self._stop, self._thread = threading.Event(), None
        if interval_s is not None:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
            self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            phase, status = self.phase, proc_status(self.pid)
            self.samples += bool(status)
            peaks = self.peaks.setdefault(phase, {})
            for key, value in status.items():
                peaks[key] = max(peaks.get(key, 0), value)

    def mark(self, name: str) -> None:
        """Record ``VmHWM``, ``VmRSS``, this process's CPU time and the wall clock now."""
        st, cpu, wall = proc_status(self.pid), time.process_time(), time.perf_counter()
        mark = {"hwm_bytes": st.get("VmHWM"), "rss_bytes": st.get("VmRSS"), "cpu_s": cpu}
        self.marks[name] = {**mark, "wall_s": wall}

    def stop(self) -> Sampler:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self


class StepClock:
    """The phases of one step: ``phase(name)`` ends the current phase and starts ``name``.

    With a sampler, the sampler's phase follows as ``"<name> <step>"``.
    """

    def __init__(self, sampler: Sampler | None = None, step: int = 0) -> None:
        self.sampler, self.step, self.times = sampler, step, {}
        self._name: str | None = None
        self._cpu0, self._t0 = time.process_time(), time.perf_counter()
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
        if self.sampler is not None and name is not None:
            self.sampler.phase = f"{name} {self.step}"

    def stop(self, **extra: Any) -> dict[str, Any]:
        """The step's record: ``extra``, ``cpu_s``, ``<phase>_s`` of each phase and ``step_s``."""
        self.phase(None)
        cpu = time.process_time() - self._cpu0
        return {**extra, "cpu_s": cpu, **self.times, "step_s": self._last - self._t0}
