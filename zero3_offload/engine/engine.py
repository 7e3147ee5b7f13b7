"""The engine: every component of one manager, wired from its config by :func:`build_engine`.

Components are made once, in dependency order (config -> comm, streams and
workers -> layouts and stores -> gatherer and layer runner -> prefetch ->
initial values -> gradients, optimizer, step runner -> memory -> checkpoints);
the manager then only orders their work. Each component receives exactly the
others it uses, as keyword arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.checkpoint.checkpointer import ShardCheckpointer
from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import (
    GatherCompressionMethod,
    OffloadDevice,
    ReduceDtype,
    Zero3CpuOffloadConfig,
)
from zero3_offload.engine.model_layers import split_layers
from zero3_offload.engine.model_units import UnitSpec, default_unit_classes, split_units
from zero3_offload.errors import ConfigError, DiskTierError
from zero3_offload.execution.layer_runner import LayerRunner
from zero3_offload.execution.module_runner import ModuleRunner
from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.gradient.reducer import GradientReducer
from zero3_offload.gradient.store import GradientStore
from zero3_offload.memory.accounting import MemoryAccounting
from zero3_offload.memory.allocator import trim_heap
from zero3_offload.memory.budget import (
    CpuMemoryNeed,
    check_cpu_budget,
    cpu_memory_need,
    full_size_state_keys,
)
from zero3_offload.memory.pressure import PressurePolicy
from zero3_offload.optimizer_state.disk_tier import NvmeShardTier
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.optimizer_state.speculation_backup import SpeculationBackup
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.disk_copies import DiskComputeCopies
from zero3_offload.parameter.flat_layout import (
    ROOT_UNIT,
    LayerLayout,
    build_layouts,
    owned_numel,
    total_numel,
)
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.parameter.meta_init import InitFn, ShardSource, shard_initial_values
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.parameter.unit_params import UnitParams
from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.stats.performance import Zero3PerformanceStats
from zero3_offload.stats.step_log import StepLog
from zero3_offload.stats.timeline import Timeline
from zero3_offload.storage.rank_directory import RankDirectory
from zero3_offload.storage.record_file import RecordFile

__all__ = ["Engine", "build_engine"]

_MIB = 2**20
# Gradient buffers: one receives the layer being backpropagated while the
# other is still read by the previous layer's reduce-scatter.
_GRADIENT_BUFFERS = 2
# Bytes of each rank's block in the shared-memory region of a CPU group (see
# [Note: shared-memory collectives]): a round of ~8 MiB copies per ordering all-reduce
# (4 MiB blocks took twice as long for a 12 MB gather on 2 ranks; 16 MiB, no faster).
_SHARED_MEMORY_BLOCK = 8 * _MIB
# Reused buffers of the disk tier: one layer updating, one being read ahead, one
# being written back (see [Note: disk tier]).
_DISK_TIER_BUFFERS = 3
_DISK_TIER_IO_THREADS = 2
# Compute copies on disk are read this many layers beyond the gather window (see
# [Note: compute copies on disk]).
_PARAM_READ_AHEAD = 2


@attrs.frozen(kw_only=True, eq=False)
class Engine:
    """The wired components of one manager. Built by :func:`build_engine`."""

    config: Zero3CpuOffloadConfig
    device: torch.device  # the compute device
    mapping: Zero3RankMapping  # this rank's place in the group
    layers: dict[str, nn.Module | UnitParams]  # layer (unit) name -> its parameters' holder
    layouts: dict[str, LayerLayout]  # layer name -> its flat layout
    cpu_need: CpuMemoryNeed  # CPU bytes of the shards, checked against the budget
    stats: Zero3PerformanceStats  # counts and timings of this rank
    timeline: Timeline  # intervals of work, logged as they end
    step_log: StepLog  # closes steps: step times and the `step` event
    comm: Collectives  # the group's awaitable collectives
    streams: CopyStreams  # side streams of host/device copies (CUDA)
    workers: WorkerThreads  # CPU work off the event loop's thread
    params: ParameterStore  # fp32 master shards and compute copies
    gatherer: ParameterGatherer  # gathers layers on the device, binds, releases
    runner: LayerRunner  # runs one layer's forward and backward
    prefetch: PrefetchScheduler  # look-ahead gathers under the budget
    reducer: GradientReducer  # reduce-scatters layers' gradients
    gradient_buffers: GradientBuffers  # flat buffers the reduce-scatters read
    grads: GradientStore  # this rank's accumulated gradient shards
    optimizer: ShardOptimizers  # one torch optimizer per layer shard
    steps: StepRunner  # applies updates in worker threads
    accounting: MemoryAccounting  # counts bytes held, by kind and place
    pressure: PressurePolicy  # frees gathered memory under pressure
    checkpointer: ShardCheckpointer  # this rank's part of checkpoints
    model_runner: ModuleRunner | None  # module mode: runs the model's own code; else None
    tier: NvmeShardTier | None  # masters and optimizer state on disk; else None
    directory: RankDirectory | None  # the disk tiers' directory of this rank; else None

    def disk_files(self) -> list[RecordFile]:
        """The disk tiers' files: the optimizer's, then the compute copies'."""
        files = [] if self.tier is None else [self.tier.file]
        if self.params.disk is not None:
            files.append(self.params.disk.file)
        return files

    def close(self) -> None:
        """Release what outlives the event loop: the disk tiers' files, the group's threads."""
        _close_disk(self.directory, self.tier, self.params.disk)
        self.comm.close()


