"""The shape of the records (``--data-format``, ``--data-field``) and how one record
becomes an :class:`~zero3_offload.data.example.Example`.

Shapes: ``text`` (a ``text`` field), ``prompt`` (``prompt`` and ``completion``) and
``messages`` (a list of ``{"role", "content"}`` dicts; in CSV a JSON string of that
list). ``auto`` picks the first of ``messages``, ``prompt`` + ``completion``, ``text``
that the first record has. ``--data-field`` renames: ``prompt=question,completion=answer``,
``messages=conversations,role=from,content=value``, ``text=body``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from zero3_offload.data.bad_record import BadRecord
from zero3_offload.data.example import Example
from zero3_offload.errors import InputError

__all__ = ["DATA_FORMATS", "RecordFormat", "parse_fields"]

DATA_FORMATS = ("auto", "text", "prompt", "messages")
"""What ``--data-format`` accepts."""
_NAMES = ("text", "prompt", "completion", "messages", "role", "content")


class _Bad(Exception):
    """One record is bad (a reason for the bad-record policy)."""


def parse_fields(text: str | None) -> dict[str, str]:
    """``--data-field``'s ``name=column,...`` as a dict over the known names, each name
    mapping to itself unless renamed.

    Raises:
        InputError: for a malformed item or an unknown name.
    """
    fields = {name: name for name in _NAMES}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, column = (part.strip() for part in item.partition("="))
        if not sep or not column or name not in fields:
            raise InputError(
                f"--data-field {text!r}: {item.strip()!r} is not NAME=COLUMN with NAME one of "
                f"{', '.join(_NAMES)}"
            )
        fields[name] = column
    return fields


def _string(record: Mapping[str, Any], column: str, *, empty_ok: bool = False) -> str:
    if column not in record or record[column] is None:
        raise _Bad(f"field {column!r} is missing")
    value = record[column]
    if not isinstance(value, str):
        raise _Bad(f"field {column!r} is a {type(value).__name__}, not a string")
    if not empty_ok and not value.strip():
        raise _Bad(f"field {column!r} is empty")
    return value


@attrs.frozen
class RecordFormat:
    """A shape and the column of each name."""

    shape: str  # "text", "prompt" or "messages"
    fields: dict[str, str]

    @classmethod
    def detect(
        cls, record: Any, where: str, *, data_format: str, data_field: str | None
    ) -> RecordFormat:
        """The format of the source whose first readable record is ``record``.

        Raises:
            InputError: when ``record`` has no recognisable shape (naming ``where`` and
                the record's fields), or ``data_format`` is unknown.
        """
        fields = parse_fields(data_field)
        if data_format not in DATA_FORMATS:
            raise InputError(f"--data-format {data_format!r}: give one of {DATA_FORMATS}")
        if data_format != "auto":
            return cls(data_format, fields)
        keys = list(record) if isinstance(record, Mapping) else []
        if fields["messages"] in keys:
            return cls("messages", fields)
        if fields["prompt"] in keys and fields["completion"] in keys:
            return cls("prompt", fields)
        if fields["text"] in keys:
            return cls("text", fields)
        found = f"its fields are {keys}" if keys else f"it is a {type(record).__name__}"
        raise InputError(
            f"{where}: no recognisable shape: {found}; expected {fields['text']!r}, "
            f"{fields['prompt']!r} and {fields['completion']!r}, or {fields['messages']!r} "
            "(name other columns with --data-field, e.g. prompt=question,completion=answer)"
        )

    def example(self, record: Any, where: str) -> Example:
        """``record`` as an example.

        Raises:
            BadRecord: for a bad record (not an object, a
                missing or empty field, a field of the wrong type, an empty
                conversation, a message without a string role or content).
        """
        try:
            return self._example(record, where)
        except _Bad as exc:
            raise BadRecord(where, str(exc)) from None

    def _example(self, record: Any, where: str) -> Example:
        if not isinstance(record, Mapping):
            raise _Bad(f"the record is a {type(record).__name__}, not an object")
        f = self.fields
        if self.shape == "text":
            return Example(where, text=_string(record, f["text"]))
        if self.shape == "prompt":
            prompt = _string(record, f["prompt"], empty_ok=True)
            return Example(where, prompt=prompt, completion=_string(record, f["completion"]))
        return Example(where, messages=self._messages(record))

    def _messages(self, record: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
        column, role, content = self.fields["messages"], self.fields["role"], self.fields["content"]
        if column not in record or record[column] is None:
            raise _Bad(f"field {column!r} is missing")
        value = record[column]
        if isinstance(value, str):  # CSV: the list as a JSON string
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise _Bad(f"field {column!r} is a string that is not a JSON list") from None
        if not isinstance(value, list):
            raise _Bad(f"field {column!r} is a {type(value).__name__}, not a list of messages")
        if not value:
            raise _Bad(f"field {column!r} is an empty conversation")
        messages = []
        for i, message in enumerate(value):
            if not isinstance(message, Mapping):
                raise _Bad(f"message {i} is a {type(message).__name__}, not an object")
            for key in (role, content):
                if not isinstance(message.get(key), str):
                    raise _Bad(f"message {i} has no string {key!r}")
            messages.append({"role": message[role], "content": message[content]})
        return tuple(messages)
