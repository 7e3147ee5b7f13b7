"""Configuration of ZeRO-3 with CPU offloading, validated at construction.

Mirrors ``config.rs`` of the Rust ``zero_3_cpu_offload`` module:
:class:`Zero3CpuOffloadConfig` with its enums :class:`CpuCompressionMethod` and
:class:`AutoMemoryStrategy`, and the optimizer section :class:`OptimizerConfig`.
:class:`Zero3RankMapping`, which says which slice of each flat, padded layer
buffer a rank owns, lives in :mod:`zero3_offload.rank_mapping` and is re-exported
here; the shared field validators live in :mod:`zero3_offload._validation`.
Every invalid value raises :class:`ConfigError` whose message names the field,
the value given and what is allowed, so an impossible configuration can never
be constructed.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import attrs
import torch

from zero3_offload._validation import (
    _DTYPE_NAMES,
    _as_device,
    _as_dtype,
    _as_float,
    _bool_field,
    _check_bool,
    _check_device,
    _check_dtype,
    _check_keys,
    _fail,
    _float_field,
    _int_field,
    _non_negative,
    _rule,
)
from zero3_offload.errors import ConfigError
from zero3_offload.rank_mapping import Zero3RankMapping

__all__ = [
    "AutoMemoryStrategy",
    "CpuCompressionMethod",
    "OptimizerConfig",
    "Zero3CpuOffloadConfig",
    "Zero3RankMapping",
]

_E = TypeVar("_E", bound=enum.Enum)


class _ChoiceEnum(enum.Enum):
    """Enum with a lenient, field-aware ``parse`` (members carry lower-case string values)."""

    @classmethod
    def parse(cls: type[_E], value: object, *, field: str | None = None) -> _E:
        """Return the member named by ``value``: a member, or its value or name in any case.

        Args:
            value: what the user gave.
            field: config field name used in the error message (default: the enum's name).

        Raises:
            ConfigError: ``value`` names no member; the message lists the choices.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(
            f"{field or cls.__name__}={value!r} is invalid: must be one of {choices} "
            f"(case-insensitive) or a {cls.__name__} member"
        )


class CpuCompressionMethod(_ChoiceEnum):
    """Format of the compute copy of each CPU parameter shard (``INT8``: absmax scale per block)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    def is_lossy(self) -> bool:
        """Return True when decompression does not give back the fp32 master values."""
        return self is not CpuCompressionMethod.NONE

    def description(self) -> str:
        """Return a one-line human-readable description."""
        return _COMPRESSION_DESCRIPTIONS[self]

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """Return the dtype the compressed shard is stored in.

        Args:
            compute_dtype: dtype the layer computes in (used by ``NONE``).

        Returns:
            The storage dtype; byte counts follow from it and the shard's numel.
        """
        if self is CpuCompressionMethod.NONE:
            return compute_dtype
        return _COMPRESSION_DTYPES[self]


_COMPRESSION_DTYPES = types.MappingProxyType(
    {
        CpuCompressionMethod.FP16: torch.float16,
        CpuCompressionMethod.BF16: torch.bfloat16,
        CpuCompressionMethod.INT8: torch.int8,
    }
)
_COMPRESSION_DESCRIPTIONS = types.MappingProxyType(
    {
        CpuCompressionMethod.NONE: "no compression: shards kept in the compute dtype",
        CpuCompressionMethod.FP16: "fp16 copy of each shard (lossy, 2 bytes per element)",
        CpuCompressionMethod.BF16: "bf16 copy of each shard (lossy, 2 bytes per element)",
        CpuCompressionMethod.INT8: "int8 with per-block absmax scales (lossy, ~1 byte/element)",
    }
)


class AutoMemoryStrategy(_ChoiceEnum):
    """How eagerly the memory manager evicts and offloads under pressure."""

    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"
    EXTREME = "extreme"

    def pressure_threshold(self) -> float:
        """Return the memory-use fraction above which the manager starts to free memory."""
        return _STRATEGY_TABLE[self][0]

    def aggressiveness(self) -> float:
        """Return the fraction (0..1] of evictable memory freed once over the threshold."""
        return _STRATEGY_TABLE[self][1]

    def description(self) -> str:
        """Return a one-line human-readable description."""
        return _STRATEGY_TABLE[self][2]


_STRATEGY_TABLE = types.MappingProxyType(
    {
        AutoMemoryStrategy.CONSERVATIVE: (0.9, 0.2, "conservative: free memory late and gently"),
        AutoMemoryStrategy.BALANCED: (0.75, 0.5, "balanced: moderate thresholds and eviction"),
        AutoMemoryStrategy.AGGRESSIVE: (0.6, 0.8, "aggressive: free memory early and broadly"),
        AutoMemoryStrategy.EXTREME: (0.4, 1.0, "extreme: keep only what is in use"),
    }
)


def _as_betas(value: object) -> object:
    return tuple(_as_float(b) for b in value) if isinstance(value, (list, tuple)) else value


_check_betas = _rule(
    "must be two numbers, each in [0, 1)",
    lambda v: (
        isinstance(v, tuple)
        and len(v) == 2
        and all(isinstance(b, float) and 0.0 <= b < 1.0 for b in v)
    ),
)
_OPTIMIZER_KINDS = ("adamw", "adam", "sgd")
_check_kind = _rule("must be 'adamw', 'adam' or 'sgd'", lambda v: v in _OPTIMIZER_KINDS)


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """Optimizer applied to each rank's shard; rules are those of ``torch.optim``."""

    kind: Literal["adamw", "adam", "sgd"] = attrs.field(default="adamw", validator=_check_kind)
    """Update rule: ``torch.optim.AdamW``, ``Adam`` or ``SGD`` semantics."""
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), converter=_as_betas, validator=_check_betas
    )
    """Adam(W) running-average coefficients, each in [0, 1)."""
    eps: float = _non_negative(1e-8)
    """Adam(W) denominator term, >= 0."""
    weight_decay: float = _non_negative(0.0)
    """Decoupled for AdamW, L2 added to the gradient for Adam and SGD; >= 0."""
    momentum: float = _non_negative(0.0)
    """SGD momentum factor, >= 0 (0 = plain SGD)."""
    dampening: float = _float_field(0.0, "in [0, 1]", lambda v: 0 <= v <= 1)
    """SGD momentum dampening in [0, 1]."""
    nesterov: bool = _bool_field(False)
    """SGD Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``."""
    amsgrad: bool = _bool_field(False)
    """Adam(W) AMSGrad variant."""
    fused: bool | None = attrs.field(default=None, validator=attrs.validators.optional(_check_bool))
    """Use torch's fused kernel (True), the foreach one (False), or let the library pick
    the fastest available for the device (None)."""

    def __attrs_post_init__(self) -> None:
        if self.kind != "sgd":
            for name in ("momentum", "dampening", "nesterov"):
                if getattr(self, name):
                    _fail(
                        name,
                        getattr(self, name),
                        f"applies only to kind='sgd' (kind={self.kind!r})",
                    )
        elif self.amsgrad:
            _fail("amsgrad", True, "applies only to kind='adam' or 'adamw', not 'sgd'")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            _fail(
                "nesterov",
                True,
                f"requires momentum > 0 and dampening == 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening})",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerConfig:
        """Build from a mapping of field names (e.g. parsed JSON).

        Raises:
            ConfigError: an unknown key (the message lists the valid ones) or a bad value.
        """
        return cls(**_check_keys(cls, data))

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-safe dict (``betas`` as a list)."""
        out = attrs.asdict(self)
        out["betas"] = list(self.betas)
        return out


def _as_optimizer(value: object) -> object:
    if isinstance(value, Mapping):
        try:
            return OptimizerConfig.from_dict(value)
        except ConfigError as exc:
            raise ConfigError(f"optimizer: {exc}") from None
    return value


_check_optimizer = _rule(
    "must be an OptimizerConfig or a dict of its fields",
    lambda v: isinstance(v, OptimizerConfig),
)


_MIB = 2**20


@attrs.frozen(kw_only=True)
class Zero3CpuOffloadConfig:
    """Everything the ZeRO-3 offload manager needs to know, validated at construction."""

    offload_params: bool = _bool_field(True)
    """Keep each rank's parameter shard (fp32 master and compute copy) in CPU memory."""
    offload_grads: bool = _bool_field(True)
    """Move each rank's gradient shard to CPU memory after the reduce-scatter."""
    offload_optimizer_states: bool = _bool_field(True)
    """Keep optimizer state on CPU and run the optimizer step there in worker threads."""
    cpu_memory_budget: int = _int_field(32 * 2**30, 1, "bytes")
    """CPU bytes the library may hold for shards, gradients and optimizer state."""
    gpu_param_memory_budget: int = _int_field(2 * 2**30, 1, "bytes")
    """Device bytes for gathered parameters; must fit in ``max_gpu_memory_mb``."""
    max_gpu_memory_mb: int = _int_field(8192, 1, "MiB")
    """Upper bound on device memory use in MiB."""
    max_cpu_memory_mb: int = _int_field(65536, 1, "MiB")
    """Upper bound on CPU memory use in MiB."""
    prefetch_buffer_size: int = _int_field(2, 1, "layers")
    """How many layers ahead the prefetcher gathers."""
    async_prefetch: bool = _bool_field(True)
    """Run prefetch gathers as tasks concurrently with compute."""
    overlap_computation: bool = _bool_field(True)
    """Overlap collectives and copies with compute (False serialises them, for debugging)."""
    pin_cpu_memory: bool = _bool_field(True)
    """Pin CPU buffers (only takes effect when ``device`` is CUDA)."""
    cpu_compression: CpuCompressionMethod = attrs.field(
        default=CpuCompressionMethod.NONE,
        converter=functools.partial(CpuCompressionMethod.parse, field="cpu_compression"),
    )
    """Format of the compute copy of each CPU parameter shard."""
    auto_memory_management: AutoMemoryStrategy = attrs.field(
        default=AutoMemoryStrategy.BALANCED,
        converter=functools.partial(AutoMemoryStrategy.parse, field="auto_memory_management"),
    )
    """How eagerly the memory manager frees memory under pressure."""
    optimizer: OptimizerConfig = attrs.field(
        factory=OptimizerConfig, converter=_as_optimizer, validator=_check_optimizer
    )
    """Optimizer section (an :class:`OptimizerConfig` or a dict of its fields)."""
    gradient_accumulation_steps: int = _int_field(1, 1)
    """Micro-steps whose gradients are averaged before each optimizer update."""
    gradient_clipping: float = _non_negative(0.0)
    """Maximum global gradient L2 norm; 0 disables clipping."""
    compute_dtype: torch.dtype = attrs.field(
        default=torch.float32, converter=_as_dtype, validator=_check_dtype
    )
    """Dtype of gathered parameters and activations; master weights stay fp32."""
    device: str = attrs.field(default="cpu", converter=_as_device, validator=_check_device)
    """Compute device, normalised (``"cpu"``, ``"cuda"``, ``"cuda:N"``); whether CUDA is
    present is checked when the manager is built, not here."""
    collective_timeout_s: float = _float_field(300.0, "> 0", lambda v: v > 0)
    """Seconds a collective may take before it fails with ``CommunicationError``."""
    compression_block_size: int = _int_field(256, 1, "elements")
    """Elements per absmax scale for ``INT8`` compression."""
    cpu_worker_threads: int = _int_field(2, 1, "threads")
    """Size of the worker-thread limiter for CPU compression and optimizer math."""
    prefetch_bucket_size: int = _int_field(0, 0, "bytes; 0 = no cap")
    """Most bytes of prefetched gathers in flight; 0 means no byte cap."""
    param_persistence_threshold: int = _int_field(0, 0, "elements")
    """Layers with fewer parameter elements than this stay gathered between uses."""
    activation_checkpointing: bool = _bool_field(False)
    """Keep only each layer's input between the passes and recompute the layer's forward
    in backward (about a third more compute, far fewer activations kept); False keeps
    every layer's activations for backward, as plain PyTorch does."""

    def __attrs_post_init__(self) -> None:
        self._check_cross_field()

    def _check_cross_field(self) -> None:
        for budget, limit in (
            ("gpu_param_memory_budget", "max_gpu_memory_mb"),
            ("cpu_memory_budget", "max_cpu_memory_mb"),
        ):
            value, limit_mb = getattr(self, budget), getattr(self, limit)
            if value > limit_mb * _MIB:
                raise ConfigError(
                    f"{budget}={value} is invalid: {value / _MIB:.1f} MiB exceeds "
                    f"{limit}={limit_mb}; lower {budget} or raise {limit}"
                )

    def validate(self) -> None:
        """Check every field and the rules between fields again.

        Construction already runs these checks, so this only fails for an object
        whose fields were changed behind attrs' back.

        Raises:
            ConfigError: the message names the field, the value and the allowed range.
        """
        attrs.validate(self)
        self._check_cross_field()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Zero3CpuOffloadConfig:
        """Build from a mapping of field names, e.g. the output of :meth:`to_dict` or JSON.

        Raises:
            ConfigError: an unknown key (the message lists the valid ones) or a bad value.
        """
        return cls(**_check_keys(cls, data))

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-safe dict (enums by value, dtype by name)."""
        out: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, torch.dtype):
                value = _DTYPE_NAMES[value]
            elif isinstance(value, OptimizerConfig):
                value = value.to_dict()
            out[field.name] = value
        return out

    def evolve(self, **changes: Any) -> Zero3CpuOffloadConfig:
        """Return a copy with ``changes`` applied, validated like a new config.

        Raises:
            ConfigError: an unknown field or an invalid resulting configuration.
        """
        _check_keys(type(self), changes)
        return attrs.evolve(self, **changes)
