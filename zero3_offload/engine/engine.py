"""The engine: every component of one manager, wired from its config by :func:`build_engine`.

Components are made once, in dependency order, by short stage builders: the
model's split into layers (units), the group's collectives and the stats, the
disk tiers, the parameters (store, gatherer, prefetch), the initial values, the
gradients and the optimizer, memory, checkpoints, and the runners. Each
component receives everything it uses as keyword arguments when it is built;
nothing is assigned to a component afterwards (``tests/test_architecture.py``
checks this file). The manager then only orders their work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.checkpoint.checkpointer import ShardCheckpointer
from zero3_offload.checkpoint.full_state import FullState
from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.comm.process_group import joined_heartbeat
from zero3_offload.comm.wait import CollectiveWait
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import (
    GatherCompressionMethod,
    OffloadActivations,
    OffloadDevice,
    ReduceDtype,
    Zero3CpuOffloadConfig,
)
from zero3_offload.engine.model_layers import split_layers
from zero3_offload.engine.model_units import UnitSpec, default_unit_classes, split_units
from zero3_offload.errors import ConfigError, DiskTierError
from zero3_offload.execution.activation_offload import ActivationOffload
from zero3_offload.execution.chain_runner import ChainRunner
from zero3_offload.execution.gradient_landing import GradientLanding
from zero3_offload.execution.head_loss import HeadLoss
from zero3_offload.execution.layer_runner import LayerRunner
from zero3_offload.execution.lora_forward import LoraLinearForward
from zero3_offload.execution.module_runner import ModuleRunner
from zero3_offload.execution.product_saving import ProductSaving
from zero3_offload.execution.tiled_mlp import TiledMlp
from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.gradient.reducer import GradientReducer
from zero3_offload.gradient.store import GradientStore
from zero3_offload.integrations.peft_metadata import peft_metadata
from zero3_offload.memory.accounting import MemoryAccounting
from zero3_offload.memory.allocator import trim_heap
from zero3_offload.memory.budget import (
    CpuMemoryNeed,
    LayerStateNeed,
    check_cpu_budget,
    cpu_memory_need,
)
from zero3_offload.memory.heap_trimmer import HeapTrimmer
from zero3_offload.memory.pressure import PressurePolicy
from zero3_offload.optimizer_state.disk_tier import NvmeShardTier
from zero3_offload.optimizer_state.nonfinite_guard import NonFiniteGuard
from zero3_offload.optimizer_state.optimizer_plan import OptimizerPlan, ParamGroup, plan_optimizer
from zero3_offload.optimizer_state.owned_params import OwnedParams
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
from zero3_offload.sequence.groups import sequence_group
from zero3_offload.sequence.sequence_group import SequenceGroup
from zero3_offload.sequence.sequence_parallel import SequenceParallel
from zero3_offload.stats.pass_clock import PassClock
from zero3_offload.stats.performance import OperationStats, Zero3PerformanceStats
from zero3_offload.stats.step_counter import StepCounter
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
SHARED_MEMORY_BLOCK_BYTES = 8 * _MIB  # the shared-memory collectives' block
# Reused buffers of the disk tier: one layer updating, one being read ahead, one
# being written back (see [Note: disk tier]).
_DISK_TIER_BUFFERS = 3
_DISK_TIER_IO_THREADS = 2
# Compute copies on disk are read this many layers beyond the gather window (see
# [Note: compute copies on disk]).
_PARAM_READ_AHEAD = 2
# The gather pool holds buffers for the layer in use, the look-ahead and one being
# released: prefetch_buffer_size + this many of the largest layer.
_POOL_EXTRA_LAYERS = 2


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
    counter: StepCounter  # the run's step counts (one owner; checkpoints restore it)
    timeline: Timeline  # intervals of work, logged as they end
    clock: PassClock  # the window's start, pass and compute times, for both runners
    step_log: StepLog  # closes steps: step times and the `step` event
    comm: Collectives  # the group's awaitable collectives
    streams: CopyStreams  # side streams of host/device copies (CUDA)
    workers: WorkerThreads  # CPU work off the event loop's thread
    params: ParameterStore  # fp32 master shards and compute copies
    gatherer: ParameterGatherer  # gathers layers on the device, binds, releases
    prefetch: PrefetchScheduler  # look-ahead gathers under the budget
    reducer: GradientReducer  # reduce-scatters layers' gradients
    gradient_buffers: GradientBuffers  # flat buffers the reduce-scatters read
    grads: GradientStore  # this rank's accumulated gradient shards
    optimizer: ShardOptimizers  # one torch optimizer per layer shard
    steps: StepRunner  # applies updates in worker threads
    landing: GradientLanding  # lands a backward's reduce-scatters (both modes)
    accounting: MemoryAccounting  # counts bytes held, by kind and place
    pressure: PressurePolicy  # frees gathered memory under pressure
    checkpointer: ShardCheckpointer  # this rank's part of checkpoints
    full_state: FullState  # full parameter values gathered from the shards
    chain_runner: ChainRunner | None  # chain mode: forward_pass/backward_pass; else None
    model_runner: ModuleRunner | None  # module mode: runs the model's own code; else None
    sequence: SequenceParallel | None  # sequence parallelism (module mode), else None
    disk: _DiskTiers  # the disk tiers (each None when in memory)

    def disk_files(self) -> list[RecordFile]:
        """The disk tiers' files: the optimizer's, then the compute copies'."""
        return self.disk.files()

    def _activation_offload(self) -> ActivationOffload | None:
        runner = self.model_runner or self.chain_runner
        return runner.activations if runner is not None else None

    def activation_transfers(self) -> dict[str, OperationStats]:
        """Offloaded activations' totals (``activation_offload`` / ``activation_restore``;
        empty without ``offload_activations``)."""
        offload = self._activation_offload()
        return offload.transfers() if offload is not None else {}

    def activation_step_figures(self) -> dict[str, dict[str, Any]]:
        """``{"activations": figures}``, the field of a ``step`` event (since the previous
        step; empty without ``offload_activations``)."""
        offload = self._activation_offload()
        return {"activations": offload.step_figures()} if offload is not None else {}

    def offloaded_activations(self) -> dict[str, Any]:
        """The memory stats' arguments for the offloaded activations (empty without
        ``offload_activations``)."""
        offload = self._activation_offload()
        if offload is None:
            return {}
        return {
            "offloaded_activation_bytes": offload.offloaded_bytes(),
            "offloaded_to_host": offload.place is OffloadActivations.CPU,
        }

    def close(self) -> None:
        """Release what outlives the event loop: the model thread, the disk tiers' files,
        the group's threads."""
        if self.model_runner is not None:
            self.model_runner.close()
        if self.chain_runner is not None and self.chain_runner.activations is not None:
            self.chain_runner.activations.close()
        if self.sequence is not None:
            self.sequence.close()
        self.disk.close()
        self.comm.close()


