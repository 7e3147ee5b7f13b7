"""pytest's explanation of a failed comparison (``assert a == b``), inside a rank.

The assertion rewriting that a rank's test module gets (see
``testing.code_location``) asks ``_pytest.assertion.util._reprcompare`` to
explain a failed comparison; pytest sets it for the duration of a test in its
own process only. A rank sets it to what pytest's runtest protocol does there:
call pytest's own ``pytest_assertrepr_compare`` hook implementation (the
hook's signature, the same in every pytest 8 and 9), then truncate the lines
as the installed pytest does. Both read a stand-in config that answers from
:class:`~zero3_offload.testing.rank_task.AssertionSettings`, captured in the
pytest process by :func:`assertion_settings`: the verbosities, the ini options
the explanation reads (by name, those the running pytest has), whether the
terminal reporter is there and its markup. Which truncation runs is decided by
what the installed pytest offers, not by its version number.
``pytest_assertrepr_compare`` hooks of plugins and conftests are not called in
a rank.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from zero3_offload.logging import get_logger
from zero3_offload.testing.rank_task import AssertionSettings, ReportStyle

if TYPE_CHECKING:
    import pytest

__all__ = ["assertion_settings", "explain_comparisons"]

log = get_logger(__name__)

# The ini options and plugins that pytest's explanation of a comparison (its hook
# implementation and the truncation after it) asks its config about, in pytest 8 and 9.
_INI = ("truncation_limit_lines", "truncation_limit_chars", "assertion_text_diff_style")
_PLUGINS = ("terminalreporter",)
_VERBOSITY_ASSERTIONS = "assertions"  # pytest's Config.VERBOSITY_ASSERTIONS


def assertion_settings(config: pytest.Config) -> AssertionSettings:
    """What the explanation of a failed comparison reads from ``config`` (pytest's
    ``Config``, in the pytest process)."""
    ini = []
    for name in _INI:
        try:
            ini.append((name, config.getini(name)))
        except ValueError:  # an option this pytest does not have: its explanation reads none
            continue
    plugins = frozenset(name for name in _PLUGINS if config.pluginmanager.has_plugin(name))
    markup = highlight = False
    if "terminalreporter" in plugins:
        writer = config.get_terminal_writer()
        markup, highlight = bool(writer.hasmarkup), bool(writer.code_highlight)
    return AssertionSettings(
        verbosity=config.get_verbosity(_VERBOSITY_ASSERTIONS),
        ini=tuple(ini),
        plugins=plugins,
        markup=markup,
        code_highlight=highlight,
    )


class _PluginManager:
    def __init__(self, plugins: frozenset[str]) -> None:
        self._plugins = plugins

    def has_plugin(self, name: str) -> bool:
        return name in self._plugins


class _Config:
    """The parts of pytest's ``Config`` that its explanation of a comparison and the
    truncation read, answered from the pytest process's settings."""

    def __init__(self, style: ReportStyle) -> None:
        self._style = style
        self._ini = dict(style.assertions.ini)
        self.pluginmanager = _PluginManager(style.assertions.plugins)

    def get_verbosity(self, verbosity_type: str | None = None) -> int:
        if verbosity_type == _VERBOSITY_ASSERTIONS:
            return self._style.assertions.verbosity
        return self._style.verbosity

    def get_terminal_writer(self) -> Any:
        from _pytest._io import TerminalWriter

        writer = TerminalWriter(io.StringIO())
        writer.hasmarkup = self._style.assertions.markup
        writer.code_highlight = self._style.assertions.code_highlight
        return writer

    def getini(self, name: str) -> Any:
        try:
            return self._ini[name]
        except KeyError:
            raise ValueError(f"unknown configuration value: {name!r}") from None  # as pytest


class _Item:
    def __init__(self, config: _Config) -> None:
        self.config = config


def _truncation(config: _Config) -> Callable[[Iterable[str]], list[str]]:
    """The truncation that the installed pytest's runtest protocol applies to the hook's lines."""
    from _pytest.assertion import truncate

    materialize = getattr(truncate, "materialize_with_truncation", None)
    if materialize is not None:  # lines (maybe an iterator) cut as they are pulled
        return lambda lines: materialize(lines, config)
    truncate_if_required = getattr(truncate, "truncate_if_required", None)
    if truncate_if_required is not None:  # a list cut afterwards
        item = _Item(config)
        return lambda lines: truncate_if_required(list(lines), item)
    return list


def explain_comparisons(style: ReportStyle) -> None:
    """Have failed comparisons explained in this process as pytest does in its own."""
    from _pytest.assertion import pytest_assertrepr_compare, util

    config = _Config(style)
    truncated = _truncation(config)

    def explain(op: str, left: object, right: object) -> str | None:
        try:
            lines = pytest_assertrepr_compare(config=config, op=op, left=left, right=right)
            lines = truncated(lines) if lines else None
        except Exception:
            # A pytest that asks its config for more than the stand-in knows: the assertion
            # shows its plain message (as with no explanation) rather than this error.
            log.warning("rank_comparison_not_explained", op=op, exc_info=True)
            return None
        if not lines:
            return None
        text = "\n~".join(line.replace("\n", "\\n") for line in lines)
        return text.replace("%", "%%")

    util._reprcompare = explain
    if hasattr(util, "_config"):
        # The rewritten assertion's reprs of its operands (``assert [1, 2] == [0, 2]``) are as
        # long as the assertion verbosity allows: pytest reads it from here.
        util._config = config  # type: ignore[assignment]
