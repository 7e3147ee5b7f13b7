"""The launcher thread of a group: collectives started in program order, off the event loop.

See ``comm.collectives`` for why launches leave the loop, and [Note: divergence
check] for the check made before the first collective of each call.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from zero3_offload.comm.divergence import DivergenceCheck
from zero3_offload.errors import CommunicationError, Zero3Error

__all__ = ["Launcher", "Recipe"]

# A collective's recipe: kind, elements, dtype name, source rank (see Collectives.recover).
Recipe = tuple[str, int, str, int]
_Entry = tuple[
    Callable[[], Any], "str | None", int, "Recipe | None", concurrent.futures.Future[Any]
]
_LOG = 256  # the recipes kept: how far behind another rank a recovery can catch up
_CHECK: Recipe = ("check", 0, "", 0)


class Launcher:
    """One daemon thread that calls queued functions in order (a daemon, so a launch
    stuck on a dead peer never keeps the process from exiting).

    A function queued with a ``description`` is a collective. With a
    ``check``, the first collective of each *segment* (a public call; the
    caller numbers them) starts only once every rank is about to start the same
    one in the same call, and the record compared also carries the count and a
    digest of every collective launched since the previous check; after a
    failed check, no later collective starts. Once :meth:`cancel` was called
    (a call failed: see [Note: failure channel]), no collective starts any more
    (functions without a description still run, in order).
    """

    def __init__(self, name: str, check: DivergenceCheck | None) -> None:
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()  # None: stop
        self.submitted = 0  # functions queued so far (from any thread, under the lock)
        self.finished = 0  # functions called so far (by the launcher thread only)
        self.check = check
        self.diverged: Zero3Error | None = None
        self._current: str | None = None  # the description being checked or launched
        self.failed_at: str | None = None  # the description whose check failed first
        self._segment = -1  # the segment of the last check
        self._since = hashlib.blake2b(digest_size=8)  # descriptions since the last check
        self._count = 0  # how many
        self.launched = 0  # collectives (and checks) started so far, by the launcher thread
        self.log: collections.deque[Recipe] = collections.deque(maxlen=_LOG)  # their recipes
        self.cancelled = False
        self._running = False  # a queued function is being called now
        self._lock = threading.Lock()
        self._stopped = False  # stop() was called: nothing more is queued
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def record(self, recipe: Recipe) -> None:
        """Count a collective (or check) started, with its recipe."""
        self.log.append(recipe)
        self.launched += 1

    def _call(
        self, fn: Callable[[], Any], description: str | None, segment: int, recipe: Recipe | None
    ) -> Any:
        if description is not None and self.cancelled:
            raise CommunicationError(f"{description} was abandoned with the call that failed")
        if description is not None and self.check is not None:
            if self.diverged is not None:
                raise self.diverged
            if segment != self._segment:
                self.record(_CHECK)
                self._verify(description)
                self._segment = segment
                self._since, self._count = hashlib.blake2b(digest_size=8), 0
            self._since.update(description.encode())
            self._count += 1
        if description is not None and self.cancelled:  # cancelled during the check
            raise CommunicationError(f"{description} was abandoned with the call that failed")
        if recipe is not None:
            self.record(recipe)
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
        while (entry := self._queue.get()) is not None:
            fn, description, segment, recipe, what, future = entry
            self._current = description or what
            self._running = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._call(fn, description, segment, recipe))
                except BaseException as exc:  # handed to whoever waits for the launch
                    future.set_exception(exc)
            # The launch's closure holds its tensors: not until the next launch.
            del fn, future, entry
            self._current = None
            self._running = False
            self.finished += 1

    def submit(
        self,
        fn: Callable[[], Any],
        description: str | None = None,
        segment: int = 0,
        recipe: Recipe | None = None,
        what: str | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Queue ``fn``; a collective has a ``description``, the ``segment`` (call) it
        belongs to and its ``recipe``; other work (set-up that runs collectives of its
        own, never checked) may be named by ``what``, for errors."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise CommunicationError(
                    f"{description or what or 'a launch'} was asked for after the group's "
                    "collectives were closed"
                )
            self.submitted += 1
            self._queue.put((fn, description, segment, recipe, what, future))
        return future

    def cancel(self) -> None:
        """Start no further collective (those queued fail with a ``CommunicationError``)."""
        self.cancelled = True

    def running(self) -> bool:
        """Whether the launcher thread is inside a queued function now."""
        return self._running

    def resume(self) -> None:
        """Start collectives again after :meth:`cancel`, as after a fresh start: the next
        one is checked, and the digest starts anew (every rank resumes alike)."""
        self._segment = -1
        self._since, self._count = hashlib.blake2b(digest_size=8), 0
        self.diverged = self.failed_at = None
        self.cancelled = False

    def stop(self, timeout_s: float | None) -> None:
        """End the launcher thread once everything queued so far has been called, waiting
        ``timeout_s`` for it at most (0: not at all; a launch stuck on a silent peer is
        left to the process's exit, the thread being a daemon)."""
        with self._lock:
            self._stopped = True
            self._queue.put(None)
        if timeout_s != 0:
            self._thread.join(timeout_s)

    def idle(self) -> bool:
        """Whether everything queued so far has been called."""
        with self._lock:
            return self.finished >= self.submitted
