"""An asyncio event loop running on a daemon thread of its own.

[Note: the synchronous face]
Synchronous code (a transformers ``Trainer``, a Lightning ``Strategy``) calls the
manager through :class:`~zero3_offload.sync.sync_manager.SyncManager`: each call is
a coroutine submitted to this loop, and the calling thread blocks until it is done.
Everything the manager creates (its tasks, its launcher, its model thread) belongs to
this loop, which lives as long as the manager. Autograd's grad mode is a per-thread
setting: the caller's (``torch.no_grad()`` for evaluation) is applied around the
coroutine on the loop's thread, so a call means what it means from async code. The
coroutine's exception is raised in the calling thread as it was raised (the same
object, its cause chained). A ``KeyboardInterrupt`` in the calling thread cancels the
call; the call then fails as any failed call does (see [Note: abandoned calls]).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from zero3_offload.errors import StateError

__all__ = ["LoopThread"]

_T = TypeVar("_T")


class LoopThread:
    """Runs coroutines on an event loop on its own daemon thread, one call at a time.

    Args:
        name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str = "zero3-sync-loop") -> None:
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(started.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name=name, daemon=True)
        self._thread.start()
        started.wait()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (running on :attr:`thread`)."""
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        """The loop's thread."""
        return self._thread

    def run(self, make: Callable[[], Awaitable[_T]]) -> _T:
        """Run the coroutine ``make()`` on the loop under the caller's grad mode; block
        until it is done and return its result (or raise its exception).

        Raises:
            StateError: when the loop is closed, or when called from the loop's own
                thread (it would wait for itself).
        """
        if self._closed:
            raise StateError("the synchronous face is closed; build a new one")
        if threading.current_thread() is self._thread:
            raise StateError(
                "a synchronous call from the event loop's own thread would wait for itself: "
                "from async code, await the manager's own methods"
            )
        grad = torch.is_grad_enabled()

        async def call() -> _T:
            with torch.set_grad_enabled(grad):
                return await make()

        future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(call(), self._loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop and join its thread (idempotent). Tasks still pending are
        cancelled first."""
        if self._closed:
            return
        self._closed = True

        async def cancel_pending() -> None:
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_pending(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"LoopThread({self._thread.name!r}, {state})"