@attrs.frozen(kw_only=True, eq=False)
class _DiskTiers:
    """The rank's directory and the files of the tiers on disk (each None when in memory)."""

    directory: RankDirectory | None = None
    tier: NvmeShardTier | None = None  # masters and optimizer state on disk
    copies: DiskComputeCopies | None = None  # compute copies on disk

    def files(self) -> list[RecordFile]:
        files = [] if self.tier is None else [self.tier.file]
        return files if self.copies is None else [*files, self.copies.file]

    def close(self) -> None:
        """Close the tiers' files and remove the rank's directory."""
        if self.tier is not None:
            self.tier.close()
        if self.copies is not None:
            self.copies.close()
        if self.directory is not None:
            self.directory.remove()


@attrs.frozen(kw_only=True, eq=False)
class _Model:
    """The model split into the layers (units) that are sharded and gathered."""

    layers: dict[str, nn.Module | UnitParams]
    layouts: dict[str, LayerLayout]
    unit_params: dict[str, UnitParams] | None  # module mode: unit -> its parameters
    unit_modules: dict[str, nn.Module]  # module mode: unit -> its submodule (not the root)
    model: nn.Module | None  # module mode: the whole model


@attrs.frozen(kw_only=True, eq=False)
class _Basics:
    """What every stage after the group's collectives builds on."""

    config: Zero3CpuOffloadConfig
    device: torch.device
    mapping: Zero3RankMapping
    stats: Zero3PerformanceStats
    counter: StepCounter
    timeline: Timeline
    comm: Collectives
    streams: CopyStreams
    workers: WorkerThreads


