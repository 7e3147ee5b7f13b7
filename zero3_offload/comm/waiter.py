"""The waiter thread of a group: completions of works whose backend gives no future."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Waiter"]


class Waiter:
    """One daemon thread per group that waits, in launch order, for the works whose
    backend gives no future (gloo's reduce-scatter), and reports each completion.

    A daemon thread, not the loop's default executor: after a timeout a wait may
    last until the group's own timeout, and ``asyncio.run()`` joins the default
    executor's threads on exit, which would hang the process that reported the
    timeout. One thread for the group, not one per collective, so a long run's
    thread count stays flat; collectives complete in launch order on a group, so
    waiting in that order delays no report by much.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[BaseException | None], None]]]
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work: Any, settle: Callable[[BaseException | None], None]) -> None:
        self._queue.put((work, settle))

    def _run(self) -> None:
        while True:
            work, settle = self._queue.get()
            try:
                work.wait()
            except Exception as exc:  # handed to whoever awaits the collective
                settle(exc)
            else:
                settle(None)
            del work, settle  # the work holds the op's buffers
