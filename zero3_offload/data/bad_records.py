"""The bad-record policy (``--bad-records fail|skip``): raise, or count and go on."""

from __future__ import annotations

from zero3_offload.errors import InputError

__all__ = ["BAD_RECORD_POLICIES", "BadRecords"]

BAD_RECORD_POLICIES = ("fail", "skip")
"""``fail``: the first bad record ends the run; ``skip``: it is left out and counted."""


class BadRecords:
    """Decides about bad records and counts the skipped ones.

    Args:
        policy: ``"fail"`` or ``"skip"``.
    """

    def __init__(self, policy: str) -> None:
        if policy not in BAD_RECORD_POLICIES:
            raise InputError(f"bad-records policy {policy!r}: give fail or skip")
        self.policy = policy
        self.skipped = 0
        self.first: str | None = None  # the first skipped record's message

    def bad(self, where: str, reason: str) -> None:
        """Record that the record at ``where`` is bad because of ``reason``.

        Raises:
            InputError: ``"{where}: {reason}"``, under the ``fail`` policy.
        """
        message = f"{where}: {reason}"
        if self.policy == "fail":
            raise InputError(f"{message} (give --bad-records skip to leave such records out)")
        self.skipped += 1
        self.first = self.first or message
