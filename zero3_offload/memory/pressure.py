"""The memory-pressure policy (the Rust module's ``memory_management.rs``), on real counters.

[Note: memory pressure]
Pressure is measured from real counters: on CUDA, ``torch.cuda.memory_allocated``
over the device's capacity (at most ``max_gpu_memory_mb``); on the CPU device,
the gathered-parameter bytes over ``gpu_param_memory_budget``; and the
process's RSS over the system's memory (at most ``max_cpu_memory_mb``). They are
combined with the Rust module's weights, ``pressure = min(1, 0.8*device + 0.2*cpu +
0.1*trend)``: device memory is what runs out first, and ``trend`` (the rise per
sample over the last four samples, projected five samples ahead; 0 before five
samples) acts before a rising pressure crosses the threshold. The check runs in
every updating ``optimizer_step`` and takes the maximum over ranks (one
all-reduce) so that every rank makes the same decision (see
[Note: deterministic prefetch]). Above the strategy's ``pressure_threshold()``,
cached and persistent layers are released, persistence and keeping layers
gathered for the backward are suspended and the prefetch depth shrinks by the
strategy's ``aggressiveness()`` (to at least 1); below 0.8 of the threshold
they are restored (the gap keeps the policy from flapping around the
threshold). The policy advises the scheduler through its methods
(``PrefetchScheduler.suspend`` / ``resume``); it writes no field of another object.
"""

from __future__ import annotations

import attrs
import psutil
import torch

from zero3_offload.comm.collectives import Collectives
from zero3_offload.config import AutoMemoryStrategy
from zero3_offload.logging import get_logger
from zero3_offload.memory.accounting import MemoryAccounting
from zero3_offload.memory.allocator import return_freed_memory
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.prefetch.scheduler import PrefetchScheduler

__all__ = ["MemoryPressure", "PressurePolicy"]

log = get_logger(__name__)

# Pressure samples kept for the trend (only the last five are read; the rest
# are a short history for inspection).
_HISTORY = 100
_TREND_SAMPLES = 5
# Below this fraction of the threshold, relief is undone.
_RESTORE_FRACTION = 0.8


@attrs.frozen(kw_only=True)
class MemoryPressure:
    """One pressure sample and what it decided."""

    device: float  # fraction of the device's capacity in use
    cpu: float  # fraction of the CPU's capacity in use (RSS)
    trend: float
    pressure: float  # agreed across ranks
    relieved: bool  # cached/persistent layers were released and depth shrunk


class PressurePolicy:
    """Samples memory pressure, agrees on it across ranks, and applies the strategy.

    See [Note: memory pressure].

    Args:
        accounting: this rank's byte counters (RSS, device allocation).
        gatherer: gathered parameters (their bytes on a CPU device; the pool).
        prefetch: whose gathered layers, persistence and depth the policy changes.
        comm: the group's collectives (the pressure is agreed over ranks).
        strategy: thresholds and aggressiveness.
        max_gpu_bytes: ``max_gpu_memory_mb`` in bytes.
        max_cpu_bytes: ``max_cpu_memory_mb`` in bytes.
        gpu_param_budget: ``gpu_param_memory_budget``.
    """

    def __init__(
        self,
        *,
        accounting: MemoryAccounting,
        gatherer: ParameterGatherer,
        prefetch: PrefetchScheduler,
        comm: Collectives,
        strategy: AutoMemoryStrategy,
        max_gpu_bytes: int,
        max_cpu_bytes: int,
        gpu_param_budget: int,
    ) -> None:
        self._accounting = accounting
        self._gatherer = gatherer
        self._prefetch = prefetch
        self._comm = comm
        self.strategy = strategy
        self._max_gpu = max_gpu_bytes
        self._max_cpu = max_cpu_bytes
        self._param_budget = gpu_param_budget
        self.history: list[float] = []  # agreed pressures, oldest first
        self.last_pressure = 0.0
        self.checks = 0  # pressure checks run

    def local_fractions(self) -> tuple[float, float]:
        """(device, cpu) fractions of capacity in use on this rank, from real counters."""
        device = self._gatherer.device
        if device.type == "cuda":
            capacity = min(torch.cuda.get_device_properties(device).total_memory, self._max_gpu)
            dev = self._accounting.device_allocated() / capacity
        else:
            dev = self._gatherer.reserved_bytes() / self._param_budget
        capacity = min(psutil.virtual_memory().total, self._max_cpu)
        return dev, self._accounting.process_rss() / capacity

    def _trend(self) -> float:
        if len(self.history) < _TREND_SAMPLES:
            return 0.0
        span = _TREND_SAMPLES - 1
        per_sample = (self.history[-1] - self.history[-_TREND_SAMPLES]) / span
        return min(1.0, max(0.0, per_sample * _TREND_SAMPLES))

    async def _sample(self) -> tuple[float, float, float, float]:
        comm = self._comm
        dev, cpu = self.local_fractions()
        trend = self._trend()
        local = min(1.0, 0.8 * dev + 0.2 * cpu + 0.1 * trend)
        agreed = torch.tensor([local], dtype=torch.float32, device=comm.device)
        await comm.all_reduce_max(agreed, what="the memory pressure")
        pressure = float(agreed.item())
        self.history = [*self.history[-(_HISTORY - 1) :], pressure]
        self.last_pressure = pressure
        self.checks += 1
        return dev, cpu, trend, pressure

    def shrunk_depth(self, depth: int) -> int:
        """Prefetch depth under pressure: shrunk by the strategy's aggressiveness, >= 1."""
        if depth == 0:
            return 0
        return max(1, int(depth * (1.0 - self.strategy.aggressiveness())))

    async def free_gathered(self) -> None:
        """Release every gathered layer (persistent ones too) and the gather pool, then
        return freed memory to the allocator and the OS. Call it between passes."""
        await self._prefetch.release_all(keep_persistent=False)
        self._gatherer.clear_pool()
        return_freed_memory(self._gatherer.device)

    async def check(self) -> MemoryPressure:
        """Sample pressure (agreed over ranks, a collective) and apply the strategy."""
        dev, cpu, trend, pressure = await self._sample()
        threshold = self.strategy.pressure_threshold()
        prefetch, rank = self._prefetch, self._comm.rank
        relieved = False
        if pressure > threshold:
            await self.free_gathered()
            prefetch.suspend(self.shrunk_depth(prefetch.max_depth))
            relieved = True
            log.info(
                "memory_pressure_relieved",
                rank=rank,
                pressure=pressure,
                threshold=threshold,
                depth=prefetch.depth,
            )
        elif pressure < _RESTORE_FRACTION * threshold and not prefetch.persistence_enabled:
            prefetch.resume()
            log.info("memory_pressure_restored", rank=rank, pressure=pressure)
        return MemoryPressure(
            device=dev, cpu=cpu, trend=trend, pressure=pressure, relieved=relieved
        )
