"""Typical per-layer gather and compute seconds, from the timeline (for adapting prefetch)."""

from __future__ import annotations

from collections.abc import Sequence

from zero3_offload.stats.timeline import TimelineEvent

__all__ = ["layer_seconds"]


def layer_seconds(events: Sequence[TimelineEvent]) -> tuple[float, float]:
    """Median per-layer gather and compute seconds from timeline events.

    A gather's interval runs from its launch to the moment its layer needed it,
    so for prefetched gathers it is an upper bound of the gather's own time.
    """
    gathers = sorted(e.end - e.start for e in events if e.kind == "gather")
    computes = sorted(e.end - e.start for e in events if e.kind == "compute")
    if not gathers or not computes:
        return 0.0, 0.0
    return gathers[len(gathers) // 2], computes[len(computes) // 2]
