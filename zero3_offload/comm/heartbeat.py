"""Liveness of the other ranks, whatever a collective's legitimate duration.

[Note: heartbeat]
A collective's own timeout (``collective_timeout_s``) must allow for the
longest legitimate collective (a huge layer on a slow network), so it cannot
tell quickly that a rank has stopped answering. A :class:`Heartbeat` does,
through a side channel that never touches the training group: every rank's
*beat thread* adds 1 to its own counter in the rendezvous store every
``timeout_s / 5`` and reads every other rank's counter in the same round trip.
A rank is *silent* when its counter has not moved during this rank's rounds
of the last ``timeout_s``. Staleness is measured on this rank's own completed
rounds, so a pause of this process (a stop, a swap) never blames the others.
A rank that is computing, or waiting inside a long collective, keeps beating:
the beat thread does not need the event loop, the GIL is released by torch's
kernels and by the collectives, and nothing else runs on that thread.

The store is reached over a connection of the heartbeats' own (one per process
and store address, shared by the managers built in turn), opened from the
address of the default group's store, so a blocked call of torch's own client
never delays a beat. When the store itself stops answering for ``timeout_s`` (it
lives in rank 0's process under a ``tcp://`` rendezvous), its host is the
silent one.

Every rank publishes its host and pid at the start. For a peer on the same
host (the same pid namespace), :meth:`Heartbeat.silent` also looks at the
process itself: a peer whose process is gone is reported at once, and a
stopped one (state ``T``, e.g. SIGSTOP) is named as such.

Waits consult :meth:`Heartbeat.silent` while they wait, and confirm a finding
once more half a second later before they raise (see [Note: one wait] in
``comm.wait``): a collective whose last peer closed or exited just after it
completed, or this process resuming from a pause of its own, is then not
mistaken for silence. After a collective failed, :meth:`Heartbeat.wait_silent`
waits for the finding over the beat thread's rounds (each completed round is
signalled). The heartbeat never raises by itself.

The beat thread also carries the failure channel (see [Note: failure channel] in
``comm.failure_report``): between beats it looks every ``_FAILURE_POLL_S`` for the
current epoch's failure report, which :meth:`Heartbeat.failure` returns from
then on; :meth:`Heartbeat.publish_failure` writes one, :meth:`Heartbeat.meet`
is the ranks' meeting after it and :meth:`Heartbeat.advance_epoch` ends it.

A group's heartbeat starts with :meth:`Heartbeat.open`, a collective: rank 0
draws the keys' prefix and broadcasts it, every rank publishes its pid, and the
ranks agree that every one of them reached the store before any starts beating.

[Note: leaving cleanly]
A process whose training succeeded must end with status 0 and print nothing.
Two things stood in the way, both from beat threads that outlive their use:

1. A beat thread is a daemon, and most of its time is spent inside the store's
   calls, which release the GIL. When the interpreter finalizes while such a
   call is in flight, the thread's return into Python ends it with
   ``pthread_exit``, whose unwinding meets pybind11's ``gil_scoped_release``
   destructor (``noexcept``) and calls ``std::terminate``: the process aborts
   ("terminate called without an active exception", SIGABRT) after its work
   is done. It happens to scripts that never call ``destroy_process_group``
   (the process heartbeat beats until then) or never close a manager.
   So every heartbeat still beating is closed when the process ends, before
   finalization: at ``atexit`` (an interpreter's normal end, ``spawn``
   children included) and by a ``multiprocessing`` finalizer (children of
   ``fork`` and ``forkserver``, which end with ``os._exit`` after their
   target, skip ``atexit`` but run those). ``close`` joins the thread.
2. The store lives in its host's process (rank 0 under a ``tcp://``
   rendezvous). A host that ends first cuts a peer's beat thread mid-call,
   and torch's client logs the broken read ("recvValue failed ... Connection
   reset by peer", with a C++ stack) on the peer. So the host's
   :meth:`Heartbeat.close` waits until every peer that arrived has closed
   its heartbeat too (its counter marked closed), or has exited, is stopped or
   was already silent, for ``timeout_s`` at most: the store's host leaves last.
   So that it need not wait for a peer that still has work to do, the host
   first sets a *leaving* key; a peer's beat thread looks for it between beats (every
   ``_FAILURE_POLL_S``), acknowledges by marking its own counter closed, takes
   the host as closed (what :meth:`Heartbeat.silent` then reports) and makes
   no more calls to the store. A peer still working is so released within a
   tenth of a second.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import multiprocessing.util
import os
import random
import socket
import threading
import time
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from zero3_offload.comm.failure_report import FailureReport
from zero3_offload.errors import CommunicationError
from zero3_offload.logging import get_logger

__all__ = ["Heartbeat", "default_store", "process_state"]

log = get_logger(__name__)

_CLOSED = -(1 << 60)  # added to a counter by close(): a deliberate end, not silence
_ROUNDS_PER_TIMEOUT = 5
_FAILURE_POLL_S = 0.1  # how often the beat thread looks for a failure report
_MEET_POLL_S = 0.01  # how often a meeting looks for the other ranks' records
_LEAVE_POLL_S = 0.01  # how often the store's host looks for the others' ends


def default_store() -> dist.Store | None:
    """The default group's store, or None when torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


