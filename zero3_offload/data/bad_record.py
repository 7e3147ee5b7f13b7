"""The error of one bad record: where it is and why it is bad."""

from __future__ import annotations

from zero3_offload.errors import InputError

__all__ = ["BadRecord"]


class BadRecord(InputError):
    """A record that cannot be an example (missing field, wrong type, empty conversation).

    Args:
        where: its file and line or row.
        reason: what is wrong with it.
    """

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason
