"""What this rank will hold in CPU memory, from exact tensor sizes, before allocating.

The construction-time check of ``cpu_memory_budget`` needs the bytes before
the tensors exist. Every figure here is ``numel * element_size`` of a tensor
the library will allocate with that shape and dtype (the tests compare it with
the bytes counted from the real tensors after a step), not a ratio estimate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from zero3_offload.config import OffloadDevice, Zero3CpuOffloadConfig, optimizer_class
from zero3_offload.errors import MemoryBudgetError
from zero3_offload.optimizer_state.disk_tier import record_bytes
from zero3_offload.optimizer_state.optimizer_kind import OptimizerKind, probe_kind
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.storage.record_file import aligned

__all__ = [
    "CpuMemoryNeed",
    "LayerStateNeed",
    "check_cpu_budget",
    "cpu_memory_need",
    "disk_record_bytes",
    "full_size_state_keys",
]

_FP32 = 4


@attrs.frozen(kw_only=True)
class CpuMemoryNeed:
    """CPU bytes of this rank's shards, by kind."""

    master: int
    optimizer_state: int
    compute_copies: int
    gradients: int
    disk_tier_buffers: int = 0  # the disk tiers' reused buffers (either device nvme)
    frozen: int = 0  # frozen parameters' shards (see [Note: frozen parameters])

    @property
    def total(self) -> int:
        return (
            self.frozen
            + self.master
            + self.optimizer_state
            + self.compute_copies
            + self.gradients
            + self.disk_tier_buffers
        )


def _probed(config: Zero3CpuOffloadConfig) -> OptimizerKind:
    opt = config.optimizer
    return probe_kind(
        optimizer_class(opt.kind), opt.torch_options(), device=torch.device("cpu"), fused=None
    )


def full_size_state_keys(config: Zero3CpuOffloadConfig) -> tuple[str, ...]:
    """The state tensors of parameter size torch's optimizer keeps, in the disk tier's
    record order (the scalar ``step`` is not one of them); for a dotted kind, what its
    probe keeps (see [Note: optimizer kinds])."""
    opt = config.optimizer
    if opt.kind == "sgd":
        return ("momentum_buffer",) if opt.momentum > 0 else ()
    if opt.kind in ("adam", "adamw"):
        if opt.amsgrad:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")
    return _probed(config).full_keys


def disk_record_bytes(config: Zero3CpuOffloadConfig, shard: int) -> int:
    """Bytes of one layer's record in the disk tier: its master and full-size state,
    each 4096-byte aligned."""
    return record_bytes(shard, full_size_state_keys(config))


def _scalar_state_bytes(config: Zero3CpuOffloadConfig) -> int:
    """Bytes of a shard's scalar state: Adam's and AdamW's fp32 step counter; SGD has none;
    a dotted kind's, as probed."""
    kind = config.optimizer.kind
    if kind in ("adam", "adamw", "sgd"):
        return 0 if kind == "sgd" else _FP32
    return _probed(config).scalar_bytes


@attrs.frozen
class LayerStateNeed:
    """The optimizer state one layer's shard keeps: its per-element tensors (each of the
    shard's length) and the bytes of its scalars."""

    full_keys: tuple[str, ...]
    scalar_bytes: int


def cpu_memory_need(
    config: Zero3CpuOffloadConfig,
    shard_numels: Iterable[int],
    device: torch.device,
    *,
    disk_tier_buffers: int = 0,
    disk_copy_buffers: int = 0,
    frozen_numels: Iterable[int] = (),
    layer_state: Sequence[LayerStateNeed] | None = None,
    owned_state_bytes: int = 0,
) -> CpuMemoryNeed:
    """CPU bytes of masters, optimizer state, compute copies and gradient shards; with a
    disk tier, of its reused buffers instead of what it holds.

    Args:
        config: decides what is offloaded and in which format.
        shard_numels: this rank's shard length of every layer with parameters.
        device: the compute device.
        disk_tier_buffers: how many reused buffers the optimizer's disk tier has.
        disk_copy_buffers: how many read buffers the compute copies on disk have (the
            encoding buffers of writes are counted once they exist).
        frozen_numels: this rank's frozen shard length of every layer with frozen
            parameters (stored in ``frozen_compression``'s format where compute copies are).
        layer_state: each shard's optimizer state, in the order of ``shard_numels``
            (from the parameter groups' plan); None: the config's optimizer's.
        owned_state_bytes: the state of the whole parameters this rank owns (see
            [Note: owned parameters]), on the masters' device.
    """
    shards = list(shard_numels)
    if layer_state is None:
        need = LayerStateNeed(full_size_state_keys(config), _scalar_state_bytes(config))
        layer_state = [need] * len(shards)
    cpu = torch.device("cpu")
    master_dev = cpu if config.offload_optimizer_states else device
    copy_dev = cpu if config.offload_params else device
    codec = ShardCodec(
        config.compute_copy_compression(),
        config.compute_dtype,
        block_size=config.compression_block_size,
    )
    on_disk = config.offload_optimizer_device is OffloadDevice.NVME
    copies_on_disk = config.offload_param_device is OffloadDevice.NVME
    aliased = codec.is_identity and master_dev == copy_dev and not on_disk
    master = state = copies = grads = largest_record = largest_copy = 0
    if master_dev.type == "cpu":
        state += owned_state_bytes
    for shard, layer in zip(shards, layer_state, strict=True):
        if on_disk:  # in memory: the scalar state only
            state += layer.scalar_bytes
            largest_record = max(largest_record, record_bytes(shard, layer.full_keys))
        elif master_dev.type == "cpu":
            master += _FP32 * shard
            state += _FP32 * shard * len(layer.full_keys)
            state += layer.scalar_bytes
        if copies_on_disk:
            largest_copy = max(largest_copy, aligned(codec.wire_nbytes(shard)))
        elif copy_dev.type == "cpu" and not aliased:
            copies += codec.wire_nbytes(shard)  # the payload (and int8's scales)
        if config.offload_grads or device.type == "cpu":
            grads += _FP32 * shard
    frozen_codec = ShardCodec(
        config.frozen_compression,
        config.compute_dtype,
        block_size=config.compression_block_size,
    )
    frozen = sum(frozen_codec.wire_nbytes(n) for n in frozen_numels)
    return CpuMemoryNeed(
        frozen=frozen if copy_dev.type == "cpu" else 0,
        master=master,
        optimizer_state=state,
        compute_copies=copies,
        gradients=grads,
        disk_tier_buffers=disk_tier_buffers * largest_record + disk_copy_buffers * largest_copy,
    )


def check_cpu_budget(need: CpuMemoryNeed, budget: int) -> None:
    """Raise when ``need`` does not fit ``cpu_memory_budget``.

    Raises:
        MemoryBudgetError: stating the need by kind and the budget.
    """
    if need.total > budget:
        raise MemoryBudgetError(
            f"this rank needs {need.total} bytes of CPU memory (master shards {need.master}, "
            f"frozen shards {need.frozen}, "
            f"optimizer state {need.optimizer_state}, compute copies {need.compute_copies}, "
            f"gradient shards {need.gradients}, disk tier buffers {need.disk_tier_buffers}) "
            f"but cpu_memory_budget={budget}: raise the "
            "budget, use more ranks, or compress the compute copy (cpu_compression)"
        )
