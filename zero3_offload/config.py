"""Configuration of ZeRO-3 with CPU offloading, validated at construction.

Mirrors the Rust module's ``config.rs``: :class:`Zero3CpuOffloadConfig` with its enums
:class:`CpuCompressionMethod` and :class:`AutoMemoryStrategy`, and the
optimizer section :class:`OptimizerConfig`; the wire formats of the
collectives, :class:`GatherCompressionMethod` and :class:`ReduceDtype`, are
this package's own. Every invalid value raises
:class:`ConfigError` whose message names the field, the value given and what
is allowed, so an impossible configuration can never be constructed.

The field builders at the top (``int_field``, ``float_field``, ``bool_field``,
``rule``) are shared with the other attrs configurations of the package (the
``train`` command's options): converters never raise, they normalise what they
recognise and leave the rest to the validators, which raise ``ConfigError``.
Field docstrings are user documentation: ``zero3-offload train --help`` and
``docs/configuration.md`` are generated from them.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib
import inspect
import itertools
import math
import re
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import torch

from zero3_offload.errors import ConfigError

__all__ = [
    "AutoMemoryStrategy",
    "CpuCompressionMethod",
    "GatherCompressionMethod",
    "OffloadActivations",
    "OffloadDevice",
    "OptimizerConfig",
    "ReduceDtype",
    "Zero3CpuOffloadConfig",
]

# ------------------------------------------------------------- field builders

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def fail(name: str, value: object, text: str) -> None:
    """Raise the ``ConfigError`` of field ``name``: ``name=value is invalid: text``."""
    raise ConfigError(f"{name}={value!r} is invalid: {text}")


def rule(text: str, ok: Callable[[Any], bool]) -> Validator:
    """An attrs validator that fails with ``text`` when ``ok(value)`` is false."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not ok(value):
            fail(attribute.name, value, text)

    return check


def _as_float(value: object) -> object:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_rule(minimum: int, unit: str = "") -> Validator:
    """A validator for integers (not bools) ``>= minimum``; ``unit`` goes in the message."""
    text = f"must be an integer >= {minimum}" + (f" ({unit})" if unit else "")
    return rule(text, lambda v: _is_int(v) and v >= minimum)


check_bool = rule("must be a bool (True or False)", lambda v: isinstance(v, bool))


def bool_field(default: bool) -> Any:
    """A bool field."""
    return attrs.field(default=default, validator=check_bool)


def int_field(default: int, minimum: int, unit: str = "") -> Any:
    """An integer field ``>= minimum``."""
    return attrs.field(default=default, validator=int_rule(minimum, unit))


def float_field(default: float, text: str, ok: Callable[[float], bool]) -> Any:
    """A finite float field (ints are converted) for which ``ok`` holds; ``text`` states it."""

    def valid(value: object) -> bool:
        return isinstance(value, float) and math.isfinite(value) and ok(value)

    return attrs.field(
        default=default,
        converter=_as_float,
        validator=rule(f"must be a finite number {text}", valid),
    )


def _non_negative(default: float) -> Any:
    return float_field(default, ">= 0", lambda v: v >= 0)


def _check_keys(cls: type, data: object) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__}.from_dict expects a mapping, got {data!r}")
    valid = [f.name for f in attrs.fields(cls)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s) {unknown}: valid keys are {', '.join(valid)}"
        )
    return data


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the fields of the attrs class ``cls``, whitespace folded.

    These are the ``--help`` texts of ``zero3-offload train`` and the entries of
    ``docs/configuration.md``. Empty when the class's source is not available.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


_DTYPE_ALIASES = types.MappingProxyType(
    dict.fromkeys(("fp32", "float32", "float"), torch.float32)
    | dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16)
    | dict.fromkeys(("fp16", "float16", "half"), torch.float16)
)
_DTYPE_NAMES = types.MappingProxyType(
    {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
)


def _as_dtype(value: object) -> object:
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.strip().lower().removeprefix("torch."), value)
    return value


_check_dtype = rule(
    "must be torch.float32, torch.bfloat16 or torch.float16 "
    "(or 'fp32'/'float32', 'bf16'/'bfloat16', 'fp16'/'float16')",
    lambda v: v in _DTYPE_NAMES,
)


def _as_device(value: object) -> object:
    text = str(value) if isinstance(value, torch.device) else value
    if not isinstance(text, str):
        return value
    try:
        device = torch.device(text.strip().lower())
    except (RuntimeError, ValueError):
        return value
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "cuda" if device.index is None else f"cuda:{device.index}"
    return value


_check_device = rule(
    "must be 'cpu', 'cuda' or 'cuda:N' (a str or torch.device)",
    lambda v: isinstance(v, str) and re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
)

