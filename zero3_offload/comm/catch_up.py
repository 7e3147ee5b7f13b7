"""``catch_up()``: after a failed call, the collectives a rank must still launch so that
every collective the call started completes on every rank.

Each rank counts the collectives it launched on a group and logs the last ones (kind,
element count, dtype, ...). The ranks share those records at a meeting; a rank that
launched fewer than the furthest one launches that rank's last ones on scratch tensors
(see [Note: failure channel] in ``comm.collectives`` and [Note: sequence group
failures] in ``sequence.sequence_group``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["OutOfReach", "catch_up"]


class OutOfReach(Exception):
    """A rank is further behind than the furthest rank's log reaches: by ``behind``
    collectives, of record ``ahead``."""

    def __init__(self, behind: int, ahead: int) -> None:
        super().__init__(f"{behind} collectives behind record {ahead}")
        self.behind, self.ahead = behind, ahead


def catch_up(records: Sequence[Mapping[str, Any]], launched: int) -> list[tuple[Any, ...]]:
    """The entries of the log of the record that launched most that a rank which
    launched ``launched`` must launch to match it (oldest first).

    Each record holds ``"launched"`` (a count) and ``"log"`` (its last launches).

    Raises:
        OutOfReach: the rank is behind by more than that record's log holds.
    """
    ahead = max(range(len(records)), key=lambda i: int(records[i]["launched"]))
    log = records[ahead]["log"]
    behind = int(records[ahead]["launched"]) - launched
    if behind > len(log):
        raise OutOfReach(behind, ahead)
    return [tuple(entry) for entry in log[len(log) - behind :]] if behind > 0 else []
