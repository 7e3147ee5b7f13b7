"""A failed multi-rank test as pytest shows it: the first failing rank's traceback,
then a section saying which rank that was and what every other rank did."""

from __future__ import annotations

from typing import Any

from zero3_offload.testing.rank_pool import START_LIMIT_S, PoolRun
from zero3_offload.testing.rank_task import RankOutcome
from zero3_offload.testing.run_ranks import RankFailedError

__all__ = ["RankTestFailed", "failure_repr", "failure_text"]


class RankTestFailed(RankFailedError):
    """A ``@pytest.mark.ranks`` test failed in a rank, a rank crashed, or it timed out.

    Raised in the pytest process; the test's report shows :func:`failure_repr`.
    """

    def __init__(self, run: PoolRun) -> None:
        self.run = run
        super().__init__(_headline(run))


def _first_failure(run: PoolRun) -> RankOutcome | None:
    """The rank the report is about: one that died (the others' errors are then most often
    its consequence, even when they were seen first), else the first that failed."""
    crashed = [o for o in run.outcomes if o.status == "crashed"]
    failed = [o for o in run.outcomes if o.status == "failed"]
    return (crashed + failed)[0] if crashed or failed else None


def _headline(run: PoolRun) -> str:
    first = _first_failure(run)
    if first is not None and first.status == "crashed":
        return f"rank {first.rank} of {run.world_size} {first.message}"
    if first is not None:
        return f"rank {first.rank} of {run.world_size} failed: {first.message}"
    if not run.started:
        return (
            f"ranks {sorted(run.stacks)} of {run.world_size} did not start the test within "
            f"{max(run.timeout_s, START_LIMIT_S):g} s (joining the group, importing its modules)"
        )
    return (
        f"ranks {sorted(run.stacks)} of {run.world_size} did not finish within {run.timeout_s:g} s"
    )


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _others(run: PoolRun, first: RankOutcome | None) -> str:
    lines = []
    by_rank = {o.rank: o for o in run.outcomes}
    for rank in range(run.world_size):
        if first is not None and rank == first.rank:
            continue
        outcome = by_rank.get(rank)
        if outcome is None:
            stack = run.stacks.get(rank, "") or "(the rank wrote no stack)"
            state = "had not finished" if first is not None else "was still running"
            lines.append(f"rank {rank}: {state}; where it was:\n{_indent(stack)}")
        elif outcome.status == "failed":
            where = f" ({outcome.location})" if outcome.location else ""
            lines.append(f"rank {rank}: failed too{where}:\n{_indent(outcome.message)}")
        elif outcome.status == "crashed":
            lines.append(f"rank {rank}: {outcome.message}")
        else:
            lines.append(f"rank {rank}: {outcome.status}")
    return "\n".join(lines)


def failure_repr(run: PoolRun, test_path: str, test_line: int) -> Any:
    """The longrepr of a test report for ``run`` (a pytest ``ExceptionChainRepr`` or
    ``ReprExceptionInfo``, which pytest-xdist also carries between processes)."""
    from _pytest._code.code import (
        ExceptionChainRepr,
        ReprExceptionInfo,
        ReprFileLocation,
        ReprTraceback,
    )

    first = _first_failure(run)
    headline = _headline(run)
    if first is not None and first.status == "failed" and hasattr(first.longrepr, "toterminal"):
        longrepr = first.longrepr
        crash = longrepr.reprcrash
        marked = ReprFileLocation(
            path=crash.path if crash else test_path,
            lineno=crash.lineno if crash else test_line,
            message=f"[rank {first.rank}] {crash.message if crash else first.message}",
        )
        if isinstance(longrepr, ExceptionChainRepr):
            chain = [*longrepr.chain[:-1], (longrepr.chain[-1][0], marked, longrepr.chain[-1][2])]
            longrepr = ExceptionChainRepr(chain)
        else:
            longrepr = ReprExceptionInfo(reprtraceback=longrepr.reprtraceback, reprcrash=marked)
        title = f"rank {first.rank} of {run.world_size} failed (the traceback above is its own)"
    else:
        if first is not None and first.status == "failed":  # a text repr (did not pickle)
            headline = f"{headline}\n{first.longrepr}"
        longrepr = ReprExceptionInfo(
            reprtraceback=ReprTraceback([], None, "long"),
            reprcrash=ReprFileLocation(path=test_path, lineno=test_line, message=headline),
        )
        title = headline.splitlines()[0]
    others = _others(run, first)
    longrepr.addsection(title, others if others else "(no other rank)")
    return longrepr


def failure_text(run: PoolRun) -> str:
    """``run``'s failure as a message: the failing rank's traceback text (a ``call``
    task's message), or the headline, then what the other ranks did."""
    first = _first_failure(run)
    head = first.message if first is not None and first.status == "failed" else _headline(run)
    others = _others(run, first)
    return f"{head}\n{others}" if others else head
