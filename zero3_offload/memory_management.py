"""Memory accounting and the pressure policy.

:class:`Zero3MemoryStats` is built from the stores on request, counted from
the tensors themselves; no figure is estimated from a ratio. Where a tensor
lives (CPU or the compute device) decides which total it adds to.

[Note: memory pressure]
Pressure is measured from real counters: on CUDA, ``torch.cuda.memory_allocated``
over the device's capacity (at most ``max_gpu_memory_mb``); on the CPU device,
the gathered-parameter bytes over ``gpu_param_memory_budget``; and the
process's RSS over the system's memory (at most ``max_cpu_memory_mb``). As in
the Rust source, ``pressure = min(1, 0.8*device + 0.2*cpu + 0.1*trend)``, where
``trend`` is the recent rise of pressure (0 before 5 samples). The check runs in
every ``optimizer_step`` and takes the maximum over ranks (one all-reduce) so
that every rank makes the same decision (see [Note: deterministic prefetch]).
Above the strategy's ``pressure_threshold()``, cached and persistent layers are
released, persistence is suspended and the prefetch depth shrinks by the
strategy's ``aggressiveness()`` (to at least 1); below 0.8 of the threshold
both are restored.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

import attrs
import psutil
import torch

from zero3_offload.comm import Collectives
from zero3_offload.config import AutoMemoryStrategy
from zero3_offload.gradient_management import CpuGradientStore, GpuGradientBuffer
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state import OptimizerStateManager
from zero3_offload.parameter_cache import GpuParameterCache
from zero3_offload.parameter_management import CpuParameterStore
from zero3_offload.prefetch import PrefetchScheduler

__all__ = [
    "MemoryPressure",
    "Zero3MemoryManager",
    "Zero3MemoryStats",
    "relieve_pressure",
    "set_mmap_threshold",
]

_HISTORY = 100

log = get_logger(__name__)


@attrs.frozen(kw_only=True)
class Zero3MemoryStats:
    """Bytes this rank holds now, by kind and by place. All counted from tensors."""

    master_param_bytes: int
    """fp32 master parameter shards."""
    compute_copy_bytes: int
    """Compute copies of the shards that are tensors of their own (not aliases of the master)."""
    gradient_bytes: int
    """Accumulated fp32 gradient shards."""
    optimizer_state_bytes: int
    """Optimizer state tensors (moments, step counters)."""
    gathered_param_bytes: int
    """Full layer parameter buffers gathered on the device now."""
    inflight_param_bytes: int
    """Parameter buffers whose gather is in flight (prefetched)."""
    gathered_high_water_bytes: int
    """Largest gathered plus in-flight parameter bytes seen since construction."""
    gather_pool_bytes: int
    """Released gather buffers kept for reuse (CPU device only; within the budget)."""
    gradient_buffer_bytes: int
    """Flat fp32 buffers on the device that layers' gradients are reduce-scattered from."""
    cpu_memory_used: int
    """Bytes of the kinds above, and of kept activations, that live in CPU memory."""
    gpu_memory_used: int
    """Bytes of the kinds above, and of kept activations, that live on an accelerator."""
    process_rss_bytes: int
    """Resident set size of this process (psutil)."""
    device_allocated_bytes: int
    """``torch.cuda.memory_allocated`` on CUDA; 0 on the CPU device."""
    last_memory_pressure: float
    """Pressure agreed across ranks at the last check (see [Note: memory pressure])."""
    total_parameters: int
    """Elements of the whole model (all ranks, no padding)."""
    owned_parameters: int
    """Elements of this rank's shards (padding included)."""
    activation_bytes: int = 0
    """Layer inputs and activations the last forward keeps for its backward (distinct
    storages of the tensors autograd saved, gathered parameters excluded)."""

    def total_memory_used(self) -> int:
        return self.cpu_memory_used + self.gpu_memory_used

    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state held between steps."""
        return (
            self.master_param_bytes
            + self.compute_copy_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
        )


@attrs.frozen(kw_only=True)
class MemoryPressure:
    """One pressure sample and what it decided."""

    device: float  # fraction of the device's capacity in use
    cpu: float  # fraction of the CPU's capacity in use (RSS)
    trend: float
    pressure: float  # agreed across ranks
    relieved: bool  # cached/persistent layers were released and depth shrunk


class Zero3MemoryManager:
    """Counts the bytes held by the stores of one manager; applies the pressure policy.

    Args:
        params: parameter shards.
        cache: gathered parameters.
        grads: gradient shards.
        optimizer: optimizer state.
        gradient_buffers: the flat gradient buffers reduce-scatters read from.
        total_parameters: elements of the whole model.
        owned_parameters: elements of this rank's shards.
    """

    def __init__(
        self,
        *,
        params: CpuParameterStore,
        cache: GpuParameterCache,
        grads: CpuGradientStore,
        optimizer: OptimizerStateManager,
        gradient_buffers: GpuGradientBuffer,
        total_parameters: int,
        owned_parameters: int,
        strategy: AutoMemoryStrategy = AutoMemoryStrategy.BALANCED,
        max_gpu_bytes: int = 8192 * 2**20,
        max_cpu_bytes: int = 65536 * 2**20,
        gpu_param_budget: int = 2 * 2**30,
    ) -> None:
        self._params = params
        self._cache = cache
        self._grads = grads
        self._optimizer = optimizer
        self._gradient_buffers = gradient_buffers
        self._total = total_parameters
        self._owned = owned_parameters
        self.strategy = strategy
        self._max_gpu = max_gpu_bytes
        self._max_cpu = max_cpu_bytes
        self._param_budget = gpu_param_budget
        self._process = psutil.Process(os.getpid())
        self.history: list[float] = []
        self.last_pressure = 0.0
        self.optimization_cycles = 0
        self.relief_count = 0

    def stats(self, activation_bytes: int = 0) -> Zero3MemoryStats:
        """Count what is held now (``activation_bytes``: what the pending forward keeps)."""
        parts = [
            (self._cache.device, activation_bytes),
            (self._params.master_device, self._params.master_bytes()),
            (self._params.copy_device, self._params.compute_copy_bytes()),
            (self._grads.device, self._grads.nbytes()),
            (self._optimizer.device, self._optimizer.state_bytes()),
            (self._cache.device, self._cache.reserved_bytes()),
            (self._cache.device, self._cache.pooled_bytes()),
            (self._cache.device, self._gradient_buffers.nbytes()),
        ]
        cpu = sum(n for dev, n in parts if dev.type == "cpu")
        return Zero3MemoryStats(
            master_param_bytes=self._params.master_bytes(),
            compute_copy_bytes=self._params.compute_copy_bytes(),
            gradient_bytes=self._grads.nbytes(),
            optimizer_state_bytes=self._optimizer.state_bytes(),
            gathered_param_bytes=self._cache.gathered_bytes(),
            inflight_param_bytes=self._cache.inflight_bytes(),
            gathered_high_water_bytes=self._cache.high_water_bytes,
            gather_pool_bytes=self._cache.pooled_bytes(),
            gradient_buffer_bytes=self._gradient_buffers.nbytes(),
            cpu_memory_used=cpu,
            gpu_memory_used=sum(n for _, n in parts) - cpu,
            process_rss_bytes=self._process.memory_info().rss,
            device_allocated_bytes=self._device_allocated(),
            last_memory_pressure=self.last_pressure,
            total_parameters=self._total,
            owned_parameters=self._owned,
            activation_bytes=activation_bytes,
        )

    def _device_allocated(self) -> int:
        device = self._cache.device
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def local_fractions(self) -> tuple[float, float]:
        """(device, cpu) fractions of capacity in use on this rank, from real counters."""
        device = self._cache.device
        if device.type == "cuda":
            capacity = min(torch.cuda.get_device_properties(device).total_memory, self._max_gpu)
            dev = self._device_allocated() / capacity
        else:
            dev = self._cache.reserved_bytes() / self._param_budget
        capacity = min(psutil.virtual_memory().total, self._max_cpu)
        return dev, self._process.memory_info().rss / capacity

    def _trend(self) -> float:
        if len(self.history) < 5:
            return 0.0
        return min(1.0, max(0.0, (self.history[-1] - self.history[-5]) / 4 * 5))

    async def sample_pressure(self, comm: Collectives) -> tuple[float, float, float, float]:
        """Measure pressure here, agree on the maximum over ranks (a collective).

        Returns:
            (device fraction, cpu fraction, trend, agreed pressure).
        """
        dev, cpu = self.local_fractions()
        trend = self._trend()
        local = min(1.0, 0.8 * dev + 0.2 * cpu + 0.1 * trend)
        agreed = torch.tensor([local], dtype=torch.float32, device=comm.device)
        await comm.all_reduce_max(agreed)
        pressure = float(agreed.item())
        self.history = [*self.history[-(_HISTORY - 1) :], pressure]
        self.last_pressure = pressure
        self.optimization_cycles += 1
        return dev, cpu, trend, pressure

    def over_threshold(self, pressure: float) -> bool:
        return pressure > self.strategy.pressure_threshold()

    def under_restore_level(self, pressure: float) -> bool:
        return pressure < 0.8 * self.strategy.pressure_threshold()

    def shrunk_depth(self, depth: int) -> int:
        """Prefetch depth under pressure: shrunk by the strategy's aggressiveness, >= 1."""
        if depth == 0:
            return 0
        return max(1, int(depth * (1.0 - self.strategy.aggressiveness())))

    def collect_garbage(self) -> None:
        """Return freed memory: the gather pool, Python's collector, the CUDA caching
        allocator's cache, and (glibc) the C heap's free pages (``malloc_trim``)."""
        self._cache.clear_pool()
        gc.collect()
        if self._cache.device.type == "cuda":
            torch.cuda.empty_cache()
        _malloc_trim()


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def set_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Make glibc serve allocations of ``nbytes`` or more with mmap (returned on free).

    For applications, never called by the library: glibc raises its mmap
    threshold after large frees and then keeps freed blocks in its heap, so the
    process RSS stays at its high-water mark although the tensors are gone.
    Same as starting the process with ``MALLOC_MMAP_THRESHOLD_=nbytes``.

    Returns:
        Whether the setting took effect (False off glibc).
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(-3, nbytes))  # M_MMAP_THRESHOLD