def build_engine(
    config: Zero3CpuOffloadConfig,
    process_group: dist.ProcessGroup,
    model: nn.Module | Mapping[str, nn.Module],
    *,
    init_fn: InitFn,
    units: Sequence[UnitSpec] | None = None,
    shard_source: ShardSource | None = None,
) -> Engine:
    """Build every component of a manager (a collective: rank 0's values are broadcast).

    Module mode (see [Note: module mode] in ``execution.module_runner``) is
    chosen when ``units`` is given or the model names default units (a
    transformers model's ``_no_split_modules``); otherwise the model's children
    (or the mapping) are a chain of layers.

    Raises:
        ConfigError: when the config cannot run here (e.g. CUDA asked but absent).
        InputError: when the model cannot be partitioned.
        MemoryBudgetError: when the shards do not fit ``cpu_memory_budget`` or a
            layer does not fit ``gpu_param_memory_budget``.
        CommunicationError: when the initial broadcast fails.
    """
    config.validate()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={config.device!r} is invalid: CUDA is not available here")
    cpu = torch.device("cpu")
    pin = config.pin_cpu_memory and device.type == "cuda"
    mapping = Zero3RankMapping(rank=process_group.rank(), world_size=process_group.size())
    module_mode = isinstance(model, nn.Module) and (
        units is not None or bool(default_unit_classes(model))
    )
    unit_modules: dict[str, nn.Module] = {}
    layers: dict[str, nn.Module | UnitParams]
    if module_mode:
        assert isinstance(model, nn.Module)
        unit_params, unit_modules = split_units(model, units)
        layers = dict(unit_params)
    else:
        layers = dict(split_layers(model))
    layouts = build_layouts(layers, mapping)

    stats = Zero3PerformanceStats()
    timeline = Timeline(rank=mapping.rank)
    comm = Collectives(
        process_group,
        device=device,
        timeout_s=config.collective_timeout_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        verify=config.divergence_check,
        shared_memory_block_bytes=_SHARED_MEMORY_BLOCK
        if config.shared_memory_collectives
        else None,
        observer=stats.record_communication,
    )
    directory: RankDirectory | None = None
    tier: NvmeShardTier | None = None
    copies: DiskComputeCopies | None = None
    try:
        streams = CopyStreams(device)
        workers = WorkerThreads(threads=config.cpu_worker_threads, timeline=timeline)

        codec = ShardCodec(
            config.compute_copy_compression(),
            config.compute_dtype,
            block_size=config.compression_block_size,
        )
        with_params = [name for name, lay in layouts.items() if lay.numel]
        directory, tier, copies = _open_disk_tiers(
            config,
            comm,
            {name: layouts[name].shard_numel for name in with_params},
            codec,
            timeline,
            pin=pin,
        )
        params = ParameterStore(
            codec=codec,
            master_device=cpu if config.offload_optimizer_states else device,
            copy_device=cpu if config.offload_params else device,
            pin=pin,
            masters_on_disk=config.offload_optimizer_device is OffloadDevice.NVME,
            disk=copies,
        )
        gatherer = ParameterGatherer(
            layers=layers,
            layouts=layouts,
            store=params,
            comm=comm,
            device=device,
            streams=streams,
            timeline=timeline,
            compressed_wire=config.gather_compression is not GatherCompressionMethod.NONE,
        )
        runner = LayerRunner(
            device,
            config.compute_dtype,
            recompute=config.activation_checkpointing,
            gathered_flat=gatherer.gathered_flat,
        )
        cpu_need = cpu_memory_need(
            config,
            [lay.shard_numel for lay in layouts.values() if lay.numel],
            device,
            disk_tier_buffers=_DISK_TIER_BUFFERS,
            disk_copy_buffers=_param_read_buffers(config),
        )
        check_cpu_budget(cpu_need, config.cpu_memory_budget)
        # Enough reusable buffers for what is gathered at once: the layer in use,
        # the look-ahead, and one being released; never more than the budget.
        largest_bytes = max((gatherer.nbytes(n) for n in layers), default=0)
        gatherer.pool_limit = min(
            config.gpu_param_memory_budget, (config.prefetch_buffer_size + 2) * largest_bytes
        )
        prefetch = PrefetchScheduler(
            gatherer=gatherer,
            layers=list(layers),
            numels={name: lay.numel for name, lay in layouts.items()},
            budget=config.gpu_param_memory_budget,
            depth=config.prefetch_buffer_size if config.async_prefetch else 0,
            bucket=config.prefetch_bucket_size,
            persistence_threshold=config.param_persistence_threshold,
            rank=mapping.rank,
            resident=ROOT_UNIT if ROOT_UNIT in layers else None,
            keep_for_backward=config.keep_gathered_for_backward,
            # On the CPU, kept layers take the pooled buffers' place (see the note).
            keep_limit=gatherer.pool_limit if device.type == "cpu" else None,
        )
        if copies is not None:
            prefetch.read_ahead = _PARAM_READ_AHEAD
        if tier is not None:  # each initial master goes to the file as soon as it is made
            params.on_put = tier.write_initial
        shard_initial_values(
            layers=layers,
            layouts=layouts,
            store=params,
            gatherer=gatherer,
            comm=comm,
            device=device,
            init_fn=init_fn,
            model=model if module_mode else None,
            source=shard_source,
        )
        if tier is not None:
            params.on_put = None  # only the initial masters: later ones are updated in place
            trim_heap()  # the masters are on disk now: their memory back to the OS
            tier.file.step_figures()  # the steps' disk figures count from here
        if copies is not None:
            copies.file.step_figures()

        # Module mode's root unit holds a buffer of its own through the whole
        # backward (its gradients arrive at both ends), so the pool is sized for
        # the other units.
        pooled = [lay.padded_numel for name, lay in layouts.items() if name != ROOT_UNIT]
        largest = max(pooled or [lay.padded_numel for lay in layouts.values()], default=0)
        gradient_buffers = GradientBuffers(
            numel=largest,
            device=device,
            depth=_GRADIENT_BUFFERS,
            wire_dtype=None
            if config.reduce_dtype is ReduceDtype.FP32
            else config.reduce_dtype.wire_dtype(),
        )
        reducer = GradientReducer(
            layouts=layouts,
            comm=comm,
            buffers=gradient_buffers,
            timeline=timeline,
            # A reduce-scatter by exchange receives into a released gather buffer.
            lender=gatherer,
        )
        grads = GradientStore(
            device=cpu if config.offload_grads else device,
            streams=streams,
            workers=workers,
            timeline=timeline,
            pin=pin,
        )
        optimizer = ShardOptimizers(
            config.optimizer,
            [(name, params.master(name)) for name in with_params],
            device=params.master_device,
            tier=tier,
        )
        backup = SpeculationBackup(optimizer)
        steps = StepRunner(
            config=config,
            params=params,
            grads=grads,
            optimizer=optimizer,
            workers=workers,
            comm=comm,
            backup=backup,
        )
        accounting = MemoryAccounting(
            params=params,
            gatherer=gatherer,
            grads=grads,
            optimizer=optimizer,
            backup=backup,
            gradient_buffers=gradient_buffers,
            comm=comm,
            reducer=reducer,
            total_parameters=total_numel(layouts),
            owned_parameters=owned_numel(layouts),
        )
        pressure = PressurePolicy(
            accounting=accounting,
            gatherer=gatherer,
            strategy=config.auto_memory_management,
            max_gpu_bytes=config.max_gpu_memory_mb * _MIB,
            max_cpu_bytes=config.max_cpu_memory_mb * _MIB,
            gpu_param_budget=config.gpu_param_memory_budget,
        )
        checkpointer = ShardCheckpointer(
            config=config,
            layouts=layouts,
            params=params,
            grads=grads,
            optimizer=optimizer,
            steps=steps,
            comm=comm,
            workers=workers,
            stats=stats,
            timeline=timeline,
            model_config=_model_config(model) if module_mode else None,
        )
        model_runner = None
        if module_mode:
            assert isinstance(model, nn.Module)
            model_runner = ModuleRunner(
                model=model,
                units=unit_params,
                unit_modules=unit_modules,
                gatherer=gatherer,
                prefetch=prefetch,
                reducer=reducer,
                comm=comm,
                recompute=config.activation_checkpointing,
                stats=stats,
                timeline=timeline,
            )
        return Engine(
            config=config,
            device=device,
            mapping=mapping,
            layers=layers,
            layouts=layouts,
            cpu_need=cpu_need,
            stats=stats,
            timeline=timeline,
            step_log=StepLog(timeline, stats),
            comm=comm,
            streams=streams,
            workers=workers,
            params=params,
            gatherer=gatherer,
            runner=runner,
            prefetch=prefetch,
            reducer=reducer,
            gradient_buffers=gradient_buffers,
            grads=grads,
            optimizer=optimizer,
            steps=steps,
            accounting=accounting,
            pressure=pressure,
            checkpointer=checkpointer,
            model_runner=model_runner,
            tier=tier,
            directory=directory,
        )
    except BaseException:
        _close_disk(directory, tier, copies)
        comm.close()  # the heartbeat and the side group of the check
        raise


