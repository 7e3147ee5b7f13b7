"""Memory (the Rust module's ``memory_management.rs``): accounting, the CPU budget, the pressure
policy, the allocator's settings."""

from zero3_offload.memory.accounting import MemoryAccounting
from zero3_offload.memory.allocator import return_freed_memory, set_mmap_threshold, trim_heap
from zero3_offload.memory.budget import CpuMemoryNeed, check_cpu_budget, cpu_memory_need
from zero3_offload.memory.memory_stats import Zero3MemoryStats
from zero3_offload.memory.pressure import MemoryPressure, PressurePolicy

__all__ = [
    "CpuMemoryNeed",
    "MemoryAccounting",
    "MemoryPressure",
    "PressurePolicy",
    "Zero3MemoryStats",
    "check_cpu_budget",
    "cpu_memory_need",
    "return_freed_memory",
    "set_mmap_threshold",
    "trim_heap",
]
