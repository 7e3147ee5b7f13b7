"""The wait core's rules, one test each, with real futures, threads and heartbeats.

Every wait for a collective follows ``CollectiveWait`` (see [Note: one wait] in
``zero3_offload/comm/wait.py``). Here the awaited thing is a real
``concurrent.futures.Future`` completed or failed by a real thread, and the
heartbeat a real ``Heartbeat`` over a ``dist.HashStore`` whose peer counter a
thread of the test moves, then stops moving. No process group is needed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from zero3_offload.comm.heartbeat import Heartbeat
from zero3_offload.comm.wait import _CONFIRM_S, _POLL_S, CollectiveWait
from zero3_offload.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    RankDivergenceError,
    Zero3Error,
)

LABEL = "all_reduce of 4 bytes (a test) on the test group"
BEAT_S = 0.3  # the heartbeat's timeout in these tests: a silent peer is named in ~0.3 s


class Group:
    """What a wait reports to: the failures it marked (the group's broken state)."""

    def __init__(self) -> None:
        self.failures: list[Zero3Error] = []

    def fail(self, exc: Zero3Error) -> Zero3Error:
        self.failures.append(exc)
        return exc

    def waiting_for(self, label: str) -> str:
        return f"{label} during a test"


def core(group: Group, *, timeout_s: float = 60.0, heartbeat: Heartbeat | None = None):
    return CollectiveWait(
        rank=0,
        timeout_s=timeout_s,
        heartbeat=heartbeat,
        waiting_for=group.waiting_for,
        fail=group.fail,
    )


def completed_by_thread(value: object = None) -> tuple[concurrent.futures.Future, threading.Event]:
    """A future a thread of its own completes with ``value`` once the event is set."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    go = threading.Event()

    def complete() -> None:
        go.wait()
        future.set_result(value)

    threading.Thread(target=complete, daemon=True).start()
    return future, go


def failed_by_thread(error: BaseException) -> concurrent.futures.Future:
    """A future a thread (joined before this returns) failed with ``error``, as a
    backend or launcher thread fails a collective."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    thread = threading.Thread(target=future.set_exception, args=(error,))
    thread.start()
    thread.join()
    return future


class Peer:
    """Rank 1 of a heartbeat over ``store``: published like any rank, its counter moved
    by a thread every beat until :meth:`stop` (then it is silent, its process alive)."""

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        self._store = store
        self._stop = threading.Event()
        published = Heartbeat(store, rank=1, world_size=2, key="t", timeout_s=timeout_s)
        self._interval = published.interval_s
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._store.add("t/beat/1", 1)
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def watched() -> Iterator[tuple[Heartbeat, Peer]]:
    """Rank 0's started heartbeat and a beating peer."""
    store = dist.HashStore()
    beat = Heartbeat(store, rank=0, world_size=2, key="t", timeout_s=BEAT_S, store_host_rank=None)
    peer = Peer(store, BEAT_S)
    beat.start()
    try:
        yield beat, peer
    finally:
        peer.stop()
        beat.close()


def silent_now(beat: Heartbeat) -> str:
    found = beat.wait_silent(time.monotonic() + 30.0)
    assert found is not None, "the stopped peer was never found silent"
    return found


def test_blocking_wait_returns_the_value_a_thread_sets() -> None:
    group = Group()
    future, go = completed_by_thread(value=42)
    go.set()
    assert core(group).until_done_blocking(future, LABEL) == 42
    assert group.failures == []


async def test_async_wait_returns_the_value_and_leaves_the_loop_free() -> None:
    group = Group()
    future, go = completed_by_thread(value="done")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while ticks < 100:
            ticks += 1
            await asyncio.sleep(0)  # only yields to the loop
        go.set()  # the future completes only once the loop ran other tasks

    task = asyncio.create_task(tick())
    assert await core(group).until_done(future, LABEL) == "done"
    await task
    assert ticks == 100
    assert group.failures == []


@pytest.mark.parametrize("driver", ["blocking", "async"])
def test_timeout_raises_naming_the_collective_and_marks_the_group(driver: str) -> None:
    group = Group()
    future: concurrent.futures.Future = concurrent.futures.Future()  # never settled
    wait = core(group, timeout_s=0.05)
    with pytest.raises(CollectiveTimeoutError) as info:
        if driver == "blocking":
            wait.until_done_blocking(future, LABEL)
        else:
            asyncio.run(wait.until_done(future, LABEL))
    assert str(info.value) == (
        f"{LABEL} did not complete within 0.05 s: a rank may have stopped or skipped this call"
    )
    assert group.failures == [info.value]


@pytest.mark.parametrize("driver", ["blocking", "async"])
def test_backend_error_without_heartbeat_names_the_collective(driver: str) -> None:
    group = Group()
    backend = RuntimeError("Connection reset by peer")
    future = failed_by_thread(backend)
    wait = core(group)
    with pytest.raises(CommunicationError) as info:
        if driver == "blocking":
            wait.until_done_blocking(future, LABEL)
        else:
            asyncio.run(wait.until_done(future, LABEL))
    assert str(info.value) == f"{LABEL} failed: Connection reset by peer"
    assert info.value.__cause__ is backend
    assert group.failures == [info.value]


def test_library_error_passes_through_as_it_is() -> None:
    group = Group()
    launcher_error = CommunicationError("the check before the gather failed: timeout")
    future = failed_by_thread(launcher_error)
    with pytest.raises(CommunicationError) as info:
        core(group).until_done_blocking(future, LABEL)
    assert info.value is launcher_error
    assert info.value.__cause__ is None
    assert group.failures == [launcher_error]


def test_divergence_passes_through_without_asking_the_heartbeat(watched) -> None:
    beat, peer = watched
    peer.stop()
    silent_now(beat)  # a silent peer that a blame would name instead
    group = Group()
    diverged = RankDivergenceError("ranks diverged: rank 0 ...; rank 1 ...")
    future = failed_by_thread(diverged)
    with pytest.raises(RankDivergenceError) as info:
        core(group, heartbeat=beat).until_done_blocking(future, LABEL)
    assert info.value is diverged
    assert group.failures == [diverged]


def test_silent_peer_is_named_with_what_this_rank_waited_for(watched) -> None:
    beat, peer = watched
    group = Group()
    future: concurrent.futures.Future = concurrent.futures.Future()  # the peer never joins
    wait = core(group, heartbeat=beat)
    peer.stop()
    with pytest.raises(CommunicationError) as info:
        wait.until_done_blocking(future, LABEL)
    message = str(info.value)
    assert message.startswith("rank 1 (pid ")
    assert "sent no heartbeat for" in message
    assert f"this rank (0) was waiting for {LABEL} during a test." in message
    assert message.endswith("restart the ranks and resume from the last checkpoint")
    assert group.failures == [info.value]


def test_a_finding_is_confirmed_before_it_is_raised(watched) -> None:
    beat, peer = watched
    group = Group()
    timeouts = core(group, heartbeat=beat)._timeouts(LABEL)
    assert next(timeouts) == _POLL_S  # with a heartbeat, a wait looks at it this often
    peer.stop()
    silent_now(beat)
    # The poll ended with the collective pending and a finding: wait once more first.
    assert next(timeouts) == _CONFIRM_S
    # Had the collective completed meanwhile, the driver stops here: nothing raised.
    assert group.failures == []
    # Still pending and still silent: now it is raised.
    with pytest.raises(CommunicationError, match="sent no heartbeat"):
        next(timeouts)
    assert len(group.failures) == 1


def test_backend_error_blames_a_silent_peer(watched) -> None:
    beat, peer = watched
    peer.stop()
    silent_now(beat)
    group = Group()
    backend = RuntimeError("Connection closed by peer")
    future = failed_by_thread(backend)
    with pytest.raises(CommunicationError) as info:
        core(group, heartbeat=beat).until_done_blocking(future, LABEL)
    assert "rank 1 (pid " in str(info.value) and "sent no heartbeat" in str(info.value)
    assert "was waiting for" in str(info.value)
    assert info.value.__cause__ is backend
    assert group.failures == [info.value]


async def test_blame_waits_until_a_peer_that_just_stopped_is_silent(watched) -> None:
    beat, peer = watched
    assert beat.silent() is None  # the peer beats when the collective fails
    group = Group()
    backend = RuntimeError("Connection closed by peer")
    future = failed_by_thread(backend)
    peer.stop()
    # On the event loop: the blame runs in a worker thread over the heartbeat's rounds.
    with pytest.raises(CommunicationError) as info:
        await core(group, heartbeat=beat).until_done(future, LABEL)
    assert "rank 1 (pid " in str(info.value) and "sent no heartbeat" in str(info.value)
    assert info.value.__cause__ is backend


def test_blame_gives_the_backend_error_when_nobody_goes_silent() -> None:
    # A heartbeat with no peer: its rounds run and nobody is ever silent, so the
    # blame waits for the heartbeat's timeout and two beats, then gives up.
    store = dist.HashStore()
    beat = Heartbeat(store, rank=0, world_size=1, key="t", timeout_s=0.5, store_host_rank=None)
    beat.start()
    try:
        group = Group()
        backend = RuntimeError("Connection reset by peer")
        future = failed_by_thread(backend)
        started = time.monotonic()
        with pytest.raises(CommunicationError) as info:
            core(group, heartbeat=beat).until_done_blocking(future, LABEL)
        waited = time.monotonic() - started
    finally:
        beat.close()
    assert str(info.value) == f"{LABEL} failed: Connection reset by peer"
    assert waited >= beat.timeout_s + 2 * beat.interval_s  # the whole blame window


async def test_a_settled_future_is_read_without_yielding_to_the_loop() -> None:
    # As before the wait core: awaiting a collective that completed long ago lets no
    # other task run in between (the order of the loop's tasks stays as it was).
    future: concurrent.futures.Future = concurrent.futures.Future()
    setter = threading.Thread(target=future.set_result, args=(7,))
    setter.start()
    setter.join()
    ran = []
    other = asyncio.create_task(asyncio.sleep(0, result=None))
    other.add_done_callback(lambda _: ran.append(True))
    assert await core(Group()).until_done(future, LABEL) == 7
    assert ran == []  # the other task had no turn
    await other
    assert ran == [True]
