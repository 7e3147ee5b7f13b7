"""Returning the C heap's free pages to the OS in each training forward."""

from __future__ import annotations

import time
from collections.abc import Callable

from zero3_offload.memory.allocator import trim_heap
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

__all__ = ["HeapTrimmer"]


class HeapTrimmer:
    """Trims the C heap (glibc's ``malloc_trim(0)``) in each training forward, when on:
    in module mode as the forward enters its last unit (most often the head, as the loss
    begins), and at the forward's end.

    The layers' forwards free most of their temporaries, but the pages of small blocks
    (below the mmap threshold) stay resident in malloc's arenas; the head and loss, and
    then the backward, count them on top of what they allocate themselves. Trimming
    before them returns those pages first (2-3 ms each). Each trim is a ``heap-trim``
    interval on the timeline whose ``nbytes`` is the fall of the process's RSS across
    it, measured.

    Args:
        enabled: trim (``trim_heap_after_forward``); False does nothing.
        rss: the process's resident set size now, in bytes
            (``MemoryAccounting.process_rss``).
        timeline: where the trims are recorded.
    """

    def __init__(self, *, enabled: bool, rss: Callable[[], int], timeline: Timeline) -> None:
        self.enabled = enabled
        self._rss = rss
        self._timeline = timeline

    def before_last_unit(self, phase: Phase) -> None:
        """A forward of ``phase`` enters its last unit (module mode): trim when it is a
        training one."""
        self.after_forward(phase)

    def after_forward(self, phase: Phase) -> None:
        """The forward of ``phase`` ended: trim when it was a training one."""
        if not self.enabled or not phase.trains:
            return
        started = time.perf_counter()
        before = self._rss()
        trim_heap()
        returned = max(0, before - self._rss())
        self._timeline.add("heap-trim", "", phase, started, time.perf_counter(), nbytes=returned)
