"""ZeRO stage 3 with CPU offloading for PyTorch, driven from asyncio.

See ``README.md`` for a quickstart and ``DESIGN.md`` for the architecture.
"""

from zero3_offload.comm import (
    Collectives,
    destroy_process_group,
    init_process_group,
    init_process_group_from_env,
)
from zero3_offload.config import (
    AutoMemoryStrategy,
    CpuCompressionMethod,
    OptimizerConfig,
    Zero3CpuOffloadConfig,
    Zero3RankMapping,
)
from zero3_offload.consolidate import consolidate_checkpoint
from zero3_offload.errors import (
    CheckpointError,
    CommunicationError,
    ConfigError,
    InputError,
    LayerExecutionError,
    LayerNotFoundError,
    MemoryBudgetError,
    StateError,
    Zero3Error,
)
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.memory_management import Zero3MemoryStats
from zero3_offload.model_parameters import ModelParameters
from zero3_offload.prefetch import PrefetchQueueStatus
from zero3_offload.stats import Zero3PerformanceStats

__version__ = "0.1.0"

__all__ = [
    "AutoMemoryStrategy",
    "CheckpointError",
    "Collectives",
    "CommunicationError",
    "ConfigError",
    "CpuCompressionMethod",
    "InputError",
    "LayerExecutionError",
    "LayerNotFoundError",
    "MemoryBudgetError",
    "ModelParameters",
    "OptimizerConfig",
    "PrefetchQueueStatus",
    "StateError",
    "Zero3CpuOffloadConfig",
    "Zero3CpuOffloadManager",
    "Zero3Error",
    "Zero3MemoryStats",
    "Zero3PerformanceStats",
    "Zero3RankMapping",
    "__version__",
    "consolidate_checkpoint",
    "destroy_process_group",
    "init_process_group",
    "init_process_group_from_env",
]
