"""What the prefetcher reports: its counters and the state of its queue."""

from __future__ import annotations

import attrs

__all__ = ["PrefetchMetrics", "PrefetchQueueStatus"]


@attrs.define
class PrefetchMetrics:
    """Counts of layer uses and prefetches on this rank."""

    requests: int = 0  # gathers launched ahead of their use
    hits: int = 0  # uses whose parameters were already gathered when needed
    partial_hits: int = 0  # uses whose prefetched gather was still in flight
    misses: int = 0  # uses whose gather had not been started
    wasted: int = 0  # prefetched gathers released unused (the order changed)
    cancelled: int = 0  # prefetched gathers discarded by reset, close, an error or eviction
    trace_rebuilds: int = 0  # passes whose layer order differed from the trace
    gathered_bytes: int = 0  # bytes of full layers gathered (buffers launched)

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return attrs.asdict(self)

    def uses(self) -> int:
        """Layer uses counted (hits, partial hits and misses)."""
        return self.hits + self.partial_hits + self.misses

    def hit_rate(self) -> float:
        """Fraction of uses whose gather was started before it was needed."""
        return (self.hits + self.partial_hits) / self.uses() if self.uses() else 0.0


@attrs.frozen(kw_only=True)
class PrefetchQueueStatus:
    """What the prefetcher holds now (the Rust module's ``PrefetchQueueStatus``, with one word
    for the look-ahead, *depth*, and bytes)."""

    queued_requests: int  # look-ahead layers waiting for budget at the last boundary
    active_operations: int  # gathers in flight
    depth: int  # layers gathered ahead now (lowered by memory pressure, set by adapt)
    max_depth: int  # the configured depth (prefetch_buffer_size; 0 without async_prefetch)
    inflight_bytes: int
    gathered_bytes: int
    budget_bytes: int
    persistent_layers: tuple[str, ...] = ()  # layers that stay gathered between uses
    persistence_enabled: bool = True  # False while memory pressure suspends persistence
    kept_layers: tuple[str, ...] = ()  # kept gathered from a training forward to its backward
