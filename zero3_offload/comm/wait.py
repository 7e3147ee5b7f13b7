"""The rules of every wait for a group's collectives: timeout, heartbeat, confirmation, blame.

[Note: one wait]
Whoever waits for a collective (``PendingCollective.wait`` on the event loop,
``PendingCollective.wait_blocking`` in a constructor, ``Collectives.flush`` and
``flush_blocking`` for the launches queued so far) waits by the same rules,
written once in :class:`CollectiveWait`:

1. *Timeout*: after ``timeout_s`` the wait raises ``CommunicationError`` ("did
   not complete within").
2. *Heartbeat check*: with a :class:`~zero3_offload.comm.heartbeat.Heartbeat`,
   the wait looks at its finding every ``_POLL_S`` (see [Note: heartbeat]).
3. *Confirmation*: a finding is looked at again ``_CONFIRM_S`` later, and
   raised (naming the rank and what this rank was waiting for) only if the
   collective is still pending and the finding stands: the collective may have
   completed as its last peer closed, or this process was paused itself.
4. *A failed call elsewhere*: with a heartbeat, a failure report of the current
   epoch (some rank's call failed: see [Note: failure channel] in
   ``comm.failure_report``) ends the wait at its next look, without
   confirmation, with the report's error class naming that rank and its
   error; a wait that starts once a report is known ends at once. A wait
   about to name a silent rank (rules 3 and 5) looks for a report once more:
   a rank that failed a call and then closed is named by its failure (the beat
   thread reads the reports before the counters of its round take effect).
5. *Blame*: when the collective fails, a ``RankDivergenceError`` is raised as it
   is; a known failure report is raised as in rule 4; any other error is first
   explained by the heartbeat, waited for over its
   rounds until a rank that stopped just now would have been silent for the
   heartbeat's timeout. A silent rank found by then is named; else the error is
   raised as a ``CommunicationError`` naming the collective (a ``Zero3Error`` as
   it is).
6. Every error raised marks the group's sequence of collectives broken
   (``fail``): later collectives are refused at once.

Rules 1-4 are one generator, :meth:`CollectiveWait._timeouts`: it yields how
long to wait next and is resumed each time that wait ended with the collective
still pending; it raises when the wait must end. Rule 5 is
:meth:`CollectiveWait._failure`, which may block for the heartbeat's timeout.
Two drivers run them over a ``concurrent.futures.Future``:
:meth:`CollectiveWait.until_done` waits on the event loop (``asyncio.wait`` on
the wrapped future, the blame in a worker thread), and
:meth:`CollectiveWait.until_done_blocking` on the calling thread
(``concurrent.futures.wait``). Nothing else in the library waits for a
collective.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import anyio.to_thread
import attrs
import torch.distributed as dist

from zero3_offload.comm.heartbeat import Heartbeat
from zero3_offload.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    RankDivergenceError,
    Zero3Error,
)

__all__ = ["CollectiveWait", "group_label"]

T = TypeVar("T")

_POLL_S = 0.2  # how often a wait looks at the heartbeat
# How long a wait gives a collective to complete once the heartbeat reports a rank,
# before it looks again and raises: a collective whose last peer closed right after
# it completed settles by then, and so does this rank's beat after a pause of its own.
_CONFIRM_S = 0.5


def group_label(group: dist.ProcessGroup) -> str:
    """The group in words, for errors: backend, size and this rank."""
    try:
        backend = dist.get_backend(group)
    except (ValueError, RuntimeError):  # the group was destroyed meanwhile
        backend = "destroyed"
    return f"{backend} group of {group.size()} ranks (this is rank {group.rank()})"


def _retrieve(future: asyncio.Future[object]) -> None:
    # Marks a late failure as seen: once a wait gave up nobody awaits the future
    # any more, and asyncio would log "exception never retrieved".
    if not future.cancelled():
        future.exception()


@attrs.frozen
class CollectiveWait:
    """Waits for a collective by the group's rules (see [Note: one wait]).

    Args:
        rank: this rank in the group (named in the silence message).
        timeout_s: how long one wait may last.
        heartbeat: the group's heartbeat, or None (only ``timeout_s`` bounds a wait).
        waiting_for: a wait's label -> what this rank was waiting for, in the
            message that names a silent rank (the group knows where the ranks parted).
        fail: marks the group's sequence of collectives broken; returns its argument.
    """

    rank: int
    timeout_s: float
    heartbeat: Heartbeat | None
    waiting_for: Callable[[str], str]
    fail: Callable[[Zero3Error], Zero3Error]

    async def until_done(self, future: concurrent.futures.Future[T], label: str) -> T:
        """``future``'s result, awaited without blocking the event loop.

        Raises:
            CommunicationError: on timeout, when a rank is silent, or when the
                future failed (naming a silent rank when the heartbeat finds one).
            RankDivergenceError: when the ranks were about to run different collectives.
        """
        if not future.done():  # a settled one is read without yielding to the loop
            waited = asyncio.wrap_future(future)
            waited.add_done_callback(_retrieve)
            for timeout in self._timeouts(label):
                await asyncio.wait({waited}, timeout=timeout)
                if waited.done():  # set from future's own callback: future is settled
                    break
        try:
            return future.result()
        except Exception as exc:
            # The blame may wait for the heartbeat's timeout: not on the loop.
            error, cause = await anyio.to_thread.run_sync(self._failure, exc, label)
            raise error from cause

    def until_done_blocking(self, future: concurrent.futures.Future[T], label: str) -> T:
        """:meth:`until_done` on this thread (one other than the event loop's)."""
        for timeout in self._timeouts(label):
            concurrent.futures.wait([future], timeout=timeout)
            if future.done():
                break
        try:
            return future.result()
        except Exception as exc:
            error, cause = self._failure(exc, label)
            raise error from cause

    def _timeouts(self, label: str) -> Iterator[float]:
        """How long to wait next, each time the wait before ended with the collective
        still pending; raises on timeout and on a confirmed silence (rules 1-3)."""
        deadline = time.monotonic() + self.timeout_s
        beat = self.heartbeat
        while True:
            self._raise_failure(label)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.fail(
                    CollectiveTimeoutError(
                        f"{label} did not complete within {self.timeout_s:g} s: "
                        "a rank may have stopped or skipped this call"
                    )
                )
            yield remaining if beat is None else min(_POLL_S, remaining)
            self._raise_failure(label)
            if beat is None or beat.silent() is None:
                continue
            # Confirm once more, a moment later: the collective may have
            # completed as its last peer closed, or this process was paused.
            yield _CONFIRM_S
            silent = beat.silent()
            if silent is not None:
                self._raise_failure(label)  # a failed call, then a close, is the failure
                raise self.fail(CommunicationError(self._silence(silent, label)))

    def _failure(self, exc: Exception, label: str) -> tuple[Zero3Error, BaseException | None]:
        """The error to raise for a collective that failed with ``exc``, and its cause
        (rule 5); blocks while the heartbeat is asked who is to blame."""
        if isinstance(exc, RankDivergenceError):
            return self.fail(exc), None
        report = self.heartbeat.failure() if self.heartbeat is not None else None
        if report is not None:
            return self.fail(report.peer_error(self.rank, self.waiting_for(label))), exc
        # A backend error on a peer's death says little about who died: ask the
        # heartbeat, which names an exited peer on this host at once and a remote
        # one once its silence exceeds the heartbeat's timeout.
        beat = self.heartbeat
        silent = None
        if beat is not None:
            silent = beat.wait_silent(time.monotonic() + beat.timeout_s + 2 * beat.interval_s)
        report = beat.failure() if beat is not None else None
        if report is not None:  # a rank failed a call, then closed or exited
            return self.fail(report.peer_error(self.rank, self.waiting_for(label))), exc
        if silent is not None:
            return self.fail(CommunicationError(self._silence(silent, label))), exc
        if isinstance(exc, Zero3Error):
            return self.fail(exc), None
        return self.fail(CommunicationError(f"{label} failed: {exc}")), exc

    def _raise_failure(self, label: str) -> None:
        """Rule 4: raise the current epoch's failure report, if one is known."""
        report = self.heartbeat.failure() if self.heartbeat is not None else None
        if report is not None:
            raise self.fail(report.peer_error(self.rank, self.waiting_for(label)))

    def _silence(self, silent: str, label: str) -> str:
        return (
            f"{silent}; this rank ({self.rank}) was waiting for {self.waiting_for(label)}. "
            "The run cannot continue: restart the ranks and resume from the last checkpoint"
        )