def build_engine(
    config: Zero3CpuOffloadConfig,
    process_group: dist.ProcessGroup,
    model: nn.Module | Mapping[str, nn.Module],
    *,
    init_fn: InitFn,
    units: Sequence[UnitSpec] | None = None,
    shard_source: ShardSource | None = None,
    param_groups: Sequence[ParamGroup] | None = None,
) -> Engine:
    """Build every component of a manager (a collective: rank 0's values are broadcast).

    Module mode (see [Note: module mode] in ``execution.module_runner``) is
    chosen when ``units`` is given or the model names default units (a
    transformers model's ``_no_split_modules``); otherwise the model's children
    (or the mapping) are a chain of layers. ``param_groups`` are torch's (see
    [Note: parameter groups] in ``optimizer_state.optimizer_plan``).

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
    mapping = Zero3RankMapping(rank=process_group.rank(), world_size=process_group.size())
    frozen_codec = ShardCodec(
        method=config.frozen_compression,
        compute_dtype=config.compute_dtype,
        block_size=config.compression_block_size,
    )
    split = _split_model(model, units, mapping, frozen_codec.align)
    plan = plan_optimizer(
        config.optimizer,
        param_groups,
        layers=split.layers,
        layouts=split.layouts,
        rank=mapping.rank,
        world_size=mapping.world_size,
        device=torch.device("cpu") if config.offload_optimizer_states else device,
        on_disk=config.offload_optimizer_device is OffloadDevice.NVME,
    )
    counter, stats = StepCounter(), Zero3PerformanceStats()
    timeline = Timeline(rank=mapping.rank, counter=counter)
    comm = _build_comm(config, process_group, device, stats)
    disk = _DiskTiers()
    sequence: SequenceParallel | None = None
    try:
        sequence = _build_sequence(config, split, comm)
        streams = CopyStreams(device=device)
        workers = WorkerThreads(threads=config.cpu_worker_threads, timeline=timeline)
        codec = ShardCodec(
            method=config.compute_copy_compression(),
            compute_dtype=config.compute_dtype,
            block_size=config.compression_block_size,
        )
        disk = _open_disk_tiers(config, comm, split.layouts, plan, codec, timeline, device)
        cpu_need, params, gatherer, prefetch = _build_parameters(
            config, comm, split, plan, (codec, frozen_codec), disk, streams, timeline, device
        )
        shard_initial_values(
            layers=split.layers,
            layouts=split.layouts,
            store=params,
            gatherer=gatherer,
            comm=comm,
            device=device,
            init_fn=init_fn,
            model=split.model,
            source=shard_source,
        )
        _after_initial_values(disk)
        basics = _Basics(
            config=config,
            device=device,
            mapping=mapping,
            stats=stats,
            counter=counter,
            timeline=timeline,
            comm=comm,
            streams=streams,
            workers=workers,
        )
        return _build_training(
            basics, split, plan, cpu_need, params, gatherer, prefetch, disk, sequence=sequence
        )
    except BaseException:
        if sequence is not None:
            sequence.close()
        disk.close()
        comm.close()  # the heartbeat and the side group of the check
        raise


def _build_comm(
    config: Zero3CpuOffloadConfig,
    process_group: dist.ProcessGroup,
    device: torch.device,
    stats: Zero3PerformanceStats,
) -> Collectives:
    """The group's collectives (a collective: probes, the heartbeat's start)."""
    return Collectives(
        group=process_group,
        device=device,
        timeout_s=config.collective_timeout_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        verify=config.divergence_check,
        shared_memory_block_bytes=SHARED_MEMORY_BLOCK_BYTES
        if config.shared_memory_collectives
        else None,
        observer=stats.add_collective,
        startup_heartbeat=joined_heartbeat(process_group),
    )


def _split_model(
    model: nn.Module | Mapping[str, nn.Module],
    units: Sequence[UnitSpec] | None,
    mapping: Zero3RankMapping,
    frozen_align: int,
) -> _Model:
    """The model's layers (chain mode) or units (module mode), and their flat layouts
    (frozen parts aligned to ``frozen_align``; see [Note: frozen parameters])."""
    module_mode = isinstance(model, nn.Module) and (
        units is not None or bool(default_unit_classes(model))
    )
    if not module_mode:
        layers: dict[str, nn.Module | UnitParams] = dict(split_layers(model))
        return _Model(
            layers=layers,
            layouts=build_layouts(layers, mapping, frozen_align=frozen_align),
            unit_params=None,
            unit_modules={},
            model=None,
        )
    assert isinstance(model, nn.Module)
    unit_params, unit_modules = split_units(model, units)
    layers = dict(unit_params)
    return _Model(
        layers=layers,
        layouts=build_layouts(layers, mapping, frozen_align=frozen_align),
        unit_params=dict(unit_params),
        unit_modules=dict(unit_modules),
        model=model,
    )


def _build_parameters(
    config: Zero3CpuOffloadConfig,
    comm: Collectives,
    split: _Model,
    plan: OptimizerPlan,
    codecs: tuple[ShardCodec, ShardCodec],
    disk: _DiskTiers,
    streams: CopyStreams,
    timeline: Timeline,
    device: torch.device,
) -> tuple[CpuMemoryNeed, ParameterStore, ParameterGatherer, PrefetchScheduler]:
    """The CPU bytes of the shards (checked against the budget first), the parameter store
    (``codecs``: the compute copies' and the frozen shards'), the gatherer and the
    prefetch scheduler."""
    codec, frozen_codec = codecs
    with_params = [name for name, lay in split.layouts.items() if lay.numel]
    cpu_need = cpu_memory_need(
        config,
        [split.layouts[name].shard_numel for name in with_params],
        device,
        disk_tier_buffers=_DISK_TIER_BUFFERS,
        disk_copy_buffers=_param_read_buffers(config),
        frozen_numels=[
            lay.frozen.shard_numel for lay in split.layouts.values() if lay.frozen is not None
        ],
        layer_state=[
            LayerStateNeed(
                full_keys=plan.layers[name].full_keys, scalar_bytes=plan.layers[name].scalar_bytes
            )
            for name in with_params
        ],
        owned_state_bytes=plan.owned_state_bytes(),
    )
    check_cpu_budget(cpu_need, config.cpu_memory_budget)
    cpu = torch.device("cpu")
    pin = _pins(config, device)
    params = ParameterStore(
        codec=codec,
        master_device=cpu if config.offload_optimizer_states else device,
        copy_device=cpu if config.offload_params else device,
        pin=pin,
        masters_on_disk=disk.tier is not None,
        disk=disk.copies,
        # Each initial master goes to the disk tier's file as soon as it is made.
        on_put=disk.tier.write_initial if disk.tier is not None else None,
        frozen_codec=frozen_codec,
    )
    gatherer = ParameterGatherer(
        layers=split.layers,
        layouts=split.layouts,
        store=params,
        comm=comm,
        device=device,
        streams=streams,
        timeline=timeline,
        compressed_wire=config.gather_compression is not GatherCompressionMethod.NONE,
        pool_layers=config.prefetch_buffer_size + _POOL_EXTRA_LAYERS,
        pool_budget=config.gpu_param_memory_budget,
        decode_at_use=config.frozen_decode_at_use and split.model is not None,
    )
    prefetch = PrefetchScheduler(
        gatherer=gatherer,
        layers=list(split.layers),
        numels={name: lay.param_numel for name, lay in split.layouts.items()},
        budget=config.gpu_param_memory_budget,
        depth=config.prefetch_buffer_size if config.async_prefetch else 0,
        bucket=config.prefetch_bucket_size,
        persistence_threshold=config.param_persistence_threshold,
        rank=comm.rank,
        resident=ROOT_UNIT if ROOT_UNIT in split.layers else None,
        keep_for_backward=config.keep_gathered_for_backward,
        keep_limit=_keep_limit(config, gatherer, device),
        read_ahead=_PARAM_READ_AHEAD if disk.copies is not None else 0,
    )
    return cpu_need, params, gatherer, prefetch


def _keep_limit(
    config: Zero3CpuOffloadConfig, gatherer: ParameterGatherer, device: torch.device
) -> int | None:
    """The most bytes kept gathered for a backward (see [Note: kept for backward]):
    ``keep_gathered_bytes`` when set; on the CPU, what a pass's window gathers at once;
    else no limit but the budget."""
    if config.keep_gathered_bytes:
        return config.keep_gathered_bytes
    return gatherer.window_limit if device.type == "cpu" else None


def _after_initial_values(disk: _DiskTiers) -> None:
    """The initial values are sharded: the disk tiers' memory back to the OS, their
    per-step figures counted from here."""
    if disk.tier is not None:
        trim_heap()  # the masters are on disk now: their memory back to the OS
    for file in disk.files():
        file.step_figures()  # the steps' disk figures count from here


def _build_training(
    basics: _Basics,
    split: _Model,
    plan: OptimizerPlan,
    cpu_need: CpuMemoryNeed,
    params: ParameterStore,
    gatherer: ParameterGatherer,
    prefetch: PrefetchScheduler,
    disk: _DiskTiers,
    *,
    sequence: SequenceParallel | None,
) -> Engine:
    """The gradients, the optimizer, memory, checkpoints and the runners: the engine."""
    config, device, comm, workers = basics.config, basics.device, basics.comm, basics.workers
    stats, counter, timeline = basics.stats, basics.counter, basics.timeline
    layouts = split.layouts
    reducer, gradient_buffers, grads = _build_gradients(
        config, comm, layouts, gatherer, basics.streams, workers, timeline, device
    )
    optimizer, backup, steps = _build_optimizer(
        config, layouts, plan, params, grads, workers, comm, disk
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
        trainable_parameters=total_numel(layouts, frozen=False),
        owned_parameters=owned_numel(layouts),
    )
    clock, landing, chain_runner, model_runner = _build_runners(
        config,
        split,
        gatherer,
        prefetch,
        reducer,
        grads,
        steps,
        comm,
        stats,
        timeline,
        device,
        rss=accounting.process_rss,
        activations=_activation_offload(config, disk, device),
        sequence=sequence,
    )
    return Engine(
        config=config,
        device=device,
        mapping=basics.mapping,
        layers=split.layers,
        layouts=layouts,
        cpu_need=cpu_need,
        stats=stats,
        counter=counter,
        timeline=timeline,
        clock=clock,
        step_log=StepLog(timeline=timeline, stats=stats, counter=counter, clock=clock),
        comm=comm,
        streams=basics.streams,
        workers=workers,
        params=params,
        gatherer=gatherer,
        prefetch=prefetch,
        reducer=reducer,
        gradient_buffers=gradient_buffers,
        grads=grads,
        optimizer=optimizer,
        steps=steps,
        landing=landing,
        accounting=accounting,
        pressure=_build_pressure(config, accounting, gatherer, prefetch, comm),
        checkpointer=ShardCheckpointer(
            config=config,
            layouts=layouts,
            params=params,
            grads=grads,
            optimizer=optimizer,
            steps=steps,
            comm=comm,
            workers=workers,
            counter=counter,
            model_config=_model_config(split.model),
            peft=peft_metadata(split.model),
        ),
        full_state=FullState(
            layouts=layouts, params=params, optimizer=optimizer, comm=comm, device=device
        ),
        chain_runner=chain_runner,
        model_runner=model_runner,
        sequence=sequence,
        disk=disk,
    )


def _build_optimizer(
    config: Zero3CpuOffloadConfig,
    layouts: dict[str, LayerLayout],
    plan: OptimizerPlan,
    params: ParameterStore,
    grads: GradientStore,
    workers: WorkerThreads,
    comm: Collectives,
    disk: _DiskTiers,
) -> tuple[ShardOptimizers, SpeculationBackup, StepRunner]:
    """The per-shard optimizers (with the owners' whole-parameter updates), the
    speculative updates' backup and the step runner."""
    owned = None
    if plan.has_owned():
        owned = OwnedParams(
            plan=plan, layouts=layouts, comm=comm, workers=workers, device=params.master_device
        )
    optimizer = ShardOptimizers(
        cfg=config.optimizer,
        masters=[(name, params.master(name)) for name, lay in layouts.items() if lay.numel],
        device=params.master_device,
        tier=disk.tier,
        plan=plan,
        owned=owned,
    )
    backup = SpeculationBackup(optimizer=optimizer)
    guard = None
    if config.skip_nonfinite_steps:
        guard = NonFiniteGuard(
            layers=list(layouts), comm=comm, limit=config.max_consecutive_nonfinite
        )
    steps = StepRunner(
        config=config,
        params=params,
        grads=grads,
        optimizer=optimizer,
        workers=workers,
        comm=comm,
        backup=backup,
        guard=guard,
    )
    return optimizer, backup, steps


def _build_pressure(
    config: Zero3CpuOffloadConfig,
    accounting: MemoryAccounting,
    gatherer: ParameterGatherer,
    prefetch: PrefetchScheduler,
    comm: Collectives,
) -> PressurePolicy:
    """The memory-pressure policy of the config's strategy."""
    return PressurePolicy(
        accounting=accounting,
        gatherer=gatherer,
        prefetch=prefetch,
        comm=comm,
        strategy=config.auto_memory_management,
        max_gpu_bytes=config.max_gpu_memory_mb * _MIB,
        max_cpu_bytes=config.max_cpu_memory_mb * _MIB,
        gpu_param_budget=config.gpu_param_memory_budget,
    )


def _build_gradients(
    config: Zero3CpuOffloadConfig,
    comm: Collectives,
    layouts: dict[str, LayerLayout],
    gatherer: ParameterGatherer,
    streams: CopyStreams,
    workers: WorkerThreads,
    timeline: Timeline,
    device: torch.device,
) -> tuple[GradientReducer, GradientBuffers, GradientStore]:
    """The reduce-scatter, its flat buffers and the gradient store."""
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
        sequence_parallel_size=config.sequence_parallel_size,
    )
    grads = GradientStore(
        device=torch.device("cpu") if config.offload_grads else device,
        streams=streams,
        workers=workers,
        timeline=timeline,
        pin=_pins(config, device),
    )
    return reducer, gradient_buffers, grads


