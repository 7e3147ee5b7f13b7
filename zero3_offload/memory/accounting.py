"""Memory accounting: the bytes this rank holds now, counted from the tensors themselves.

:class:`~zero3_offload.memory.memory_stats.Zero3MemoryStats` is built on
request from the stores; no figure is estimated from a ratio. Where a tensor
lives (CPU or the compute device) decides which total it adds to.
"""

from __future__ import annotations

import os

import psutil
import torch

from zero3_offload.comm.collectives import Collectives
from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.gradient.reducer import GradientReducer
from zero3_offload.gradient.store import GradientStore
from zero3_offload.memory.memory_stats import Zero3MemoryStats
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.optimizer_state.speculation_backup import SpeculationBackup
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.parameter.store import ParameterStore

__all__ = ["MemoryAccounting"]


class MemoryAccounting:
    """Counts the bytes held by one manager's stores and buffers.

    Args:
        params: parameter shards.
        gatherer: gathered, in-flight and pooled parameter buffers.
        grads: gradient shards.
        optimizer: optimizer state.
        backup: pre-update copies of speculative updates.
        gradient_buffers: the flat gradient buffers reduce-scatters read from.
        comm: the collectives (receive buffers of reduce-scatters by exchange, the
            shared-memory region).
        reducer: this backward's gradient shards not yet committed.
        total_parameters: elements of the whole model.
        trainable_parameters: elements of its trainable parameters.
        owned_parameters: elements of this rank's shards.
    """

    def __init__(
        self,
        *,
        params: ParameterStore,
        gatherer: ParameterGatherer,
        grads: GradientStore,
        optimizer: ShardOptimizers,
        backup: SpeculationBackup,
        gradient_buffers: GradientBuffers,
        comm: Collectives,
        reducer: GradientReducer,
        total_parameters: int,
        trainable_parameters: int,
        owned_parameters: int,
    ) -> None:
        self._params = params
        self._gatherer = gatherer
        self._grads = grads
        self._optimizer = optimizer
        self._backup = backup
        self._gradient_buffers = gradient_buffers
        self._comm = comm
        self._reducer = reducer
        self._total = total_parameters
        self._trainable = trainable_parameters
        self._owned = owned_parameters
        self._process = psutil.Process(os.getpid())

    def _gradient_buffer_bytes(self) -> int:
        return self._gradient_buffers.nbytes() + self._comm.exchange_buffer_bytes()

    def _shared_memory_bytes(self) -> int:
        region = self._comm.shared_memory
        return 0 if region is None else region.nbytes

    def _disk_tier_buffer_bytes(self) -> int:
        tier, copies = self._optimizer.tier, self._params.disk
        return (0 if tier is None else tier.buffer_bytes) + (
            0 if copies is None else copies.buffer_bytes
        )

    def _disk_tier_file_bytes(self) -> int:
        tier, copies = self._optimizer.tier, self._params.disk
        return (0 if tier is None else tier.file.allocated_bytes()) + (
            0 if copies is None else copies.file.allocated_bytes()
        )

    def process_rss(self) -> int:
        """Resident set size of this process, in bytes."""
        return int(self._process.memory_info().rss)

    def device_allocated(self) -> int:
        """``torch.cuda.memory_allocated`` of the compute device; 0 on the CPU."""
        device = self._gatherer.device
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def stats(
        self,
        *,
        activation_bytes: int = 0,
        pressure: float = 0.0,
        pressure_checks: int = 0,
        offloaded_activation_bytes: int = 0,
        offloaded_to_host: bool = False,
    ) -> Zero3MemoryStats:
        """Count what is held now.

        Args:
            activation_bytes: what the pending forward keeps for its backward.
            offloaded_activation_bytes: its checkpointed inputs moved off the device
                (``offload_activations``), in host memory when ``offloaded_to_host``
                (counted in ``cpu_memory_used``), else in a file.
            pressure: the pressure agreed at the last check.
            pressure_checks: pressure checks run so far.
        """
        device = self._gatherer.device
        parts = [
            (device, activation_bytes),
            (self._params.master_device, self._params.master_bytes()),
            (self._params.copy_device, self._params.compute_copy_bytes()),
            (self._params.copy_device, self._params.frozen_bytes()),
            (self._grads.device, self._grads.nbytes()),
            (device, self._reducer.pending_shard_bytes()),
            (self._optimizer.device, self._optimizer.state_bytes()),
            (self._optimizer.device, self._backup.nbytes()),
            (device, self._gatherer.reserved_bytes()),
            (device, self._gatherer.pooled_bytes()),
            (device, self._gradient_buffer_bytes()),
            (device, self._shared_memory_bytes()),
            (self._optimizer.device, self._disk_tier_buffer_bytes()),
            (torch.device("cpu"), offloaded_activation_bytes if offloaded_to_host else 0),
        ]
        cpu = sum(n for dev, n in parts if dev.type == "cpu")
        return Zero3MemoryStats(
            master_param_bytes=self._params.master_bytes(),
            compute_copy_bytes=self._params.compute_copy_bytes(),
            gradient_bytes=self._grads.nbytes(),
            pending_gradient_bytes=self._reducer.pending_shard_bytes(),
            optimizer_state_bytes=self._optimizer.state_bytes(),
            speculation_backup_bytes=self._backup.nbytes(),
            gathered_param_bytes=self._gatherer.gathered_bytes(),
            inflight_param_bytes=self._gatherer.inflight_bytes(),
            gathered_high_water_bytes=self._gatherer.high_water_bytes,
            gather_pool_bytes=self._gatherer.pooled_bytes(),
            gradient_buffer_bytes=self._gradient_buffer_bytes(),
            shared_memory_bytes=self._shared_memory_bytes(),
            disk_tier_buffer_bytes=self._disk_tier_buffer_bytes(),
            disk_tier_file_bytes=self._disk_tier_file_bytes(),
            cpu_memory_used=cpu,
            gpu_memory_used=sum(n for _, n in parts) - cpu,
            process_rss_bytes=self.process_rss(),
            device_allocated_bytes=self.device_allocated(),
            last_memory_pressure=pressure,
            total_parameters=self._total,
            trainable_parameters=self._trainable,
            frozen_param_bytes=self._params.frozen_bytes(),
            owned_parameters=self._owned,
            activation_bytes=activation_bytes,
            offloaded_activation_bytes=offloaded_activation_bytes,
            pressure_checks=pressure_checks,
        )