# One connection per store address and process, shared by the heartbeats built in
# turn (a new connection per manager exhausts the store's accept queue when many
# managers are built back to back); dropped when a beat finds it broken.
_CLIENTS: dict[tuple[str, int], dist.Store] = {}
_CLIENTS_LOCK = threading.Lock()


def _own_client(store: dist.Store, timeout_s: float) -> tuple[dist.Store, tuple[str, int] | None]:
    """A connection of the heartbeats' own to the TCP store behind ``store`` (and its
    address), or ``store`` itself when it is no TCP store."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return store, None  # a file or hash store: no connection to block on
    address = (inner.host, inner.port)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(address)
        if client is None:
            try:
                client = dist.TCPStore(
                    inner.host,
                    inner.port,
                    is_master=False,
                    timeout=_dt.timedelta(seconds=timeout_s),
                    wait_for_workers=False,
                )
            except RuntimeError as exc:  # DistNetworkError, a store timeout
                raise CommunicationError(
                    f"cannot reach the rendezvous store at {inner.host}:{inner.port} for the "
                    f"heartbeat: {str(exc).splitlines()[0]}"
                ) from exc
            _CLIENTS[address] = client
    return client, address


def _drop_client(address: tuple[str, int] | None) -> None:
    if address is not None:
        with _CLIENTS_LOCK:
            _CLIENTS.pop(address, None)


# The heartbeats beating in this process, closed when it ends (see [Note: leaving
# cleanly]); the pid whose exit hooks are registered (a forked child registers its own).
_BEATING: set[Heartbeat] = set()
_BEATING_LOCK = threading.Lock()
_EXIT_HOOKS_PID: int | None = None


def _forget_parent_heartbeats() -> None:
    """In a forked child: none of the parent's beat threads run here."""
    global _BEATING_LOCK
    _BEATING_LOCK = threading.Lock()  # the parent's may have been held at the fork
    _BEATING.clear()


os.register_at_fork(after_in_child=_forget_parent_heartbeats)


def _close_at_exit() -> None:
    """Close every heartbeat still beating in this process (at its end)."""
    with _BEATING_LOCK:
        beating = list(_BEATING)
    for beat in beating:
        beat.close()


def _register_exit_hooks() -> None:
    """Have :func:`_close_at_exit` run when this process ends, however it ends cleanly
    (see [Note: leaving cleanly])."""
    global _EXIT_HOOKS_PID
    if os.getpid() == _EXIT_HOOKS_PID:
        return
    _EXIT_HOOKS_PID = os.getpid()
    atexit.register(_close_at_exit)
    multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=100)


