"""Memory accounting: what this rank holds, counted from the tensors themselves.

:class:`Zero3MemoryStats` is built from the stores on request; no figure is
estimated from a ratio. Where a tensor lives (CPU or the compute device)
decides which total it adds to.
"""

from __future__ import annotations

import attrs

from zero3_offload.gradient_management import CpuGradientStore
from zero3_offload.optimizer_state import OptimizerStateManager
from zero3_offload.parameter_management import CpuParameterStore, GpuParameterCache

__all__ = ["Zero3MemoryManager", "Zero3MemoryStats"]


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
    gathered_high_water_bytes: int
    """Largest ``gathered_param_bytes`` seen since construction."""
    cpu_memory_used: int
    """Sum of the above that live in CPU memory."""
    gpu_memory_used: int
    """Sum of the above that live on an accelerator."""
    total_parameters: int
    """Elements of the whole model (all ranks, no padding)."""
    owned_parameters: int
    """Elements of this rank's shards (padding included)."""

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


class Zero3MemoryManager:
    """Counts the bytes held by the stores of one manager.

    Args:
        params: parameter shards.
        cache: gathered parameters.
        grads: gradient shards.
        optimizer: optimizer state.
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
        total_parameters: int,
        owned_parameters: int,
    ) -> None:
        self._params = params
        self._cache = cache
        self._grads = grads
        self._optimizer = optimizer
        self._total = total_parameters
        self._owned = owned_parameters

    def stats(self) -> Zero3MemoryStats:
        """Count what is held now."""
        parts = [
            (self._params.master_device, self._params.master_bytes()),
            (self._params.copy_device, self._params.compute_copy_bytes()),
            (self._grads.device, self._grads.nbytes()),
            (self._optimizer.device, self._optimizer.state_bytes()),
            (self._cache.device, self._cache.gathered_bytes()),
        ]
        cpu = sum(n for dev, n in parts if dev.type == "cpu")
        return Zero3MemoryStats(
            master_param_bytes=self._params.master_bytes(),
            compute_copy_bytes=self._params.compute_copy_bytes(),
            gradient_bytes=self._grads.nbytes(),
            optimizer_state_bytes=self._optimizer.state_bytes(),
            gathered_param_bytes=self._cache.gathered_bytes(),
            gathered_high_water_bytes=self._cache.high_water_bytes,
            cpu_memory_used=cpu,
            gpu_memory_used=sum(n for _, n in parts) - cpu,
            total_parameters=self._total,
            owned_parameters=self._owned,
        )
