"""``Zero3MemoryStats``: the bytes one rank holds, by kind and by place."""

from __future__ import annotations

import attrs

__all__ = ["Zero3MemoryStats"]


@attrs.frozen(kw_only=True)
class Zero3MemoryStats:
    """Bytes this rank holds now, by kind and by place. All counted from tensors."""

    master_param_bytes: int
    """fp32 master parameter shards."""
    compute_copy_bytes: int
    """Compute copies of the shards that are tensors of their own (not aliases of the master)."""
    gradient_bytes: int
    """Accumulated fp32 gradient shards."""
    pending_gradient_bytes: int
    """The running backward's reduced gradient shards (in flight or landed) that are not
    committed yet: they join ``gradient_bytes`` when the backward succeeds."""
    optimizer_state_bytes: int
    """Optimizer state tensors (moments, step counters)."""
    speculation_backup_bytes: int
    """Pre-update copies of master shards and optimizer state that speculative updates keep
    (``speculative_step`` with clipping or fp16; reused buffers, held between steps)."""
    gathered_param_bytes: int
    """Full layer parameter buffers gathered on the device now."""
    inflight_param_bytes: int
    """Parameter buffers whose gather is in flight (prefetched)."""
    gathered_high_water_bytes: int
    """Largest gathered plus in-flight parameter bytes seen since construction."""
    gather_pool_bytes: int
    """Released gather buffers pooled for reuse (CPU device only; within the budget)."""
    gradient_buffer_bytes: int
    """Flat buffers on the device that layers' gradients are reduce-scattered from (and, on
    the CPU, the buffers the exchange receives into)."""
    shared_memory_bytes: int
    """The region CPU collectives move their data through when the ranks share a host
    (see ``shared_memory_collectives``): mapped by every rank of the group, held once by
    the host; 0 without one."""
    disk_tier_buffer_bytes: int
    """The disk tiers' reused buffers: where a layer's master and optimizer state are
    read, updated and written back (``offload_optimizer_device="nvme"``), and where
    compute copies are read before their gathers and encoded before their writes
    (``offload_param_device="nvme"``); 0 without either."""
    disk_tier_file_bytes: int
    """Bytes the disk tiers' files occupy on disk (their allocated blocks): the masters and
    full-size optimizer state, and the compute copies, of this rank; not memory. 0
    without either tier."""
    cpu_memory_used: int
    """Bytes of the kinds above, and of saved activations, that live in CPU memory."""
    gpu_memory_used: int
    """Bytes of the kinds above, and of saved activations, that live on an accelerator."""
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
    frozen_param_bytes: int = 0
    """Frozen parameters' shards (``requires_grad=False``: their only copy, in
    ``frozen_compression``'s format; no master, gradient or optimizer state)."""
    trainable_parameters: int = 0
    """Elements of the model's trainable parameters (all ranks, no padding)."""
    activation_bytes: int = 0
    """Layer inputs and activations the last training forward saved for its backward (distinct
    storages of the tensors autograd saved, gathered parameters excluded)."""
    offloaded_activation_bytes: int = 0
    """The last training forward's checkpointed inputs held off the device until its
    backward brings them back (``offload_activations``): in host memory with ``"cpu"``
    (counted in ``cpu_memory_used``), in the disk tier's file with ``"nvme"`` (not
    memory); 0 without it."""
    pressure_checks: int = 0
    """Memory-pressure checks run so far (one per optimizer update)."""

    def total_memory_used(self) -> int:
        """``cpu_memory_used + gpu_memory_used``."""
        return self.cpu_memory_used + self.gpu_memory_used

    def step_figures(self) -> dict[str, int]:
        """The figures a ``step`` event carries (counted at the end of the step)."""
        return {
            "gathered_high_water_bytes": self.gathered_high_water_bytes,
            "cpu_memory_used": self.cpu_memory_used,
            "gpu_memory_used": self.gpu_memory_used,
            "process_rss_bytes": self.process_rss_bytes,
            "device_allocated_bytes": self.device_allocated_bytes,
        }

    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state held between steps."""
        return (
            self.master_param_bytes
            + self.frozen_param_bytes
            + self.compute_copy_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
        )
