"""The waiter thread of a group: completions of works whose backend gives no future."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Waiter"]


class Waiter:
    """Reports each launched work's completion: through the work's future where the
    backend gives one, else from one daemon thread per group that waits, in launch
    order, for the works whose backend gives none (gloo's reduce-scatter).

    A daemon thread, not the loop's default executor: after a timeout a wait may
    last until the group's own timeout, and ``asyncio.run()`` joins the default
    executor's threads on exit, which would hang the process that reported the
    timeout. One thread for the group, not one per collective, so a long run's
    thread count stays flat; collectives complete in launch order on a group, so
    waiting in that order delays no report by much.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[BaseException | None], None]] | None]
        self._queue = queue.SimpleQueue()  # None: stop
        # op -> whether the backend's Work objects for it offer get_future()
        # (gloo's reduce-scatter does not); learned on first use.
        self._has_future: dict[str, bool] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def when_done(self, op: str, work: Any, settle: Callable[[BaseException | None], None]) -> None:
        """Call ``settle(None)``, or ``settle(exc)`` on failure, from a backend thread or
        this waiter's once ``work`` (a launched ``op``) completes."""
        future = self._work_future(op, work)
        if future is None:
            self._queue.put((work, settle))
        else:
            future.add_done_callback(lambda done: _report(done.value, settle))

    def _work_future(self, op: str, work: Any) -> torch.futures.Future | None:
        if self._has_future.get(op, True):
            try:
                future = work.get_future()
            except RuntimeError:
                self._has_future[op] = False
            else:
                self._has_future[op] = True
                return future
        return None

    def stop(self, timeout_s: float | None) -> None:
        """End the waiter thread once the works queued so far completed, waiting
        ``timeout_s`` for it at most (0: not at all; a work that never completes is left
        to the process's exit, the thread being a daemon)."""
        self._queue.put(None)
        if timeout_s != 0:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            work, settle = entry
            _report(work.wait, settle)
            del work, settle, entry  # the work holds the op's buffers


def _report(wait: Callable[[], object], settle: Callable[[BaseException | None], None]) -> None:
    """``settle`` with how ``wait()`` ended: None, or the error it raised."""
    try:
        wait()
    except Exception as exc:  # handed to whoever awaits the collective
        settle(exc)
    else:
        settle(None)
