"""The rank pools of one pytest session, and ``run_ranks`` on them.

The plugin's ``@pytest.mark.ranks`` tests and :meth:`RankRunner.run` share the
session's pools: one :class:`~zero3_offload.testing.rank_pool.RankPool` per
world size, backend and thread count, kept from one test to the next while
every rank passed, and killed otherwise. A test whose reused group fails the
check before it (see ``rank_worker._group_agrees``) runs again on new processes.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from zero3_offload.testing.code_location import CodeLocation
from zero3_offload.testing.rank_pool import PoolRun, RankPool
from zero3_offload.testing.rank_report import failure_text
from zero3_offload.testing.rank_task import RankTask, ReportStyle
from zero3_offload.testing.run_ranks import RankFailedError

__all__ = ["RankRunner", "session_runner"]

# The runners of the pytest sessions in progress in this process, innermost last (pytester
# runs sessions inside a session).
_SESSIONS: list[RankRunner] = []


def session_runner() -> RankRunner | None:
    """The running pytest session's :class:`RankRunner` (None outside pytest, or where the
    plugin is off): test helpers run their rank functions on it."""
    return _SESSIONS[-1] if _SESSIONS else None


class RankRunner:
    """The rank processes of a pytest session.

    Args:
        reuse: keep processes between runs (the ini option ``ranks_reuse``);
            False starts new ones for every run.
    """

    def __init__(self, *, reuse: bool = True) -> None:
        self.reuse = reuse
        self._pools: dict[tuple[int, str, int], RankPool] = {}

    def execute(
        self,
        task: RankTask,
        *,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        threads: int = 1,
        fresh: bool = False,
    ) -> PoolRun:
        """Run ``task`` on ``world_size`` ranks (new ones when ``fresh``)."""
        key = (world_size, backend, threads)
        reuse = self.reuse and not fresh
        pool = self._pools.pop(key, None) if reuse else None
        for attempt in range(2):
            if pool is None or not pool.usable:
                if pool is not None:
                    pool.kill()
                pool = RankPool(world_size=world_size, backend=backend, threads=threads)
            try:
                run = pool.run(task, timeout_s)
            except BaseException:  # an interrupt (Ctrl-C) while the ranks run
                pool.kill()
                raise
            if attempt or not any(o.status == "stale" for o in run.outcomes):
                break
            pool.kill()  # a reused group that failed its check: the task runs on new ranks
            pool = None
        if reuse and run.ok and pool.usable and all(o.reusable for o in run.outcomes):
            self._pools[key] = pool
        else:
            pool.kill()
        return run

    def run(
        self,
        fn: Callable[..., Awaitable[Any]],
        world_size: int,
        *args: Any,
        timeout_s: float = 180.0,
        threads_per_rank: int = 1,
        backend: str = "gloo",
        fresh: bool = False,
    ) -> list[Any]:
        """:func:`~zero3_offload.testing.run_ranks` on the session's processes: each rank
        returns ``await fn(ctx, *args)``; the results come back in rank order.

        Blocks until the ranks are done (call it from a fixture or a test; an async
        test's event loop waits with it). The processes may have run other tests
        before: use :func:`~zero3_offload.testing.run_ranks`, or ``fresh=True``, where
        a run needs processes of its own (peak RSS, process-wide settings).

        Raises:
            RankFailedError: a rank raised (the message holds its traceback), crashed
                or did not finish within ``timeout_s``.
        """
        location = CodeLocation.of(fn)
        task = RankTask(
            nodeid=f"{location.module}.{location.qualname}",
            test=location,
            argnames=(),
            modules=(location,) if location.rewritten else (),
            values=pickle.dumps((fn, args)),
            cwd=os.getcwd(),
            sys_path=tuple(sys.path),
            style=ReportStyle(),
            call=True,
        )
        run = self.execute(
            task,
            world_size=world_size,
            timeout_s=timeout_s,
            backend=backend,
            threads=threads_per_rank,
            fresh=fresh,
        )
        if not run.ok:
            raise RankFailedError(failure_text(run))
        results = {o.rank: o.result for o in run.outcomes}
        return [pickle.loads(results[r]) for r in range(world_size)]  # type: ignore[arg-type]

    def open(self) -> None:
        """Make this the session runner of :func:`session_runner`."""
        _SESSIONS.append(self)

    def close(self) -> None:
        """Close every pool (its processes end); no longer the session runner."""
        if self in _SESSIONS:
            _SESSIONS.remove(self)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
