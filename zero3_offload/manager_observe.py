"""The manager's observability methods: stats, prefetch status, memory tools, step events."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from zero3_offload.logging import get_logger
from zero3_offload.memory_management import Zero3MemoryStats
from zero3_offload.prefetch import PrefetchQueueStatus, layer_seconds
from zero3_offload.stats import TransferStats, Zero3PerformanceStats
from zero3_offload.timeline import wall_time

if TYPE_CHECKING:
    from zero3_offload.manager import Zero3CpuOffloadManager

__all__ = ["ObservabilityMixin"]

log = get_logger(__name__)


class ObservabilityMixin:
    """Stats, status and memory tools of :class:`Zero3CpuOffloadManager`."""

    def _end_step(
        self: Zero3CpuOffloadManager, ended: float, *, stepped: bool, pressure: float
    ) -> None:
        window = self._window_started if self._window_started is not None else ended
        self._window_started = None
        self._stats.record_step(ended - window)
        memory = self.memory.stats()
        log.info(
            "step",
            rank=self.rank,
            step=self.timeline.step,
            stepped=stepped,
            start=wall_time(window),
            end=wall_time(ended),
            seconds=ended - window,
            compute_seconds=self.timeline.seconds("compute"),
            wait_seconds=self.timeline.seconds("wait"),
            prefetch_hit_rate=self.prefetch.metrics.hit_rate(),
            gathered_high_water_bytes=memory.gathered_high_water_bytes,
            cpu_memory_used=memory.cpu_memory_used,
            gpu_memory_used=memory.gpu_memory_used,
            process_rss_bytes=memory.process_rss_bytes,
            device_allocated_bytes=memory.device_allocated_bytes,
            memory_pressure=pressure,
            loss_scale=self.loss_scale,
        )
        self.timeline.step += 1

    def get_performance_stats(self: Zero3CpuOffloadManager) -> Zero3PerformanceStats:
        """A snapshot of this rank's timings, counts, prefetch metrics and recent timeline."""
        snapshot = self._stats.copy()
        snapshot.timeline = self.timeline.events()
        snapshot.prefetch = attrs.asdict(self.prefetch.metrics)
        snapshot.prefetch_hit_rate = self.prefetch.metrics.hit_rate()
        snapshot.gathered_high_water_bytes = self.cache.high_water_bytes
        totals = self.timeline.totals()
        snapshot.total_compute_time = totals.get("compute", (0, 0.0, 0))[1]
        snapshot.exposed_communication_time = totals.get("wait", (0, 0.0, 0))[1]
        snapshot.transfers = {
            kind: TransferStats(transfers=count, time=seconds, bytes=nbytes)
            for kind, (count, seconds, nbytes) in totals.items()
            if kind in ("h2d", "d2h")
        }
        return snapshot

    def get_prefetch_status(self: Zero3CpuOffloadManager) -> PrefetchQueueStatus:
        """What the prefetcher holds now: gathers in flight, queued look-ahead, bytes."""
        return self.prefetch.status()

    async def force_memory_optimization(self: Zero3CpuOffloadManager) -> int:
        """Free every gathered layer not in use now (persistent ones too) and collect garbage.

        Call it between passes, not concurrently with one.

        Returns:
            Bytes of gathered parameters released.
        """
        self._check_open()
        before = self.cache.reserved_bytes()
        await self.prefetch.release_all(keep_persistent=False)
        self.memory.collect_garbage()
        freed = before - self.cache.reserved_bytes()
        log.info("memory_optimized", rank=self.rank, freed_bytes=freed)
        return freed

    async def adapt_performance(self: Zero3CpuOffloadManager) -> int:
        """Adapt the prefetch depth to measured gather and compute times (a collective).

        See :meth:`PrefetchScheduler.adapt_prefetch_strategy` for the rule; the times are the
        maxima over ranks, so every rank picks the same depth.

        Returns:
            The new prefetch depth.
        """
        self._check_open()
        gather_s, compute_s = layer_seconds(self.timeline.events())
        agreed = torch.tensor([gather_s, compute_s], dtype=torch.float64, device=self.device)
        await self.comm.all_reduce_max(agreed)
        depth = self.prefetch.adapt_prefetch_strategy(float(agreed[0]), float(agreed[1]))
        log.info(
            "prefetch_adapted",
            rank=self.rank,
            gather_s=float(agreed[0]),
            compute_s=float(agreed[1]),
            depth=depth,
        )
        return depth

    def get_memory_stats(self: Zero3CpuOffloadManager) -> Zero3MemoryStats:
        """Bytes this rank holds now, counted from the tensors."""
        record = self._record
        return self.memory.stats(record.activation_bytes() if record is not None else 0)
