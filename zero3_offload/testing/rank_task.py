"""What the pytest process sends a rank for one test, and what the rank answers."""

from __future__ import annotations

from typing import Any

import attrs

from zero3_offload.testing.code_location import CodeLocation

__all__ = ["AssertionSettings", "RankOutcome", "RankTask", "ReportStyle"]


@attrs.frozen
class AssertionSettings:
    """What pytest's explanation of a failed comparison reads from its config, as the pytest
    process has it (see ``testing.rank_assertions``).

    ``verbosity`` is the assertion verbosity; ``ini`` the ini options it reads, as
    ``(name, value)`` pairs, those the running pytest has; ``plugins`` which of the
    plugins it asks about are registered; ``markup`` and ``code_highlight`` those of
    the terminal writer.
    """

    verbosity: int = 0
    ini: tuple[tuple[str, Any], ...] = ()
    plugins: frozenset[str] = frozenset()
    markup: bool = False
    code_highlight: bool = False


@attrs.frozen
class ReportStyle:
    """How the pytest process shows a failure (``--tb``, ``-l``, ``--full-trace``, ``-v``,
    and what its explanation of a failed comparison reads)."""

    tbstyle: str = "auto"
    showlocals: bool = False
    fulltrace: bool = False
    abspath: bool = False
    verbosity: int = 0
    assertions: AssertionSettings = attrs.field(factory=AssertionSettings)


@attrs.frozen
class RankTask:
    """One test for every rank: the function, the values to call it with, where to run.

    ``values`` is a pickle of the parameters and ordinary fixture values by
    name, unpickled only once ``modules`` are imported (they may define the
    values' classes). A value that is a
    :class:`~zero3_offload.testing.rank_fixture.RankSide` is computed in the rank.
    """

    nodeid: str
    test: CodeLocation
    argnames: tuple[str, ...]
    modules: tuple[CodeLocation, ...]
    values: bytes
    cwd: str
    sys_path: tuple[str, ...]
    style: ReportStyle
    call: bool = False


@attrs.frozen
class RankOutcome:
    """One rank's result of a task.

    ``status`` is ``"passed"``, ``"failed"``, ``"skipped"``, ``"xfailed"``, or
    ``"stale"`` when a reused group did not pass its check before the test (the
    test did not run; see ``rank_worker._group_agrees``);
    ``message`` is one line (the exception, or the skip reason); ``longrepr`` is
    the failure as pytest renders it (a picklable ``ExceptionChainRepr``);
    ``reusable`` is False when the process must not run another test (its group
    is gone, or it was interrupted); ``result`` is the pickled return value of a
    ``call`` task.
    """

    rank: int
    status: str
    message: str = ""
    location: str = ""
    longrepr: Any = None
    reusable: bool = True
    result: bytes | None = None
