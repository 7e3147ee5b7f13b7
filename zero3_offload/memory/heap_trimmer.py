"""Returning the C heap's free pages to the OS after each training forward."""

from __future__ import annotations

import time
from collections.abc import Callable

from zero3_offload.memory.allocator import trim_heap
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

__all__ = ["HeapTrimmer"]


class HeapTrimmer:
    """Trims the C heap (glibc's ``malloc_trim(0)``) after each training forward, when on.

    A forward frees most of its temporaries, but the pages of small blocks
    (below the mmap threshold) stay resident in malloc's arenas; the backward's
    peak then counts them on top of what it allocates itself. Trimming between the
    passes returns those pages first (2-3 ms). Each trim is a ``heap-trim``
    interval on the timeline whose ``nbytes`` is the fall of the process's RSS
    across it, measured.

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

    def after_forward(self, phase: Phase) -> None:
        """The forward of ``phase`` ended: trim when it was a training one."""
        if not self.enabled or not phase.trains:
            return
        started = time.perf_counter()
        before = self._rss()
        trim_heap()
        returned = max(0, before - self._rss())
        self._timeline.add("heap-trim", "", phase, started, time.perf_counter(), nbytes=returned)
