"""Structured logging: quiet in the library, configured by applications.

Library modules log through :func:`get_logger`, which forwards to structlog once
the application has configured structlog (by :func:`configure` or its own
``structlog.configure``) and drops events until then, as a stdlib library
logger with a ``NullHandler`` does. The library never configures logging.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, TextIO

import structlog

from zero3_offload.errors import ConfigError

__all__ = ["configure", "get_logger"]

# The stdlib logging levels, which structlog's filtering loggers use.
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}

# One writer at a time, across configure() calls too: worker threads log, and every JSON line
# must stay whole.
_WRITE_LOCK = threading.Lock()
# The files the last configure() opened: a later call closes them (its events go elsewhere), so
# configuring again never leaks a file descriptor.
_OPENED: list[TextIO] = []


def _drop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _QuietLogger:
    """A structlog logger that drops events while structlog is unconfigured."""

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self._name = name
        self._context = context or {}

    def bind(self, **values: Any) -> _QuietLogger:
        return _QuietLogger(self._name, {**self._context, **values})

    def __getattr__(self, level: str) -> Any:
        if not structlog.is_configured():
            return _drop
        return getattr(structlog.get_logger(self._name).bind(**self._context), level)


def get_logger(name: str) -> _QuietLogger:
    """The library's logger for module ``name``."""
    return _QuietLogger(name)


def configure(
    *, json_path: str | Path | None = None, level: str = "info", console: TextIO | None = None
) -> None:
    """Configure structlog for an application (never called by the library).

    Calling it again replaces the configuration and closes the file the
    previous call opened.

    Args:
        json_path: append events as JSON lines to this file (one per rank is usual).
        level: lowest level emitted: ``debug``, ``info``, ``warning`` or ``error``.
        console: also render events human-readably to this stream (e.g. ``sys.stderr``).
    """
    numeric = _LEVELS.get(level.lower())
    if numeric is None:
        raise ConfigError(f"level={level!r} is invalid: use debug, info, warning or error")
    sinks: list[Any] = []
    opened = []
    if json_path is not None:
        opened.append(Path(json_path).open("a", encoding="utf-8"))  # noqa: SIM115
        sinks.append(("json", opened[-1]))
    if console is not None:
        sinks.append(("console", console))
    renderer = structlog.dev.ConsoleRenderer(colors=False)

    def emit(_logger: Any, _method: str, event: dict[str, Any]) -> str:
        with _WRITE_LOCK:
            for kind, stream in sinks:
                if kind == "json":
                    if stream.closed:  # a logger bound before configure() was called again
                        continue
                    stream.write(json.dumps(event, default=str) + "\n")
                else:
                    stream.write(renderer(_logger, _method, dict(event)) + "\n")
                stream.flush()
        raise structlog.DropEvent

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt=None, key="ts"),
            emit,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=False,
    )
    with _WRITE_LOCK:  # not while an event of the previous configuration is being written
        for stream in _OPENED:
            stream.close()
        _OPENED[:] = opened
