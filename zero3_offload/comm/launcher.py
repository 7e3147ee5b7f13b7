"""The launcher thread of a group: collectives started in program order, off the event loop.

See ``comm.collectives`` for why launches leave the loop, and [Note: divergence
check] for the check made before the first collective of each call.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from zero3_offload.comm.divergence import DivergenceCheck
from zero3_offload.errors import CommunicationError, Zero3Error

__all__ = ["Launcher"]

_Entry = tuple[Callable[[], Any], "str | None", int, concurrent.futures.Future[Any]]


class Launcher:
    """One daemon thread that calls queued functions in order (a daemon, so a launch
    stuck on a dead peer never keeps the process from exiting).

    A function queued with a ``description`` is a collective. With a
    ``check``, the first collective of each *segment* (a public call; the
    caller numbers them) starts only once every rank is about to start the same
    one in the same call, and the record compared also carries the count and a
    digest of every collective launched since the previous check; after a
    failed check, no later collective starts.
    """

    def __init__(self, name: str, check: DivergenceCheck | None) -> None:
        self._queue: queue.SimpleQueue[_Entry] = queue.SimpleQueue()
        self.submitted = 0  # functions queued so far (from any thread, under the lock)
        self.finished = 0  # functions called so far (by the launcher thread only)
        self.check = check
        self.diverged: Zero3Error | None = None
        self._current: str | None = None  # the description being checked or launched
        self.failed_at: str | None = None  # the description whose check failed first
        self._segment = -1  # the segment of the last check
        self._since = hashlib.blake2b(digest_size=8)  # descriptions since the last check
        self._count = 0  # how many
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _call(self, fn: Callable[[], Any], description: str | None, segment: int) -> Any:
        if description is not None and self.check is not None:
            if self.diverged is not None:
                raise self.diverged
            if segment != self._segment:
                self._verify(description)
                self._segment = segment
                self._since, self._count = hashlib.blake2b(digest_size=8), 0
            self._since.update(description.encode())
            self._count += 1
        return fn()

    def _verify(self, description: str) -> None:
        assert self.check is not None
        before = (
            f"{self._count} collective(s) since the last check, digest {self._since.hexdigest()}"
        )
        try:
            self.check.verify(f"{description} [{before}]")
        except Zero3Error as exc:
            self.diverged, self.failed_at = exc, description
            raise
        except Exception as exc:  # the side group failed: a peer died or timed out
            self.failed_at = description
            self.diverged = CommunicationError(f"the check before {description} failed: {exc}")
            raise self.diverged from exc

    def launching(self) -> str:
        """What the launcher thread is launching now, in words (for errors)."""
        current = self.failed_at or self._current
        return f"the start of {current}" if current else "the start of the queued collectives"

    def _run(self) -> None:
        while True:
            fn, description, segment, future = self._queue.get()
            self._current = description
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._call(fn, description, segment))
                except BaseException as exc:  # handed to whoever waits for the launch
                    future.set_exception(exc)
            # The launch's closure holds its tensors: not until the next launch.
            del fn, future
            self._current = None
            self.finished += 1

    def submit(
        self, fn: Callable[[], Any], description: str | None = None, segment: int = 0
    ) -> concurrent.futures.Future[Any]:
        """Queue ``fn``; a collective has a ``description`` and the ``segment`` (call) it
        belongs to."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self.submitted += 1
            self._queue.put((fn, description, segment, future))
        return future

    def idle(self) -> bool:
        """Whether everything queued so far has been called."""
        with self._lock:
            return self.finished >= self.submitted