# ---------------------------------------------------------------------- enums

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
    """Format of each parameter shard's compute copy: what a gather sends to the device.

    The fp32 master shard is never compressed. ``INT8`` stores one absmax scale per
    ``compression_block_size`` elements. ``NF4`` (QLoRA's 4-bit NormalFloat, one absmax
    scale per 64 elements) is a format of the codec for frozen parameters' copies; as
    ``cpu_compression`` of trainable parameters it is refused.
    """

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    NF4 = "nf4"

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
        CpuCompressionMethod.NF4: torch.uint8,
    }
)
_COMPRESSION_DESCRIPTIONS = types.MappingProxyType(
    {
        CpuCompressionMethod.NONE: "no compression: shards kept in the compute dtype",
        CpuCompressionMethod.FP16: "fp16 copy of each shard (lossy, 2 bytes per element)",
        CpuCompressionMethod.BF16: "bf16 copy of each shard (lossy, 2 bytes per element)",
        CpuCompressionMethod.INT8: "int8 with per-block absmax scales (lossy, ~1 byte/element)",
        CpuCompressionMethod.NF4: (
            "4-bit NormalFloat with an absmax scale per 64 elements, two per byte (lossy, "
            "~0.56 byte/element; frozen parameters only)"
        ),
    }
)


class GatherCompressionMethod(_ChoiceEnum):
    """Format the weight all-gather puts on the wire: a compute-copy format, sent as stored.

    Each rank sends its compute copy as it is stored (``INT8``: the fp32 scales with
    the payload) and every rank decodes the gathered buffer, rank by rank, into the
    compute dtype, so the gathered values are those of decoding first and gathering
    the compute dtype. ``NONE`` gathers the decoded compute dtype.
    """

    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"

    def compute_copy_format(self) -> CpuCompressionMethod:
        """The compute-copy format this wire format sends (``NONE`` for ``NONE``)."""
        return CpuCompressionMethod(self.value)


class OffloadDevice(_ChoiceEnum):
    """Where an offloaded tier lives: CPU memory, or files under ``nvme_path``."""

    CPU = "cpu"
    NVME = "nvme"


class OffloadActivations(_ChoiceEnum):
    """Where checkpointed units' saved inputs live between the forward and their
    recomputation: the compute device, host memory, or a file under ``nvme_path``."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class ReduceDtype(_ChoiceEnum):
    """Dtype of the gradient reduce-scatter on the wire; gradient shards stay fp32."""

    FP32 = "fp32"
    BF16 = "bf16"

    def wire_dtype(self) -> torch.dtype:
        """The dtype of the tensors handed to the reduce-scatter."""
        return torch.bfloat16 if self is ReduceDtype.BF16 else torch.float32


class AutoMemoryStrategy(_ChoiceEnum):
    """How early the pressure policy frees gathered parameters and shrinks prefetch.

    At every optimizer update the policy measures memory pressure (see
    ``memory.pressure``); above :meth:`pressure_threshold` it releases every
    gathered layer (persistent ones too, and persistence stays off) and shrinks
    the prefetch depth by :meth:`aggressiveness`; below 0.8 of the threshold it
    restores both.
    """

    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"
    EXTREME = "extreme"

    def pressure_threshold(self) -> float:
        """Return the pressure (0..1) above which gathered layers are released."""
        return _STRATEGY_TABLE[self][0]

    def aggressiveness(self) -> float:
        """Return the fraction (0..1] by which the prefetch depth shrinks over the threshold."""
        return _STRATEGY_TABLE[self][1]

    def description(self) -> str:
        """Return a one-line human-readable description."""
        return _STRATEGY_TABLE[self][2]


_STRATEGY_TABLE = types.MappingProxyType(
    {
        AutoMemoryStrategy.CONSERVATIVE: (
            0.9,
            0.2,
            "conservative: act at 90% pressure, prefetch depth -20%",
        ),
        AutoMemoryStrategy.BALANCED: (
            0.75,
            0.5,
            "balanced: act at 75% pressure, prefetch depth -50%",
        ),
        AutoMemoryStrategy.AGGRESSIVE: (
            0.6,
            0.8,
            "aggressive: act at 60% pressure, prefetch depth -80%",
        ),
        AutoMemoryStrategy.EXTREME: (0.4, 1.0, "extreme: act at 40% pressure, prefetch depth 1"),
    }
)


def _as_betas(value: object) -> object:
    return tuple(_as_float(b) for b in value) if isinstance(value, (list, tuple)) else value


_check_betas = rule(
    "must be two numbers, each in [0, 1)",
    lambda v: (
        isinstance(v, tuple)
        and len(v) == 2
        and all(isinstance(b, float) and 0.0 <= b < 1.0 for b in v)
    ),
)
_OPTIMIZER_KINDS = ("adamw", "adam", "sgd")
BUILTIN_OPTIMIZERS = types.MappingProxyType(
    {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}
)
"""The short kinds and the torch class each names."""
# Constructor arguments the library sets itself: the learning rate (``learning_rate *
# lr_scale``), the kernel (``OptimizerConfig.fused``) and the parameters.
RESERVED_OPTIONS = frozenset({"params", "lr", "fused", "foreach"})
_check_kind = rule(
    "must be 'adamw', 'adam', 'sgd' or the dotted name of a torch.optim.Optimizer subclass "
    "(e.g. 'torch.optim.RMSprop')",
    lambda v: isinstance(v, str) and (v in _OPTIMIZER_KINDS or "." in v),
)


def optimizer_class(kind: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` subclass ``kind`` names: a short kind or a dotted name
    (its module is imported).

    Raises:
        ConfigError: when the name cannot be imported or is not an optimizer class.
    """
    dotted = BUILTIN_OPTIMIZERS.get(kind, kind)
    module_name, _, attr = dotted.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"optimizer kind={kind!r} is invalid: cannot import {dotted} ({exc})"
        ) from None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ConfigError(
            f"optimizer kind={kind!r} is invalid: {dotted} is not a torch.optim.Optimizer subclass"
        )
    return found


