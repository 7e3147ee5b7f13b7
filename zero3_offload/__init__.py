"""ZeRO stage 3 with CPU offloading for PyTorch, driven from asyncio.

The public API; ``README.md`` has a quickstart and ``docs/architecture.md``
maps the subpackages.

The package follows the module structure of a Rust module, ``zero_3_cpu_offload`` of
torsh (https://github.com/cool-japan/torsh, directory
``crates/torsh-distributed/src/zero_3_cpu_offload/``), and does for real what it
simulates. Where a docstring says "the Rust module's ``stats.rs``" (or another file),
it names the file of that directory whose role the Python module has.
"""

from zero3_offload.checkpoint.consolidate import consolidate_checkpoint
from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.process_group import (
    destroy_process_group,
    init_process_group,
    init_process_group_from_env,
)
from zero3_offload.config import (
    AutoMemoryStrategy,
    CpuCompressionMethod,
    GatherCompressionMethod,
    OffloadActivations,
    OffloadDevice,
    OptimizerConfig,
    ReduceDtype,
    Zero3CpuOffloadConfig,
)
from zero3_offload.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    CommunicationError,
    ConfigError,
    DiskTierError,
    InputError,
    LayerExecutionError,
    LayerNotFoundError,
    MemoryBudgetError,
    NonFiniteError,
    RankDivergenceError,
    StateError,
    StepAbandonedError,
    Zero3Error,
)
from zero3_offload.execution.tiled_loss import tiled_causal_lm_loss
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.memory.memory_stats import Zero3MemoryStats
from zero3_offload.optimizer_state.decay_groups import decay_param_groups
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.prefetch.status import PrefetchQueueStatus
from zero3_offload.stats.performance import Zero3PerformanceStats
from zero3_offload.version import __version__

__all__ = [
    "AutoMemoryStrategy",
    "CheckpointError",
    "CollectiveTimeoutError",
    "Collectives",
    "CommunicationError",
    "ConfigError",
    "CpuCompressionMethod",
    "DiskTierError",
    "GatherCompressionMethod",
    "InputError",
    "LayerExecutionError",
    "LayerNotFoundError",
    "MemoryBudgetError",
    "NonFiniteError",
    "OffloadActivations",
    "OffloadDevice",
    "OptimizerConfig",
    "PrefetchQueueStatus",
    "RankDivergenceError",
    "ReduceDtype",
    "StateError",
    "StepAbandonedError",
    "Zero3CpuOffloadConfig",
    "Zero3CpuOffloadManager",
    "Zero3Error",
    "Zero3MemoryStats",
    "Zero3PerformanceStats",
    "Zero3RankMapping",
    "__version__",
    "consolidate_checkpoint",
    "decay_param_groups",
    "destroy_process_group",
    "init_process_group",
    "init_process_group_from_env",
    "tiled_causal_lm_loss",
]
