"""One supervised example, as read from a record."""

from __future__ import annotations

import attrs

__all__ = ["Example"]


@attrs.frozen
class Example:
    """One example of one of three shapes: ``text``; ``prompt`` and ``completion``; or
    ``messages`` (dicts with string ``role`` and ``content``).

    ``where`` names its file and line or row (e.g. ``data.jsonl:12``), for messages.
    """

    where: str
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    @property
    def shape(self) -> str:
        """``"text"``, ``"prompt"`` (prompt and completion) or ``"messages"``."""
        if self.messages is not None:
            return "messages"
        return "prompt" if self.prompt is not None else "text"