def optimizer_label(cls: type) -> str:
    """``cls``'s dotted name as users write it (``torch.optim.RMSprop``)."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_option_names(cls: type[torch.optim.Optimizer]) -> tuple[str, ...]:
    """The options ``cls``'s constructor takes, without the ones the library sets."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(
        name
        for name, p in params.items()
        if name != "self"
        and name not in RESERVED_OPTIONS
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )


def _json_safe(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return not isinstance(value, float) or math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_json_safe(v) for v in value)
    return False


def check_optimizer_options(
    cls: type[torch.optim.Optimizer], options: Mapping[str, Any], where: str
) -> None:
    """Refuse options ``cls``'s constructor does not take, the ones the library sets, and
    values that are not JSON-safe (they are saved in checkpoints).

    Raises:
        ConfigError: naming ``where``, the option and what is allowed.
    """
    valid = optimizer_option_names(cls)
    name = optimizer_label(cls)
    for key, value in options.items():
        if key == "lr":
            fail(
                f"{where}lr",
                value,
                "the learning rate is optimizer_step's learning_rate (times a parameter "
                "group's lr_scale); give lr_scale instead",
            )
        if key in RESERVED_OPTIONS:
            fail(f"{where}{key}", value, "the kernel is chosen by OptimizerConfig.fused")
        if key not in valid:
            fail(f"{where}{key}", value, f"{name} takes {', '.join(valid) or 'no options'}")
        if not _json_safe(value):
            fail(
                f"{where}{key}",
                value,
                "must be None, a bool, a number, a str, or a list of them (it is saved "
                "in checkpoints as JSON)",
            )


def _as_options(value: object) -> object:
    # A copy: the caller's mapping may change later (it is not read again).
    return dict(value) if isinstance(value, Mapping) else value


_check_options = rule(
    "must be a mapping of option names to values",
    lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
)


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """Optimizer applied to each rank's shard; rules are those of ``torch.optim``."""

    kind: str = attrs.field(default="adamw", validator=_check_kind)
    """Update rule: ``"adamw"``, ``"adam"`` or ``"sgd"`` (``torch.optim.AdamW``, ``Adam``,
    ``SGD``, with the fields below), or the dotted name of any ``torch.optim.Optimizer``
    subclass (e.g. ``"torch.optim.RMSprop"``, ``"torch.optim.Muon"``) with its constructor
    arguments in ``options``. Element-wise optimizers update the flat shards; Adafactor
    and Muon update each parameter whole at one owning rank; others are refused with the
    reason (see docs/optimizers.md)."""
    options: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_as_options, validator=_check_options, hash=False
    )
    """Constructor arguments of a dotted ``kind`` (e.g. ``{"alpha": 0.9}``), without ``lr``
    (the learning rate is ``optimizer_step``'s) and the kernel flags; JSON values only.
    Empty for the short kinds, which take the fields below."""
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
    dampening: float = float_field(0.0, "in [0, 1]", lambda v: 0 <= v <= 1)
    """SGD momentum dampening in [0, 1]."""
    nesterov: bool = bool_field(False)
    """SGD Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``."""
    amsgrad: bool = bool_field(False)
    """Adam(W) AMSGrad variant."""
    fused: bool | None = attrs.field(default=None, validator=attrs.validators.optional(check_bool))
    """Use torch's fused kernel (True), the foreach one (False), or let the library pick
    the fastest available for the device (None)."""

    def __attrs_post_init__(self) -> None:
        if self.kind not in _OPTIMIZER_KINDS:
            self._check_dotted()
            return
        if self.options:
            fail(
                "options",
                dict(self.options),
                f"applies to a dotted kind; kind={self.kind!r} takes the fields "
                "(weight_decay, betas, ...)",
            )
        if self.kind != "sgd":
            for name in ("momentum", "dampening", "nesterov"):
                if getattr(self, name):
                    fail(
                        name,
                        getattr(self, name),
                        f"applies only to kind='sgd' (kind={self.kind!r})",
                    )
        elif self.amsgrad:
            fail("amsgrad", True, "applies only to kind='adam' or 'adamw', not 'sgd'")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            fail(
                "nesterov",
                True,
                f"requires momentum > 0 and dampening == 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening})",
            )

    def _check_dotted(self) -> None:
        cls = optimizer_class(self.kind)
        for field in attrs.fields(type(self)):
            if field.name in ("kind", "options", "fused"):
                continue
            if getattr(self, field.name) != field.default:
                fail(
                    field.name,
                    getattr(self, field.name),
                    f"applies to kind 'adamw', 'adam' or 'sgd'; with kind={self.kind!r} give "
                    f"the constructor's arguments in options",
                )
        check_optimizer_options(cls, self.options, "options.")

    def class_name(self) -> str:
        """The dotted name of the torch class (``"torch.optim.AdamW"`` for ``"adamw"``)."""
        return BUILTIN_OPTIMIZERS.get(self.kind, self.kind)

    def torch_options(self) -> dict[str, Any]:
        """The constructor arguments of the torch optimizer (without ``lr`` and the kernel)."""
        if self.kind not in _OPTIMIZER_KINDS:
            return dict(self.options)
        if self.kind == "sgd":
            names = ("momentum", "dampening", "weight_decay", "nesterov")
        else:
            names = ("betas", "eps", "weight_decay", "amsgrad")
        return {name: getattr(self, name) for name in names}

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
        out["options"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()
        }
        return out


