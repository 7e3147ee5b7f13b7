"""CUDA streams for copies, and events to order them; nothing on the CPU.

[Note: copy streams]
Two side streams exist on a CUDA device:
- ``h2d``: copies compressed shards host→device and decodes them, so the copy
  of the next layer overlaps the current layer's compute.
- ``d2h``: copies gradient shards device→host into pinned buffers, so the copy
  overlaps the next layer's backward.
What passes between streams is a tensor plus the event recorded after it was
written; the consumer's stream waits on that event (never a device-wide
synchronize). Tensors allocated on one stream and used on another are marked
with ``record_stream`` so the caching allocator does not reuse them early.
On the CPU every method is a no-op and the same code path runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

__all__ = ["CopyStreams"]


class CopyStreams:
    """The side streams of one device (see [Note: copy streams]).

    Args:
        device: the compute device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Copies whose CUDA events have not been read yet:
        # (direction, layer, phase, bytes, start event, end event, host start time)
        self._copies: list[tuple[str, str, str, int, Any, Any, float]] = []
        self._copies_lock = threading.Lock()  # appended on the loop, read in workers too
        self.enabled = device.type == "cuda"
        # h2d: host-to-device copies overlap the compute stream's work.
        self.h2d = torch.cuda.Stream(device) if self.enabled else None
        # d2h: gradient copies to the host overlap the next layer's backward.
        self.d2h = torch.cuda.Stream(device) if self.enabled else None

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Make ``stream`` current for the block (no-op on the CPU)."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def event_now(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """An event recorded now on ``stream`` (default: the current stream)."""
        if not self.enabled:
            return None
        # Timing on: copy intervals are read from these (elapsed_time needs it).
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for ``event`` without blocking the host."""
        if event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def mark_used_on_current(self, tensor: torch.Tensor) -> None:
        """Tell the allocator ``tensor`` (made on a side stream) is used on the current stream."""
        if self.enabled and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))

    def track_copy(
        self,
        direction: str,
        layer: str,
        phase: Phase,
        nbytes: int,
        started: torch.cuda.Event | None,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Remember a copy enqueued on ``stream`` since ``started``, to time it later."""
        if started is None:
            return
        ended = self.event_now(stream)
        with self._copies_lock:
            self._copies.append(
                (direction, layer, phase, nbytes, started, ended, time.perf_counter())
            )

    def add_finished_copies(self, timeline: Timeline) -> None:
        """Add the copies whose events completed to ``timeline``, timed by the events.

        Only events already complete are read (``query()``), so timing adds no
        host synchronisation; the rest wait for a later call.
        """
        with self._copies_lock:
            done = [c for c in self._copies if c[5].query()]
            self._copies = [c for c in self._copies if c not in done]
        for direction, layer, phase, nbytes, start, end, host in done:
            seconds = start.elapsed_time(end) / 1000.0
            timeline.add(direction, layer, phase, host, host + seconds, "copy", nbytes=nbytes)

    @staticmethod
    def host_wait(event: torch.cuda.Event | None) -> None:
        """Block this (worker) thread until ``event`` completed."""
        if event is not None:
            event.synchronize()