def _malloc_trim() -> None:
    # glibc keeps freed large blocks in its heap; malloc_trim returns them to
    # the OS. Other C libraries have no such call: nothing to do there.
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


async def relieve_pressure(
    memory: Zero3MemoryManager, prefetch: PrefetchScheduler, comm: Collectives
) -> MemoryPressure:
    """Sample pressure (agreed over ranks) and apply the strategy. See [Note: memory pressure]."""
    dev, cpu, trend, pressure = await memory.sample_pressure(comm)
    relieved = False
    if memory.over_threshold(pressure):
        await prefetch.release_all(keep_persistent=False)
        memory.collect_garbage()
        prefetch.persistence_enabled = False
        prefetch.set_depth(memory.shrunk_depth(prefetch.max_depth))
        memory.relief_count += 1
        relieved = True
        log.info(
            "memory_pressure_relieved",
            rank=comm.rank,
            pressure=pressure,
            threshold=memory.strategy.pressure_threshold(),
            depth=prefetch.depth,
        )
    elif memory.under_restore_level(pressure) and not prefetch.persistence_enabled:
        prefetch.persistence_enabled = True
        prefetch.set_depth(prefetch.max_depth)
        log.info("memory_pressure_restored", rank=comm.rank, pressure=pressure)
    return MemoryPressure(device=dev, cpu=cpu, trend=trend, pressure=pressure, relieved=relieved)