def _as_optimizer(value: object) -> object:
    if isinstance(value, Mapping):
        try:
            return OptimizerConfig.from_dict(value)
        except ConfigError as exc:
            raise ConfigError(f"optimizer: {exc}") from None
    return value


_check_optimizer = rule(
    "must be an OptimizerConfig or a dict of its fields",
    lambda v: isinstance(v, OptimizerConfig),
)


_MIB = 2**20


@attrs.frozen(kw_only=True)
class Zero3CpuOffloadConfig:
    """Everything the ZeRO-3 offload manager needs to know, validated at construction."""

    offload_params: bool = bool_field(True)
    """Keep each rank's compute copies of its parameter shards (what a gather sends to the
    device) in CPU memory; False keeps them on the device."""
    offload_grads: bool = bool_field(True)
    """Copy each rank's reduced gradient shards to CPU memory and accumulate them there;
    False keeps them on the device."""
    offload_optimizer_states: bool = bool_field(True)
    """Keep the fp32 master shards and the optimizer state in CPU memory and run the
    optimizer step there; False keeps both on the device."""
    cpu_memory_budget: int = int_field(32 * 2**30, 1, "bytes")
    """CPU bytes this rank may hold for master shards, optimizer state, compute copies and
    gradient shards, counted exactly from their sizes when the manager is built
    (``MemoryBudgetError`` when they do not fit); gathered buffers and activations are
    not part of it."""
    gpu_param_memory_budget: int = int_field(2 * 2**30, 1, "bytes")
    """Hard cap on the device bytes of gathered plus in-flight parameter buffers (the layer
    in use and the prefetched ones); a layer larger than this is refused when the manager
    is built. At most ``max_gpu_memory_mb``."""
    max_gpu_memory_mb: int = int_field(8192, 1, "MiB")
    """Device memory in MiB that memory pressure is measured against on CUDA (the smaller
    of this and the device's capacity), and the ceiling of ``gpu_param_memory_budget``.
    It caps no allocation by itself."""
    max_cpu_memory_mb: int = int_field(65536, 1, "MiB")
    """CPU memory in MiB that the process's RSS is measured against for memory pressure (the
    smaller of this and the machine's RAM), and the ceiling of ``cpu_memory_budget``. It
    caps no allocation by itself."""
    prefetch_buffer_size: int = int_field(2, 1, "layers")
    """Layers gathered ahead of the one in use, within ``gpu_param_memory_budget`` and
    ``prefetch_bucket_size``."""
    async_prefetch: bool = bool_field(True)
    """Gather the next ``prefetch_buffer_size`` layers while the current one computes;
    False gathers each layer only when it is needed."""
    overlap_computation: bool = bool_field(True)
    """Start each layer's optimizer update in a worker thread as soon as its gradient shard
    is final, while backward goes on (needs ``learning_rate=`` in ``backward_pass``; not
    with a layer used twice; with gradient clipping, fp16 or ``skip_nonfinite_steps`` only
    with ``speculative_step``). False runs every update in ``optimizer_step``. Collectives and
    copies overlap compute either way."""
    pin_cpu_memory: bool = bool_field(True)
    """Allocate the CPU compute copies and the gradient staging buffers in pinned memory, for
    asynchronous copies (takes effect only when ``device`` is CUDA)."""
    cpu_compression: CpuCompressionMethod = attrs.field(
        default=CpuCompressionMethod.NONE,
        converter=functools.partial(CpuCompressionMethod.parse, field="cpu_compression"),
    )
    """Format of the compute copies that gathers send to the device (see
    :class:`CpuCompressionMethod`; ``"nf4"`` is refused: it is for frozen parameters);
    the fp32 master shards are never compressed."""
    frozen_compression: CpuCompressionMethod = attrs.field(
        default=CpuCompressionMethod.NONE,
        converter=functools.partial(CpuCompressionMethod.parse, field="frozen_compression"),
    )
    """Format frozen parameters (``requires_grad=False`` when the manager is built) are
    stored and all-gathered in: their only copy, with no fp32 master, gradient or
    optimizer state. ``"none"`` keeps the compute dtype; ``"bf16"``/``"fp16"`` halve
    fp32; ``"int8"`` stores one absmax scale per ``compression_block_size`` elements;
    ``"nf4"`` is QLoRA's 4-bit NormalFloat (one absmax scale per 64 elements). Gathers
    decode it into the compute dtype."""
    frozen_decode_at_use: bool = bool_field(False)
    """Module mode: a gathered unit keeps its frozen parameters as stored and decodes the
    weight of each frozen plain ``nn.Linear`` and ``nn.Embedding`` at use, into a reused
    16 MiB scratch (by blocks of rows when larger), again in backward for the input's
    gradient; only the other frozen parameters are decoded when the gather completes.
    Saves the compute dtype's bytes of those weights while gathered (fp32 compute with
    ``frozen_compression="nf4"``: about 7/8) for a decode per use. Not for tied
    weights or DoRA units. No effect when ``frozen_compression`` stores the compute
    dtype, or in chain mode."""
    auto_memory_management: AutoMemoryStrategy = attrs.field(
        default=AutoMemoryStrategy.BALANCED,
        converter=functools.partial(AutoMemoryStrategy.parse, field="auto_memory_management"),
    )
    """The memory-pressure policy applied at each optimizer update (see
    :class:`AutoMemoryStrategy`)."""
    optimizer: OptimizerConfig = attrs.field(
        factory=OptimizerConfig, converter=_as_optimizer, validator=_check_optimizer
    )
    """Optimizer section (an :class:`OptimizerConfig` or a dict of its fields)."""
    gradient_accumulation_steps: int = int_field(1, 1)
    """Micro-steps whose gradients are averaged before each optimizer update."""
    gradient_clipping: float = _non_negative(0.0)
    """Maximum global gradient L2 norm; 0 disables clipping."""
    skip_nonfinite_steps: bool = bool_field(False)
    """Skip, on every rank, an optimizer step whose global gradient norm is inf or nan:
    parameters, optimizer state and the optimizer's step counts stay bitwise as they were
    (the step is closed and counted in ``nonfinite_skips``; a learning-rate schedule driven
    by the step index moves on). The warning names the first layer, in backward order,
    whose gradient held an inf or nan and every rank whose loss was not finite. Costs one
    pass over the gradient shards and a one-element all-reduce per step when clipping is
    off (clipping computes the norm anyway); fp16 keeps its loss scaler's inf/nan check.
    As with clipping, updates start during backward only with ``speculative_step``.
    ``zero3-offload train`` turns it on."""
    max_consecutive_nonfinite: int = int_field(10, 1, "steps")
    """With ``skip_nonfinite_steps``: after this many skipped steps in a row (fp16: those in
    which a rank's loss was not finite), ``optimizer_step`` raises ``NonFiniteError`` on
    every rank."""
    compute_dtype: torch.dtype = attrs.field(
        default=torch.float32, converter=_as_dtype, validator=_check_dtype
    )
    """Dtype of gathered parameters and activations; master weights stay fp32."""
    device: str = attrs.field(default="cpu", converter=_as_device, validator=_check_device)
    """Compute device, normalised (``"cpu"``, ``"cuda"``, ``"cuda:N"``); whether CUDA is
    present is checked when the manager is built, not here."""
    collective_timeout_s: float = float_field(300.0, "> 0", lambda v: v > 0)
    """Seconds a collective may take before it fails with ``CommunicationError``."""
    heartbeat_timeout_s: float = float_field(5.0, "> 0", lambda v: v > 0)
    """Seconds of silence after which a rank counts as stopped or dead: every other rank
    raises ``CommunicationError`` naming it, whatever ``collective_timeout_s`` allows a
    collective. Ranks beat through the rendezvous store, never the training group."""
    divergence_check: bool = bool_field(True)
    """Before the first collective of each call, check that every rank is about to run
    the same call (arguments, grad mode, step, micro-step) and the same collectives since
    the last check; a difference raises ``RankDivergenceError`` on every rank instead of
    a crash or a hang. Costs one small all-gather per call."""
    compression_block_size: int = int_field(256, 1, "elements")
    """Elements per absmax scale for ``INT8`` compression."""
    gather_compression: GatherCompressionMethod = attrs.field(
        default=GatherCompressionMethod.NONE,
        converter=functools.partial(GatherCompressionMethod.parse, field="gather_compression"),
    )
    """Format of the weight all-gather on the wire (see :class:`GatherCompressionMethod`):
    ``"bf16"`` or ``"int8"`` sends each rank's compute copy as stored (about 1/2 or 1/4 of
    fp32's bytes) and decodes the gathered buffer on every rank, bitwise what
    ``cpu_compression`` of the same format gives; it implies that storage of the compute
    copies when ``cpu_compression`` is ``"none"``, and any other ``cpu_compression`` is an
    error. ``"none"`` gathers the compute dtype."""
    reduce_dtype: ReduceDtype = attrs.field(
        default=ReduceDtype.FP32,
        converter=functools.partial(ReduceDtype.parse, field="reduce_dtype"),
    )
    """Dtype of the gradient reduce-scatter on the wire (see :class:`ReduceDtype`):
    ``"bf16"`` casts each layer's flat fp32 gradient to bf16, averages it over ranks in bf16
    (half the bytes) and widens this rank's shard to fp32 before it is accumulated; ``"fp32"``
    reduces the fp32 gradient exactly as computed."""
    cpu_worker_threads: int = int_field(2, 1, "threads")
    """Worker threads that may run CPU work at once: optimizer math, compute-copy encoding,
    gradient accumulation and checkpoint I/O."""
    prefetch_bucket_size: int = int_field(0, 0, "bytes; 0 = no cap")
    """Most bytes of prefetched gathers in flight; 0 means no byte cap."""
    param_persistence_threshold: int = int_field(0, 0, "elements")
    """Layers with fewer parameter elements than this stay gathered between uses, smallest
    first, as many as fit in ``gpu_param_memory_budget`` beside the largest other layer."""
    activation_checkpointing: bool = bool_field(False)
    """Save only each layer's input between the passes and recompute the layer's forward
    in backward (about a third more compute, far fewer activations saved); False saves
    every layer's activations for backward, as plain PyTorch does."""
    selective_checkpointing_units: int = int_field(0, 0, "units")
    """With ``activation_checkpointing``, the last this-many checkpointed layers (in the
    chain's order, or module mode's units in the model's order) also save the outputs of
    their matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``) for backward, except
    low-rank ones (output rows over 4x the contracted dimension, e.g. a LoRA adapter's
    up-projection); backward then recomputes only the rest of their forward: norms,
    activations, attention, the low-rank products. That is most of the recomputation's
    cost, for those outputs' bytes per layer (about half of what a transformer layer saves
    without checkpointing); results are bitwise those of full recomputation. 0: every
    checkpointed layer recomputes its whole forward. Setting it without
    ``activation_checkpointing`` is refused."""
    offload_activations: OffloadActivations = attrs.field(
        default=OffloadActivations.NONE,
        converter=functools.partial(OffloadActivations.parse, field="offload_activations"),
    )
    """With ``activation_checkpointing``, where the inputs checkpointed layers save stay
    until their recomputation (module mode: each checkpointed unit's positional tensor
    arguments, a decoder layer's hidden states; chain mode: each layer's input):
    ``"none"`` keeps them on the compute device; ``"cpu"`` copies them to host memory
    (pinned, on a side stream, on an accelerator; on the CPU device it is a copy into
    other host memory that saves nothing); ``"nvme"`` writes them to a file under
    ``nvme_path`` as the forward goes, removed after the backward, and reads them back at
    least one layer ahead of the backward. Bitwise the results of ``"none"``. Needs
    ``activation_checkpointing``; ``"nvme"`` needs ``nvme_path``."""
    activation_read_ahead_bytes: int = int_field(0, 0, "bytes; 0 = one unit")
    """With ``offload_activations="nvme"``, most bytes of offloaded inputs read back ahead
    of the backward and not used yet: the backward reads one unit ahead whatever this
    is, and further units while their bytes fit. More read-ahead hides a slow disk's
    latency at the cost of holding those inputs in memory again. 0: one unit ahead."""
    mlp_chunk_tokens: int = int_field(0, 0, "tokens; 0 = off")
    """Tiled MLP (module mode): each unit's ``mlp`` submodule (a transformers decoder
    layer's) runs over chunks of this many tokens (the batch's rows flattened) and
    recomputes each chunk in backward, so its intermediate activations exist for one
    chunk at a time, never for the whole sequence; it saves only its input. Costs one more
    MLP forward per step. Results equal untiled training to rounding. Refused in chain
    mode and for a model whose units have no ``mlp``. 0: off."""
    sequence_parallel_size: int = int_field(1, 1, "ranks")
    """Module mode, transformers models: split each sequence over this many consecutive
    ranks (Ulysses sequence parallelism; data parallel across the groups). Every rank of
    a group passes the same batch to ``forward``; each runs its 1/S of the tokens, with
    all-to-alls around attention, and ``out.loss`` is the whole sequence's. It must
    divide the world size and the attention heads, and divide the key/value heads or be
    a multiple of them (each one is then replicated). Parameters stay partitioned over
    all ranks. See docs/long_context.md."""
    loss_chunk_tokens: int = int_field(256, 0, "tokens; 0 = the model's own loss")
    """Module mode: a forward given ``labels=`` computes a transformers causal LM's loss in
    chunks of this many tokens (head, logit transform, cross-entropy per chunk), so the full
    logits (tokens x vocabulary, fp32) are never held. A frozen head's gradient is taken in
    the forward, each chunk's logits computed once; a trained head's loss recomputes each
    chunk's logits in the backward. Equal to the model's own loss up to fp32 rounding; the
    output's ``logits`` is
    then None (pass ``return_logits=True`` to ``forward`` for the model's own logits and
    loss). A model whose head or loss it cannot reproduce exactly uses its own loss (logged
    once). 0: always the model's own loss and logits."""
    speculative_step: bool = bool_field(False)
    """With ``gradient_clipping`` or fp16 and ``overlap_computation``, start each layer's
    update during backward anyway, from a saved copy of its master shard and optimizer
    state; ``optimizer_step`` keeps the updates when clipping does not apply and no inf/nan
    appeared, else restores the copies and redoes them clipped (or skips the step): bitwise
    the same result. Costs the copies (about three shard sizes per layer for AdamW, held
    between steps) and, when clipping fires, a second update; it pays where the CPU is
    otherwise idle during backward (compute on a GPU), not where the layers compute on the
    same cores. False: with clipping or fp16 the updates wait for the whole backward."""
    trim_heap_after_forward: bool = bool_field(False)
    """After each training forward, and in module mode also as it enters its last unit
    (most often the head, as the loss begins), return the C heap's free pages to the OS
    (glibc's ``malloc_trim(0)``, 2-3 ms; nothing off glibc), so the small blocks the
    layers freed do not count in the peak RSS of the loss and the backward. Each trim is
    a ``heap-trim`` interval on the timeline, its bytes the measured fall of the RSS."""
    keep_gathered_for_backward: bool = bool_field(True)
    """Keep the last layers of a training forward gathered until their backward (which
    starts there) instead of gathering them again: as many as ``gpu_param_memory_budget``
    holds next to the prefetch window (on the CPU device at most ``prefetch_buffer_size +
    2`` largest layers' bytes, the reused buffers); each is released after its backward.
    False releases every layer after its forward."""
    keep_gathered_bytes: int = int_field(0, 0, "bytes; 0 = the default limit")
    """Most bytes of layers ``keep_gathered_for_backward`` keeps gathered (the last layers
    of the forward, whole layers only), still within ``gpu_param_memory_budget`` next to
    the prefetch window; 0 keeps the default limit (on the CPU device ``prefetch_buffer_size
    + 2`` largest layers' bytes, else the budget alone). Lower it to trade gathers for peak
    memory: each kept layer is gathered once per step instead of twice. Setting it with
    ``keep_gathered_for_backward=False`` is refused."""
    shared_memory_collectives: bool = bool_field(True)
    """On the CPU device, when every rank runs on the same host, move the data of the
    all-gathers and reduce-scatters through one shared-memory region (32 MiB on 2 ranks:
    two 8 MiB blocks per rank) instead of the backend's sockets; the backend then carries
    one small all-reduce per 8 MiB, which orders the ranks. Same results bit for bit.
    Falls back to the backend when a rank cannot open the region (another host). False:
    everything goes through the backend."""

    offload_optimizer_device: OffloadDevice = attrs.field(
        default=OffloadDevice.CPU,
        converter=functools.partial(OffloadDevice.parse, field="offload_optimizer_device"),
    )
    """Where the offloaded fp32 master shards and optimizer state live: ``"cpu"`` (memory)
    or ``"nvme"`` (one preallocated file per rank under ``nvme_path``, streamed through a
    few reused buffers: each layer's shard and state are read for its update and written
    back after it, bitwise the values the CPU tier holds). Needs
    ``offload_optimizer_states``."""
    offload_param_device: OffloadDevice = attrs.field(
        default=OffloadDevice.CPU,
        converter=functools.partial(OffloadDevice.parse, field="offload_param_device"),
    )
    """Where the offloaded compute copies of the parameter shards live: ``"cpu"`` (memory)
    or ``"nvme"`` (one preallocated file per rank under ``nvme_path``; each layer's copy
    is read into a few reused buffers ahead of its gather and written when its master
    changes, bitwise the bytes the CPU tier holds). Needs ``offload_params``."""
    nvme_path: str | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(
            rule("must be a directory path (a str)", lambda v: isinstance(v, str) and v != "")
        ),
    )
    """Directory of the ``"nvme"`` tiers: each rank creates ``rank<N>/`` under it (and holds
    the lock file ``rank<N>.lock`` while it runs), which must not exist yet, and removes both
    on ``close()``. A directory another run holds is always refused; one a crashed run left
    is refused unless ``nvme_replace_stale`` is set."""
    nvme_replace_stale: bool = bool_field(False)
    """Replace a ``rank<N>/`` directory under ``nvme_path`` that a crashed run left (its lock
    is free) when it holds only the disk tiers' files; False refuses it (remove it by
    hand). A directory a live run holds is never replaced."""

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
        on_disk = self.offload_optimizer_device is OffloadDevice.NVME
        for field, device, needs, holds in (
            ("offload_param_device", self.offload_param_device, "offload_params", "compute copies"),
            (
                "offload_optimizer_device",
                self.offload_optimizer_device,
                "offload_optimizer_states",
                "optimizer state",
            ),
        ):
            if device is not OffloadDevice.NVME:
                continue
            if not getattr(self, needs):
                raise ConfigError(
                    f"{field}='nvme' is invalid with {needs}=False: the disk tier holds "
                    f"offloaded {holds}; set it to True"
                )
            if self.nvme_path is None:
                raise ConfigError(
                    f"{field}='nvme' needs nvme_path: the directory the per-rank files are "
                    "created in"
                )
        if on_disk and self.speculative_step:
            raise ConfigError(
                "speculative_step=True is invalid with offload_optimizer_device='nvme': "
                "the pre-update copies need the state in memory; set one of them back"
            )
        if self.keep_gathered_bytes and not self.keep_gathered_for_backward:
            raise ConfigError(
                f"keep_gathered_bytes={self.keep_gathered_bytes} is invalid with "
                "keep_gathered_for_backward=False: it limits the layers kept for backward, "
                "and none are kept; set keep_gathered_for_backward=True or leave it at 0"
            )
        if self.selective_checkpointing_units and not self.activation_checkpointing:
            raise ConfigError(
                f"selective_checkpointing_units={self.selective_checkpointing_units} is "
                "invalid with activation_checkpointing=False: it picks checkpointed layers "
                "that save their products, and none are checkpointed; set "
                "activation_checkpointing=True or leave it at 0"
            )
        self._check_activation_offload()
        if self.cpu_compression is CpuCompressionMethod.NF4:
            raise ConfigError(
                "cpu_compression='nf4' is invalid: NF4 (4-bit NormalFloat) stores the copies "
                "of frozen parameters (QLoRA-style): set frozen_compression='nf4'; the compute "
                "copies of trainable parameters, re-encoded at every update, take 'int8', "
                "'bf16' or 'fp16'"
            )
        wire = self.gather_compression.compute_copy_format()
        if wire.is_lossy() and self.cpu_compression not in (CpuCompressionMethod.NONE, wire):
            raise ConfigError(
                f"gather_compression={wire.value!r} is invalid with cpu_compression="
                f"{self.cpu_compression.value!r}: the all-gather sends the compute copies as "
                f"they are stored, so cpu_compression must be 'none' (they are then stored as "
                f"{wire.value}) or {wire.value!r}"
            )

    def _check_activation_offload(self) -> None:
        where = self.offload_activations
        if self.activation_read_ahead_bytes and where is not OffloadActivations.NVME:
            raise ConfigError(
                f"activation_read_ahead_bytes={self.activation_read_ahead_bytes} is invalid "
                f"with offload_activations={where.value!r}: only activations on disk are read "
                "ahead; set offload_activations='nvme' or leave it at 0"
            )
        if where is OffloadActivations.NONE:
            return
        if not self.activation_checkpointing:
            raise ConfigError(
                f"offload_activations={where.value!r} is invalid with "
                "activation_checkpointing=False: it moves the inputs checkpointed units "
                "save, and none are checkpointed; set activation_checkpointing=True or "
                "offload_activations='none'"
            )
        if where is OffloadActivations.NVME and self.nvme_path is None:
            raise ConfigError(
                "offload_activations='nvme' needs nvme_path: the directory the per-rank "
                "activation files are written in"
            )

    def compute_copy_compression(self) -> CpuCompressionMethod:
        """The format the compute copies are stored in: ``cpu_compression``, or the
        format of ``gather_compression`` when that is set (it implies the storage)."""
        if self.gather_compression is GatherCompressionMethod.NONE:
            return self.cpu_compression
        return self.gather_compression.compute_copy_format()

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
