"""Driver side of the API fuzz: long-lived rank processes that run the calls it sends.

:class:`RankServer` starts ``world_size`` real gloo ranks with
``zero3_offload.testing.run_ranks`` (in a thread of its own, as the fuzz driver is
synchronous), each running ``fuzz_rank.serve``, which connects back over a local
authenticated socket. :meth:`RankServer.request` sends one message to every rank
and waits for every answer under a deadline: a rank that does not answer in time
is a hang, a rank whose connection or process ends is a crash; either raises
:class:`RankFailure` after the ranks were killed, and the next request starts
fresh ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from fuzz_rank import serve

from zero3_offload.testing import rank_pids_alive, run_ranks

__all__ = ["RankFailure", "RankServer"]


class RankFailure(AssertionError):
    """A rank hung, crashed or did not start: an invariant of the fuzz failed."""


class RankServer:
    """Rank processes that answer the driver's messages (see ``fuzz_rank.serve``).

    Args:
        world_size: ranks to start.
        timeout_s: default deadline of one request (all ranks' answers).
        lifetime_s: limit of the ranks' whole life (``run_ranks``' timeout).
    """

    def __init__(
        self, world_size: int = 2, *, timeout_s: float = 60.0, lifetime_s: float = 6 * 3600.0
    ) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.lifetime_s = lifetime_s
        self.starts = 0  # times rank processes were started
        self.pids: list[int] = []
        self._conns: list[Connection] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._error: BaseException | None = None  # how run_ranks ended, if it raised
        self._dumps: str | None = None  # where ranks write their stacks on SIGUSR1

    # -------------------------------------------------------------- lifecycle

    @property
    def alive(self) -> bool:
        return bool(self._conns) and self._thread is not None and self._thread.is_alive()

    def ensure_started(self) -> None:
        if not self.alive:
            self.kill()
            self._start()

    def _start(self) -> None:
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        self._dumps = tempfile.mkdtemp(prefix="zero3-fuzz-stacks-")
        self._error = None
        self._thread = threading.Thread(
            target=self._run_ranks, args=(listener.address, authkey, self._dumps), daemon=True
        )
        self._thread.start()
        self.starts += 1
        accepted: list[Connection] = []
        acceptor = threading.Thread(target=self._accept, args=(listener, accepted), daemon=True)
        acceptor.start()
        deadline = time.monotonic() + self.timeout_s + 60.0  # process start and rendezvous
        while acceptor.is_alive():
            acceptor.join(0.1)
            if acceptor.is_alive() and (not self._thread.is_alive() or time.monotonic() > deadline):
                # Unblock accept() with connections of our own (closing the listener
                # does not), then give up on these ranks.
                while acceptor.is_alive():
                    with contextlib.suppress(OSError, EOFError, AuthenticationError):
                        Client(listener.address, authkey=authkey).close()
                    acceptor.join(1.0)
                listener.close()
                for conn in accepted:
                    conn.close()
                self.kill()
                raise RankFailure(f"the ranks did not start: {self._error!r}")
        listener.close()
        if not all(conn.poll(self.timeout_s) for conn in accepted):
            for conn in accepted:
                conn.close()
            self.kill()
            raise RankFailure(f"a rank connected but did not say hello: {self._error!r}")
        hello = sorted((*conn.recv(), conn) for conn in accepted)
        self.pids = [pid for _, _, pid, _ in hello]
        self._conns = [conn for *_, conn in hello]

    def _accept(self, listener: Listener, accepted: list[Connection]) -> None:
        with contextlib.suppress(OSError, EOFError, AuthenticationError):
            while len(accepted) < self.world_size:
                accepted.append(listener.accept())

    def _run_ranks(self, address: tuple[str, int], authkey: bytes, dumps: str) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            try:
                await run_ranks(
                    serve, self.world_size, address, authkey, dumps, timeout_s=self.lifetime_s
                )
            except BaseException as exc:  # kept for the report; the driver decides
                self._error = exc

        asyncio.run(main())

    def kill(self) -> None:
        """Stop the ranks now: cancel ``run_ranks`` (it terminates its processes), then
        SIGKILL any of their pids still alive."""
        for conn in self._conns:
            conn.close()
        self._conns = []
        if self._thread is not None and self._thread.is_alive():
            if self._loop is not None and self._task is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self._loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(timeout=30.0)
        for pid in rank_pids_alive(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._thread = None
        self.pids = []
        if self._dumps is not None:
            shutil.rmtree(self._dumps, ignore_errors=True)
            self._dumps = None

    def stop(self) -> None:
        """Ask the ranks to return, and wait for them; kill them if they do not."""
        if self.alive:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send(("stop", None))
            assert self._thread is not None
            self._thread.join(timeout=self.timeout_s)
        self.kill()

    def __enter__(self) -> RankServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- requests

    def request(self, kind: str, payload: Any, *, timeout_s: float | None = None) -> list[Any]:
        """Send ``(kind, payload)`` to every rank; every rank's answer, in rank order.

        Raises:
            RankFailure: when a rank does not answer within the deadline (a hang) or
                its process or connection ended (a crash); the ranks are killed.
        """
        what = f"{kind} {getattr(payload, 'describe', lambda: '')()}".strip()
        self.ensure_started()
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            for conn in self._conns:
                conn.send((kind, payload))
        except OSError as exc:
            self._fail(f"a rank's connection is gone before {what}: {exc!r}")
        deadline = time.monotonic() + limit
        answers = []
        for rank, conn in enumerate(self._conns):
            while True:
                try:
                    if conn.poll(min(max(deadline - time.monotonic(), 0.0), 0.5)):
                        answers.append(conn.recv())
                        break
                except (EOFError, OSError) as exc:
                    self._fail(f"rank {rank} died during {what}: {exc!r}")
                dead = [r for r, pid in enumerate(self.pids) if not rank_pids_alive([pid])]
                if dead:
                    self._fail(f"rank(s) {dead} exited during {what}")
                if time.monotonic() > deadline:
                    stacks = self._stacks()
                    self._fail(
                        f"hang: rank {rank} did not answer {what} within {limit:g} s\n{stacks}"
                    )
        return answers

    def _stacks(self) -> str:
        """Every rank's Python stacks now (the ranks write them on SIGUSR1)."""
        if self._dumps is None:
            return ""
        files = [Path(self._dumps, f"rank{r}.txt") for r in range(len(self.pids))]
        for pid in rank_pids_alive(self.pids):
            os.kill(pid, signal.SIGUSR1)
        # faulthandler writes from the signal handler: wait until every file has
        # stopped growing, at most a few seconds.
        deadline = time.monotonic() + 5.0
        sizes: list[int] = []
        while time.monotonic() < deadline:
            now = [f.stat().st_size if f.exists() else 0 for f in files]
            if now == sizes and all(now):
                break
            sizes = now
            time.sleep(0.1)  # polling the files the signal handlers write
        return "\n".join(
            f"--- rank {r} stacks ---\n{f.read_text(errors='replace')[-6000:]}"
            for r, f in enumerate(files)
            if f.exists()
        )

    def _fail(self, message: str) -> None:
        pids = list(self.pids)
        self.kill()
        detail = f"\nrun_ranks: {self._error}" if self._error is not None else ""
        raise RankFailure(f"{message} (rank pids {pids}, killed){detail}")
