"""CPU work in worker threads, bounded, and recorded on the timeline.

Gradient-shard accumulation, encoding of compute copies, the optimizer math
and checkpoint I/O run through :class:`WorkerThreads`: ``anyio.to_thread`` with a
capacity limiter of ``cpu_worker_threads``. Torch releases the GIL inside its
kernels, so these threads run in parallel with each other and with the event
loop's thread (which runs the layers' compute).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

__all__ = ["WorkerThreads"]

T = TypeVar("T")


class WorkerThreads:
    """Runs CPU functions in at most ``threads`` worker threads at once.

    Args:
        threads: the limiter's capacity.
        timeline: where each run is added (phase, layer, start, end, thread).
    """

    def __init__(self, *, threads: int, timeline: Timeline) -> None:
        self._limiter = anyio.CapacityLimiter(threads)
        self._timeline = timeline

    async def run(self, kind: str, layer: str, phase: Phase, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in a worker thread; returns its result.

        Args:
            kind: what the work is (e.g. ``"cpu-optimizer"``, ``"compress"``).
            layer: the layer it belongs to.
            phase: the phase the work belongs to.
            fn: the work.
        """

        def timed() -> T:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                # anyio names every worker alike: the native id tells them apart.
                worker = f"worker-{threading.get_native_id()}"
                self._timeline.add(kind, layer, phase, start, time.perf_counter(), worker)

        return await anyio.to_thread.run_sync(timed, limiter=self._limiter)
