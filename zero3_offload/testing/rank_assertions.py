"""pytest's explanation of a failed comparison (``assert a == b``), inside a rank.

The assertion rewriting that a rank's test module gets (see
``testing.code_location``) asks ``_pytest.assertion.util._reprcompare`` to
explain a failed comparison; pytest sets it for the duration of a test in its
own process only. A rank sets it to pytest's own explanation
(``assertrepr_compare``: the differing items, the full diff), with the verbosity
and truncation of the pytest process. ``pytest_assertrepr_compare`` hooks of
plugins and conftests are not called in a rank.
"""

from __future__ import annotations

import io
from typing import Any

from zero3_offload.testing.rank_task import ReportStyle

__all__ = ["explain_comparisons"]


class _Config:
    """The parts of pytest's ``Config`` that ``assertrepr_compare`` and truncation read."""

    def __init__(self, style: ReportStyle) -> None:
        self._style = style

    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        if verbosity_type == "assertions":
            return self._style.assertion_verbosity
        return self._style.verbosity

    def get_terminal_writer(self) -> Any:
        from _pytest._io import TerminalWriter

        writer = TerminalWriter(io.StringIO())
        writer.hasmarkup = False
        return writer

    def getini(self, name: str) -> Any:
        return {
            "truncation_limit_lines": self._style.truncation_lines,
            "truncation_limit_chars": self._style.truncation_chars,
        }[name]


class _Item:
    def __init__(self, config: _Config) -> None:
        self.config = config


def explain_comparisons(style: ReportStyle) -> None:
    """Have failed comparisons explained in this process as pytest does in its own."""
    from _pytest.assertion import truncate, util

    config = _Config(style)
    item = _Item(config)

    def explain(op: str, left: object, right: object) -> str | None:
        try:
            lines = util.assertrepr_compare(config, op, left, right)
        except Exception:  # an explanation that failed: the plain message is shown
            return None
        if not lines:
            return None
        lines = truncate.truncate_if_required(lines, item)  # type: ignore[arg-type]
        text = "\n~".join(line.replace("\n", "\\n") for line in lines)
        return text.replace("%", "%%")

    util._reprcompare = explain