def _pid_space() -> str:
    """Hostname and pid namespace: pids are comparable within one such space."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}#{namespace}"


def process_state(pid: int) -> str | None:
    """'gone', 'stopped' (SIGSTOP, a debugger) or None (running, or unknown here)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return None
    if state in ("Z", "X"):
        return "gone"
    return "stopped" if state in ("T", "t") else None


@attrs.define
class _Peer:
    rank: int
    pid: int | None = None
    same_host: bool = False
    host: str = "?"
    value: int | None = None
    changed_at: float = 0.0  # time.monotonic() of this rank's round that saw it move
    closed: bool = False


class Heartbeat:
    """Beats for this rank and watches the others (see [Note: heartbeat]).

    Args:
        store: the rendezvous store (e.g. :func:`default_store`).
        rank: this rank in the group.
        world_size: ranks in the group.
        key: prefix of this heartbeat's keys, the same on every rank and unique
            per run (the caller agrees on it with a broadcast).
        timeout_s: silence after which a rank is reported.
        store_host_rank: the rank whose process serves the store (0 under a
            ``tcp://`` rendezvous), or None when it is served elsewhere.
        closed_as: how a rank that closed this heartbeat on purpose is reported.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        key: str,
        timeout_s: float,
        store_host_rank: int | None = 0,
        closed_as: str = "has closed its manager",
    ) -> None:
        self.rank = rank
        self._closed_as = closed_as
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = timeout_s / _ROUNDS_PER_TIMEOUT
        self.store_host_rank = store_host_rank
        self._key = key
        self._store, self._address = _own_client(store, timeout_s)
        self._lock = threading.Lock()
        self._rounds = threading.Condition()  # notified after each round, and when beating ends
        self._stop = threading.Event()
        self._peers = {r: _Peer(r) for r in range(world_size) if r != rank}
        self._last_round = time.monotonic()
        self._store_error: str | None = None
        self._leaving_key = f"{key}/leaving"  # set by the store's host when it closes
        self._acknowledged_leaving = False  # this rank saw it (its counter marked closed)
        self._thread: threading.Thread | None = None
        self.epoch = 0  # failures recovered from so far (see [Note: failure channel])
        self._failure: FailureReport | None = None  # the current epoch's report, once seen
        try:
            self._store.add(self._counter(rank), 1)
            self._store.set(
                f"{key}/who/{rank}", f"{_pid_space()} {os.getpid()} {socket.gethostname()}"
            )
        except Exception:
            _drop_client(self._address)
            raise

    @classmethod
    def open(
        cls,
        group: dist.ProcessGroup,
        *,
        device: torch.device,
        timeout_s: float,
        broadcast: Callable[[torch.Tensor], None],
        agree: Callable[[bool], bool],
    ) -> Heartbeat | None:
        """Start ``group``'s heartbeat on every rank; None, on every rank, when torch
        exposes no store. A collective.

        ``broadcast(tensor)`` copies rank 0's int64 tensor (on ``device``) to every
        rank in place; ``agree(ok)`` is True when every rank passed True.

        Raises:
            CommunicationError: when the rendezvous store did not answer on some rank.
        """
        store = default_store()
        if store is None:
            return None
        rank = group.rank()
        key = torch.tensor([random.getrandbits(62) if rank == 0 else 0], dtype=torch.int64)
        key = key.to(device)
        broadcast(key)
        global_ranks = dist.get_process_group_ranks(group)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        host = None if agent_store or 0 not in global_ranks else global_ranks.index(0)
        beat = error = None
        try:
            beat = cls(
                store,
                rank=rank,
                world_size=group.size(),
                key=f"zero3/heartbeat/{int(key.item()):016x}",
                timeout_s=timeout_s,
                store_host_rank=host,
            )
        except Exception as exc:  # reported on every rank below
            error = exc
        # Every rank has published its pid once this collective completes.
        if not agree(beat is not None):
            if beat is not None:
                beat.close()
            raise CommunicationError(
                "cannot start the heartbeat: the rendezvous store did not answer on "
                f"{'this rank' if error is not None else 'another rank'}"
                + (f" ({type(error).__name__}: {error})" if error is not None else "")
            ) from error
        assert beat is not None
        beat.start()
        return beat

    def _counter(self, rank: int) -> str:
        return f"{self._key}/beat/{rank}"

    def start(self) -> None:
        """Learn the peers' pids (each rank published its own in the constructor), then
        start beating. A peer that has not published yet is *absent*, not silent, until
        its first beat (see :meth:`absent`): call this after a collective that follows
        every rank's construction, or watch :meth:`absent` while the ranks arrive."""
        for peer in self._peers.values():
            self._learn(peer)
        now = time.monotonic()
        for peer in self._peers.values():
            peer.changed_at = now
        self._last_round = now
        self._thread = threading.Thread(
            target=self._run, name=f"zero3-heartbeat-{self.rank}", daemon=True
        )
        with _BEATING_LOCK:
            _register_exit_hooks()
            _BEATING.add(self)
        self._thread.start()

    def _learn(self, peer: _Peer) -> None:
        """Read ``peer``'s host and pid, once it has published them."""
        key = f"{self._key}/who/{peer.rank}"
        if peer.pid is not None or not self._store.check([key]):
            return
        try:
            peer_space, pid, host = self._store.get(key).decode().split(" ", 2)
        except (RuntimeError, ValueError, UnicodeDecodeError):
            return  # naming the pid is a convenience: the counters decide
        with self._lock:  # silent() reads the peers from other threads
            peer.pid, peer.host, peer.same_host = int(pid), host, peer_space == _pid_space()

    def _round(self) -> None:
        self._store.add(self._counter(self.rank), 1)
        absent = self.absent()
        arrived = [r for r in self._peers if r not in absent]
        # A peer that has not arrived has no counter yet: a read of it would block.
        arrived += [r for r in absent if self._store.check([self._counter(r)])]
        keys = [self._counter(r) for r in arrived]
        values = [int(v) for v in self._store.multi_get(keys)] if keys else []
        for rank in arrived:
            self._learn(self._peers[rank])
        # A rank publishes its failed call before it closes or exits: the report is read
        # before a close this round found becomes visible to silent(), so that a wait
        # names the failure rather than the silence.
        self._poll_failure()
        now = time.monotonic()
        with self._lock:
            for rank, value in zip(arrived, values, strict=True):
                peer = self._peers[rank]
                if value != peer.value:
                    peer.value, peer.changed_at = value, now
                peer.closed = value < 0
            self._last_round = now
            self._store_error = None

    def _failure_key(self, epoch: int) -> str:
        return f"{self._key}/failure/{epoch}"

    def _poll_failure(self) -> None:
        """Read the current epoch's failure report once it exists."""
        with self._lock:
            epoch, known = self.epoch, self._failure
        if known is not None:
            return
        key = self._failure_key(epoch)
        if self._store.check([key]):
            report = FailureReport.decode(self._store.get(key))
            with self._lock:
                if self.epoch == epoch and self._failure is None:
                    self._failure = report

    def _host_leaving(self) -> bool:
        """Whether the store's host has begun to leave; the first time this rank sees it,
        it acknowledges (its counter marked closed) and takes the host as closed (see
        [Note: leaving cleanly]). Called by the beat thread between beats."""
        host = self.store_host_rank
        if host is None or host == self.rank or not self._store.check([self._leaving_key]):
            return False
        self._store.add(self._counter(self.rank), _CLOSED)
        with self._lock:
            self._acknowledged_leaving = True
            self._peers[host].closed = True
        return True

    def _run(self) -> None:
        try:
            next_beat = time.monotonic()
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_beat:
                        self._round()
                        next_beat = time.monotonic() + self.interval_s
                        with self._rounds:
                            self._rounds.notify_all()
                    self._poll_failure()
                    if self._host_leaving():
                        return  # acknowledged: no more calls to a store that may be gone
                except Exception as exc:
                    # The store's host is gone or stopped: a TCP store client does not
                    # recover its connection, so beating ends here and silent() reports
                    # the store once its silence exceeds the timeout.
                    with self._lock:
                        self._store_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    _drop_client(self._address)
                    return
                self._stop.wait(min(_FAILURE_POLL_S, max(next_beat - time.monotonic(), 0.0)))
        finally:
            with self._rounds:
                self._rounds.notify_all()

    def failure(self) -> FailureReport | None:
        """The current epoch's failure report, once the beat thread (or this rank's own
        :meth:`publish_failure`) has seen one; None while no rank's call failed."""
        with self._lock:
            return self._failure

    def publish_failure(self, report: FailureReport) -> FailureReport:
        """Publish ``report`` as the current epoch's failure, unless another rank's came
        first; returns the epoch's report (the first one)."""
        key = self._failure_key(self.epoch)
        try:
            stored = self._store.compare_set(key, "", report.encode())
        except Exception as exc:  # the store's host is gone: its silence is reported
            raise CommunicationError(
                f"cannot publish this rank's failure ({report.describe()}): the rendezvous "
                f"store did not answer ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from exc
        first = FailureReport.decode(stored)
        with self._lock:
            self._failure = first
        return first

    def meet(
        self, record: str, *, timeout_s: float, doing: str, topic: str = "recover"
    ) -> list[str]:
        """Every rank's ``record`` for the current epoch and ``topic``, in rank order, once
        every rank has given its own (a meeting through the store, watched by the heartbeat).

        Raises:
            CommunicationError: when a rank is silent (named) or ``timeout_s`` passes.
        """
        prefix = f"{self._key}/{topic}/{self.epoch}"
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        try:
            self._store.set(keys[self.rank], record)
            while not self._store.check(keys):
                silent = self.silent()
                if silent is not None:
                    raise CommunicationError(
                        f"{silent}; this rank ({self.rank}) was waiting for every rank to "
                        f"{doing}. The run cannot continue: restart the ranks and resume "
                        "from the last checkpoint"
                    )
                if time.monotonic() > deadline:
                    raise CommunicationError(
                        f"not every rank came to {doing} within {timeout_s:g} s; the run "
                        "cannot continue: restart the ranks and resume from the last checkpoint"
                    )
                time.sleep(_MEET_POLL_S)  # polls the store for the others' records
            return [v.decode() for v in self._store.multi_get(keys)]
        except CommunicationError:
            raise
        except Exception as exc:  # the store's host is gone
            raise CommunicationError(
                f"the rendezvous store stopped answering while this rank ({self.rank}) "
                f"waited for every rank to {doing}: {str(exc).splitlines()[0]}"
            ) from exc

    def advance_epoch(self) -> None:
        """End the current epoch's failure: the next report is a new failure."""
        with self._lock:
            self.epoch += 1
            self._failure = None

    def wait_silent(self, until: float) -> str | None:
        """:meth:`silent`'s finding, waited for until ``time.monotonic()`` reaches ``until``;
        None if nobody is silent by then.

        It looks at once (a peer on this host whose process is gone is found
        then), after each of the beat thread's rounds (a counter that stopped
        moving, a process that exited meanwhile) and, once the rounds themselves
        stop, when the store's silence exceeds the timeout.
        """
        with self._rounds:
            while (found := self.silent()) is None:
                now = time.monotonic()
                if now >= until:
                    return None
                with self._lock:
                    store_due = self._last_round + self.timeout_s - now
                # A round's notification, or the moment the store's silence is due.
                self._rounds.wait(min(until - now, max(store_due, 0.0) + 0.01))
        return found

    def _describe(self, peer: _Peer, what: str) -> str:
        where = f"pid {peer.pid} on {peer.host}" if peer.pid is not None else "its process"
        return f"rank {peer.rank} ({where}) {what}"

    def silent(self) -> str | None:
        """A sentence naming the ranks that stopped answering, or None while all answer."""
        now = time.monotonic()
        with self._lock:
            peers = [attrs.evolve(p) for p in self._peers.values()]
            last_round, store_error = self._last_round, self._store_error
        found: list[str] = []
        for peer in peers:
            state = process_state(peer.pid) if peer.same_host and peer.pid else None
            if state == "gone":
                found.append(self._describe(peer, "has exited"))
            elif peer.closed:
                found.append(self._describe(peer, self._closed_as))
            elif peer.value is not None and last_round - peer.changed_at > self.timeout_s:
                quiet = last_round - peer.changed_at
                detail = " (the process is stopped)" if state == "stopped" else ""
                found.append(self._describe(peer, f"sent no heartbeat for {quiet:.1f} s{detail}"))
        if not found and now - last_round > self.timeout_s:
            host = (
                self._peers.get(self.store_host_rank) if self.store_host_rank is not None else None
            )
            cause = f" ({store_error})" if store_error else ""
            if host is not None:
                state = process_state(host.pid) if host.same_host and host.pid else None
                detail = {"gone": "has exited", "stopped": "is stopped"}.get(
                    state or "", "stopped answering"
                )
                found.append(
                    self._describe(host, detail)
                    + f": the rendezvous store it serves has not answered for "
                    f"{now - last_round:.1f} s{cause}"
                )
            else:
                found.append(
                    f"the rendezvous store has not answered for {now - last_round:.1f} s{cause}"
                )
        return "; ".join(found) if found else None

    def absent(self) -> list[int]:
        """The ranks that have not beaten yet (not arrived: never silent)."""
        with self._lock:
            return [p.rank for p in self._peers.values() if p.value is None]

    def close(self) -> None:
        """Stop beating and tell the others this rank ended on purpose. The store's host
        then waits for the others to end theirs, or to see it leave (see [Note: leaving
        cleanly])."""
        with _BEATING_LOCK:
            _BEATING.discard(self)
        if self._thread is None or self._stop.is_set():
            self._stop.set()
            return
        self._stop.set()
        self._thread.join(timeout=self.interval_s + self.timeout_s)
        if self._store_error is not None or self._acknowledged_leaving:
            return  # nobody can be told, or the others know (the store's host has left)
        try:
            if self.rank == self.store_host_rank:
                self._store.set(self._leaving_key, "")
            self._store.add(self._counter(self.rank), _CLOSED)
            if self.rank == self.store_host_rank:
                self._await_peers_leaving()
        except Exception as exc:  # the store is gone with its host: nobody is left to tell
            log.debug("heartbeat_close_unreported", rank=self.rank, error=str(exc))

    def _await_peers_leaving(self) -> None:
        """Wait, ``timeout_s`` at most, until every peer that arrived (its counter
        exists) has closed its heartbeat, acknowledged this rank's leaving, or exited
        (this rank serves the store); one that is stopped, or that this rank's rounds
        found silent already, is not waited for."""
        with self._lock:
            silent = {
                p.rank
                for p in self._peers.values()
                if p.value is not None and self._last_round - p.changed_at > self.timeout_s
            }
        waiting = [
            r for r in self._peers if r not in silent and self._store.check([self._counter(r)])
        ]
        for rank in waiting:
            self._learn(self._peers[rank])  # its pid, to see it exit
        deadline = time.monotonic() + self.timeout_s
        while waiting := [r for r in waiting if not self._gone(r)]:
            values = self._store.multi_get([self._counter(r) for r in waiting])
            waiting = [r for r, value in zip(waiting, values, strict=True) if int(value) >= 0]
            if waiting and time.monotonic() > deadline:
                log.debug("heartbeat_left_before_peers", rank=self.rank, peers=waiting)
                return
            if waiting:
                time.sleep(_LEAVE_POLL_S)  # polls the store for the others' ends

    def _gone(self, rank: int) -> bool:
        """Whether ``rank``'s process, on this host, has exited or is stopped (it will
        not answer while this rank waits)."""
        peer = self._peers[rank]
        return peer.same_host and peer.pid is not None and process_state(peer.pid) is not None
