"""Memory accounting: the bytes this rank holds now, counted from the tensors themselves.

:class:`Zero3MemoryStats` is built on request from the stores; no figure is
estimated from a ratio. Where a tensor lives (CPU or the compute device)
decides which total it adds to.
"""

from __future__ import annotations

import os

import attrs
import psutil
import torch

from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.gradient.store import GradientStore
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.parameter.store import ParameterStore

__all__ = ["MemoryAccounting", "Zero3MemoryStats"]


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
    pressure_checks: int = 0
    """Memory-pressure checks run so far (one per optimizer update)."""

    def total_memory_used(self) -> int:
        """``cpu_memory_used + gpu_memory_used``."""
        return self.cpu_memory_used + self.gpu_memory_used

    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state held between steps."""
        return (
            self.master_param_bytes
            + self.compute_copy_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
        )


class MemoryAccounting:
    """Counts the bytes held by one manager's stores and buffers.

    Args:
        params: parameter shards.
        gatherer: gathered, in-flight and pooled parameter buffers.
        grads: gradient shards.
        optimizer: optimizer state.
        gradient_buffers: the flat gradient buffers reduce-scatters read from.
        total_parameters: elements of the whole model.
        owned_parameters: elements of this rank's shards.
    """

    def __init__(
        self,
        *,
        params: ParameterStore,
        gatherer: ParameterGatherer,
        grads: GradientStore,
        optimizer: ShardOptimizers,
        gradient_buffers: GradientBuffers,
        total_parameters: int,
        owned_parameters: int,
    ) -> None:
        self._params = params
        self._gatherer = gatherer
        self._grads = grads
        self._optimizer = optimizer
        self._gradient_buffers = gradient_buffers
        self._total = total_parameters
        self._owned = owned_parameters
        self._process = psutil.Process(os.getpid())

    def process_rss(self) -> int:
        """Resident set size of this process, in bytes."""
        return int(self._process.memory_info().rss)

    def device_allocated(self) -> int:
        """``torch.cuda.memory_allocated`` of the compute device; 0 on the CPU."""
        device = self._gatherer.device
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def stats(
        self, *, activation_bytes: int = 0, pressure: float = 0.0, pressure_checks: int = 0
    ) -> Zero3MemoryStats:
        """Count what is held now.

        Args:
            activation_bytes: what the pending forward keeps for its backward.
            pressure: the pressure agreed at the last check.
            pressure_checks: pressure checks run so far.
        """
        device = self._gatherer.device
        parts = [
            (device, activation_bytes),
            (self._params.master_device, self._params.master_bytes()),
            (self._params.copy_device, self._params.compute_copy_bytes()),
            (self._grads.device, self._grads.nbytes()),
            (self._optimizer.device, self._optimizer.state_bytes()),
            (device, self._gatherer.reserved_bytes()),
            (device, self._gatherer.pooled_bytes()),
            (device, self._gradient_buffers.nbytes()),
        ]
        cpu = sum(n for dev, n in parts if dev.type == "cpu")
        return Zero3MemoryStats(
            master_param_bytes=self._params.master_bytes(),
            compute_copy_bytes=self._params.compute_copy_bytes(),
            gradient_bytes=self._grads.nbytes(),
            optimizer_state_bytes=self._optimizer.state_bytes(),
            gathered_param_bytes=self._gatherer.gathered_bytes(),
            inflight_param_bytes=self._gatherer.inflight_bytes(),
            gathered_high_water_bytes=self._gatherer.high_water_bytes,
            gather_pool_bytes=self._gatherer.pooled_bytes(),
            gradient_buffer_bytes=self._gradient_buffers.nbytes(),
            cpu_memory_used=cpu,
            gpu_memory_used=sum(n for _, n in parts) - cpu,
            process_rss_bytes=self.process_rss(),
            device_allocated_bytes=self.device_allocated(),
            last_memory_pressure=pressure,
            total_parameters=self._total,
            owned_parameters=self._owned,
            activation_bytes=activation_bytes,
            pressure_checks=pressure_checks,
        )