def _build_runners(
    config: Zero3CpuOffloadConfig,
    split: _Model,
    gatherer: ParameterGatherer,
    prefetch: PrefetchScheduler,
    reducer: GradientReducer,
    grads: GradientStore,
    steps: StepRunner,
    comm: Collectives,
    stats: Zero3PerformanceStats,
    timeline: Timeline,
    device: torch.device,
    *,
    rss: Callable[[], int],
    activations: ActivationOffload | None,
    sequence: SequenceParallel | None,
) -> tuple[PassClock, GradientLanding, ChainRunner | None, ModuleRunner | None]:
    """What both runners share (the passes' clock, the landing of reduce-scatters) and the
    runner of the model's mode: a chain of layers, or the model's own code."""
    clock = PassClock(stats=stats, timeline=timeline)
    landing = GradientLanding(
        reducer=reducer, grads=grads, steps=steps, prefetch=prefetch, timeline=timeline
    )
    heap = HeapTrimmer(enabled=config.trim_heap_after_forward, rss=rss, timeline=timeline)
    units = config.selective_checkpointing_units
    products = ProductSaving(count=units) if units else None
    if split.model is None:
        _refuse_module_mode_only(config)
        layer_runner = LayerRunner(
            device=device,
            compute_dtype=config.compute_dtype,
            recompute=config.activation_checkpointing,
            gathered_flat=gatherer.gathered_flat,
            products=products,
            activations=activations,
        )
        chain = ChainRunner(
            layers=split.layers,  # type: ignore[arg-type]
            layouts=split.layouts,
            layer_runner=layer_runner,
            prefetch=prefetch,
            reducer=reducer,
            landing=landing,
            steps=steps,
            clock=clock,
            after_forward=heap.after_forward,
            activations=activations,
        )
        return clock, landing, chain, None
    assert split.unit_params is not None
    if config.mlp_chunk_tokens:  # replaces each unit's mlp forward on the instance
        TiledMlp(chunk_tokens=config.mlp_chunk_tokens, unit_modules=split.unit_modules)
    # peft's LoRA layers over frozen weights: the adapter's branch before the base product
    LoraLinearForward.install(split.model)
    module = ModuleRunner(
        model=split.model,
        units=split.unit_params,
        unit_modules=split.unit_modules,
        gatherer=gatherer,
        prefetch=prefetch,
        reducer=reducer,
        landing=landing,
        steps=steps,
        comm=comm,
        clock=clock,
        device=device,
        after_forward=heap.after_forward,
        before_last_unit=heap.before_last_unit,
        recompute=config.activation_checkpointing,
        products=products,
        activations=activations,
        sequence=sequence,
        head_loss=HeadLoss(model=split.model, chunk_tokens=config.loss_chunk_tokens),
    )
    return clock, landing, None, module


