"""Building the manager's components from its config: the constructor's wiring.

Each component is made here once, in dependency order (config -> comm and
streams -> stores -> cache and executor -> prefetch -> initial values ->
gradients, optimizer, updates -> memory manager); the manager then only orders
their work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.comm import Collectives
from zero3_offload.compression import ShardCodec
from zero3_offload.config import Zero3CpuOffloadConfig, Zero3RankMapping
from zero3_offload.errors import ConfigError
from zero3_offload.gradient_management import (
    CpuGradientStore,
    GpuGradientBuffer,
    GradientPartitioner,
)
from zero3_offload.layer_execution import LayerExecutor
from zero3_offload.memory_budget import check_cpu_budget, cpu_memory_need
from zero3_offload.memory_management import Zero3MemoryManager
from zero3_offload.model_sharding import InitFn, shard_initial_values, split_layers
from zero3_offload.optimizer_state import OptimizerStateManager
from zero3_offload.parameter_cache import GpuParameterCache
from zero3_offload.parameter_management import CpuParameterStore, ParameterPartitioner
from zero3_offload.prefetch import PrefetchScheduler
from zero3_offload.stats import Zero3PerformanceStats
from zero3_offload.streams import CopyStreams
from zero3_offload.timeline import Timeline
from zero3_offload.update import ShardUpdater
from zero3_offload.workers import CpuWorkers

if TYPE_CHECKING:
    from zero3_offload.manager import Zero3CpuOffloadManager

__all__ = ["WiringMixin"]


class WiringMixin:
    """The component wiring of :class:`Zero3CpuOffloadManager`'s constructor."""

    def _wire(
        self: Zero3CpuOffloadManager,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        init_fn: InitFn,
    ) -> None:
        """Build every component (see the module docstring for the order)."""
        config.validate()
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={config.device!r} is invalid: CUDA is not available here")
        self.config = config
        self.device = device
        self.process_group = process_group
        self.mapping = Zero3RankMapping(rank=process_group.rank(), world_size=process_group.size())
        self.rank = self.mapping.rank
        self.layers = split_layers(model)
        self._stats = Zero3PerformanceStats()
        self.timeline = Timeline(rank=self.rank)
        self.comm = Collectives(process_group, device=device, timeout_s=config.collective_timeout_s)
        self.comm.observer = self._stats.record_communication
        self.streams = CopyStreams(device)
        self.workers = CpuWorkers(threads=config.cpu_worker_threads, timeline=self.timeline)
        self.partitioner = ParameterPartitioner(self.layers, self.mapping)
        self.layouts = self.partitioner.layouts
        cpu = torch.device("cpu")
        pin = config.pin_cpu_memory and device.type == "cuda"
        self.params = CpuParameterStore(
            codec=ShardCodec(
                config.cpu_compression,
                config.compute_dtype,
                block_size=config.compression_block_size,
            ),
            master_device=cpu if config.offload_optimizer_states else device,
            copy_device=cpu if config.offload_params else device,
            pin=pin,
        )
        self.cache = GpuParameterCache(
            layers=self.layers,
            layouts=self.layouts,
            store=self.params,
            comm=self.comm,
            device=device,
            streams=self.streams,
            timeline=self.timeline,
        )
        self.executor = LayerExecutor(
            device,
            config.compute_dtype,
            recompute=config.activation_checkpointing,
            gathered_flat=self.cache.gathered_flat,
        )
        self.cpu_need = cpu_memory_need(
            config, [lay.shard_numel for lay in self.layouts.values() if lay.numel], device
        )
        check_cpu_budget(self.cpu_need, config.cpu_memory_budget)
        # Enough reusable buffers for what is gathered at once: the layer in use,
        # the look-ahead, and one being released; never more than the budget.
        largest_bytes = max((self.cache.nbytes(n) for n in self.layers), default=0)
        self.cache.pool_limit = min(
            config.gpu_param_memory_budget, (config.prefetch_buffer_size + 2) * largest_bytes
        )
        self.prefetch = PrefetchScheduler(
            cache=self.cache,
            layers=list(self.layers),
            numels={name: lay.numel for name, lay in self.layouts.items()},
            budget=config.gpu_param_memory_budget,
            depth=config.prefetch_buffer_size if config.async_prefetch else 0,
            bucket=config.prefetch_bucket_size,
            persistence_threshold=config.param_persistence_threshold,
            rank=self.rank,
        )
        shard_initial_values(
            layers=self.layers,
            layouts=self.layouts,
            store=self.params,
            cache=self.cache,
            comm=self.comm,
            device=device,
            init_fn=init_fn,
        )
        largest = max((lay.padded_numel for lay in self.layouts.values()), default=0)
        gradient_buffers = GpuGradientBuffer(numel=largest, device=device)
        self.grad_partitioner = GradientPartitioner(
            layouts=self.layouts,
            comm=self.comm,
            buffer=gradient_buffers,
            timeline=self.timeline,
        )
        self.grads = CpuGradientStore(
            device=cpu if config.offload_grads else device,
            streams=self.streams,
            workers=self.workers,
            timeline=self.timeline,
            pin=pin,
        )
        self.optimizer = OptimizerStateManager(
            config.optimizer,
            [(name, self.params.master(name)) for name, lay in self.layouts.items() if lay.numel],
            device=self.params.master_device,
        )
        self.updater = ShardUpdater(
            config=config,
            params=self.params,
            grads=self.grads,
            optimizer=self.optimizer,
            workers=self.workers,
            comm=self.comm,
        )
        self.memory = Zero3MemoryManager(
            params=self.params,
            cache=self.cache,
            grads=self.grads,
            optimizer=self.optimizer,
            gradient_buffers=gradient_buffers,
            total_parameters=self.partitioner.total_numel(),
            owned_parameters=self.partitioner.owned_numel(),
            strategy=config.auto_memory_management,
            max_gpu_bytes=config.max_gpu_memory_mb * 2**20,
            max_cpu_bytes=config.max_cpu_memory_mb * 2**20,
            gpu_param_budget=config.gpu_param_memory_budget,
        )
