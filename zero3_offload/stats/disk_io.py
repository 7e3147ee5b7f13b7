"""The disk tiers' reads and writes, summed over their files, for the stats and the step event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from zero3_offload.stats.performance import OperationStats

__all__ = ["CountedFile", "disk_step_figures", "disk_transfers"]


class CountedFile(Protocol):
    """A file that counts its reads and writes as (count, seconds, bytes)
    (``storage.record_file.RecordFile``)."""

    @property
    def reads(self) -> tuple[int, float, int]: ...

    @property
    def writes(self) -> tuple[int, float, int]: ...

    def step_figures(self) -> dict[str, float]: ...


def disk_transfers(files: Sequence[CountedFile]) -> dict[str, OperationStats]:
    """``{"disk_read": ..., "disk_write": ...}`` over ``files`` since they opened (empty
    without a file)."""
    if not files:
        return {}
    out = {}
    for kind in ("read", "write"):
        counts = [file.reads if kind == "read" else file.writes for file in files]
        out[f"disk_{kind}"] = OperationStats(
            operations=sum(c[0] for c in counts),
            time=sum(c[1] for c in counts),
            bytes=sum(c[2] for c in counts),
        )
    return out


def disk_step_figures(files: Sequence[CountedFile]) -> dict[str, float]:
    """The bytes and seconds read and written over ``files`` since the last call (the
    ``disk`` field of a ``step`` event)."""
    figures: dict[str, float] = {}
    for file in files:
        for key, value in file.step_figures().items():
            figures[key] = figures.get(key, 0) + value
    return figures