def _activation_offload(
    config: Zero3CpuOffloadConfig, disk: _DiskTiers, device: torch.device
) -> ActivationOffload | None:
    """Where checkpointed units' saved inputs go (None: they stay on the device)."""
    if config.offload_activations is OffloadActivations.NONE:
        return None
    return ActivationOffload(
        place=config.offload_activations,
        device=device,
        directory=disk.directory.path if disk.directory is not None else None,
        read_ahead_bytes=config.activation_read_ahead_bytes,
    )


def _refuse_module_mode_only(config: Zero3CpuOffloadConfig) -> None:
    """Chain mode has no tiled MLP (its layers are the user's): refuse it there."""
    if config.mlp_chunk_tokens:
        raise ConfigError(
            f"mlp_chunk_tokens={config.mlp_chunk_tokens} applies to module mode (a model run "
            "through `await manager.forward(...)`), and this model runs as a chain of layers "
            "(forward_pass/backward_pass): leave it at 0"
        )


def _build_sequence(
    config: Zero3CpuOffloadConfig, split: _Model, comm: Collectives
) -> SequenceParallel | None:
    """Sequence parallelism over groups of ``sequence_parallel_size`` ranks (a collective:
    every rank makes every group), or None at size 1. The group's collectives are waited
    for by ``comm``'s rules, its heartbeat and failure reports included."""
    size = config.sequence_parallel_size
    if size == 1:
        return None
    if split.model is None:
        raise ConfigError(
            f"sequence_parallel_size={size} needs module mode (a transformers model run by "
            "manager.forward); a chain of layers runs whole sequences"
        )
    group = sequence_group(comm.group, size, config.collective_timeout_s)
    wait = None
    if comm.heartbeat is not None:
        wait = CollectiveWait(
            rank=comm.rank,
            timeout_s=config.collective_timeout_s,
            heartbeat=comm.heartbeat,
            waiting_for=lambda label: label,
            fail=lambda error: error,  # the failed call is abandoned by the group's recovery
        )
    first = comm.rank - comm.rank % size
    members = list(range(first, first + size))
    watched = SequenceGroup(group=group, wait=wait, members=members, device=comm.device)
    try:
        return SequenceParallel(model=split.model, size=size, group=watched, rank=comm.rank % size)
    except BaseException:
        dist.destroy_process_group(group)
        raise