def _param_read_buffers(config: Zero3CpuOffloadConfig) -> int:
    """Read buffers of compute copies on disk: the gather window and the read-ahead
    (0 when the copies are in memory)."""
    if config.offload_param_device is not OffloadDevice.NVME:
        return 0
    return config.prefetch_buffer_size + _PARAM_READ_AHEAD + 1


def _open_disk_tiers(
    config: Zero3CpuOffloadConfig,
    comm: Collectives,
    shards: dict[str, int],
    codec: ShardCodec,
    timeline: Timeline,
    *,
    pin: bool,
) -> tuple[RankDirectory | None, NvmeShardTier | None, DiskComputeCopies | None]:
    """The rank's directory and the files of the tiers on disk, allocated (a collective:
    every rank raises when one could not open its tiers). ``shards``: elements of each
    layer's shard, for the layers with parameters; ``pin``: page-lock the compute copies'
    read buffers (a CUDA device)."""
    optimizer = config.offload_optimizer_device is OffloadDevice.NVME
    params = config.offload_param_device is OffloadDevice.NVME
    if not (optimizer or params):
        return None, None, None
    assert config.nvme_path is not None
    directory = tier = copies = None
    error: DiskTierError | None = None
    try:
        directory = RankDirectory(
            config.nvme_path, comm.rank, replace_stale=config.nvme_replace_stale
        )
        if optimizer:
            tier = NvmeShardTier(
                directory.path,
                layers=shards,
                state_keys=full_size_state_keys(config),
                buffers=_DISK_TIER_BUFFERS,
                io=WorkerThreads(threads=_DISK_TIER_IO_THREADS, timeline=timeline),
                give_back=trim_heap,
            )
        if params:
            copies = DiskComputeCopies(
                directory.path,
                codec=codec,
                layers=shards,
                buffers=_param_read_buffers(config),
                timeline=timeline,
                pin=pin,
            )
    except DiskTierError as exc:
        error = exc
    if not comm.start_agree(error is None, what="every rank's disk tier").wait_blocking():
        _close_disk(directory, tier, copies)
        if error is not None:
            raise error
        raise DiskTierError("the disk tier could not be opened on another rank")
    return directory, tier, copies


def _close_disk(
    directory: RankDirectory | None,
    tier: NvmeShardTier | None,
    copies: DiskComputeCopies | None,
) -> None:
    """Close the disk tiers' files and remove the rank's directory."""
    if tier is not None:
        tier.close()
    if copies is not None:
        copies.close()
    if directory is not None:
        directory.remove()


def _model_config(model: object) -> dict[str, Any] | None:
    """A transformers model's config as a dict (None for other models)."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    return to_dict() if callable(to_dict) else None