def _pins(config: Zero3CpuOffloadConfig, device: torch.device) -> bool:
    """Whether CPU buffers that go to the device are page-locked (a CUDA device)."""
    return config.pin_cpu_memory and device.type == "cuda"


def _param_read_buffers(config: Zero3CpuOffloadConfig) -> int:
    """Read buffers of compute copies on disk: the gather window and the read-ahead
    (0 when the copies are in memory)."""
    if config.offload_param_device is not OffloadDevice.NVME:
        return 0
    return config.prefetch_buffer_size + _PARAM_READ_AHEAD + 1


def _open_disk_tiers(
    config: Zero3CpuOffloadConfig,
    comm: Collectives,
    layouts: dict[str, LayerLayout],
    plan: OptimizerPlan,
    codec: ShardCodec,
    timeline: Timeline,
    device: torch.device,
) -> _DiskTiers:
    """The rank's directory and the files of the tiers on disk, allocated (a collective:
    every rank raises when one could not open its tiers)."""
    optimizer = config.offload_optimizer_device is OffloadDevice.NVME
    params = config.offload_param_device is OffloadDevice.NVME
    activations = config.offload_activations is OffloadActivations.NVME
    if not (optimizer or params or activations):
        return _DiskTiers()
    assert config.nvme_path is not None
    shards = {name: lay.shard_numel for name, lay in layouts.items() if lay.numel}
    directory = tier = copies = None
    error: DiskTierError | None = None
    try:
        directory = RankDirectory(
            root=config.nvme_path, rank=comm.rank, replace_stale=config.nvme_replace_stale
        )
        if optimizer:
            tier = NvmeShardTier(
                directory=directory.path,
                layers=shards,
                state_keys=plan.disk_state_keys(),
                buffers=_DISK_TIER_BUFFERS,
                io=WorkerThreads(threads=_DISK_TIER_IO_THREADS, timeline=timeline),
                give_back=trim_heap,
            )
        if params:
            copies = DiskComputeCopies(
                directory=directory.path,
                codec=codec,
                layers=shards,
                buffers=_param_read_buffers(config),
                timeline=timeline,
                # Page-locked read buffers for a CUDA device.
                pin=_pins(config, device),
            )
    except DiskTierError as exc:
        error = exc
    disk = _DiskTiers(directory=directory, tier=tier, copies=copies)
    if not comm.start_agree(error is None, what="every rank's disk tier").wait_blocking():
        disk.close()
        if error is not None:
            raise error
        raise DiskTierError("the disk tier could not be opened on another rank")
    return disk


def _model_config(model: object) -> dict[str, Any] | None:
    """A transformers model's config as a dict (None for other models)."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    return to_dict() if callable(to_dict) else None
