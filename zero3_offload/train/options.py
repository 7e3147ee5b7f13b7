"""What ``zero3-offload train`` can be told: training options and their flags.

Every option has one name, used as the key in ``--config`` files and, with
dashes, as the flag: the training options of :class:`TrainOptions`, every field
of :class:`~zero3_offload.config.Zero3CpuOffloadConfig` (``--offload-params``,
``--cpu-memory-budget``, ...) and every field of its optimizer section with an
``optimizer_`` prefix (``--optimizer-kind``, ``--optimizer-betas``, ...). The
list is generated from the attrs classes, so a new config field gets its flag
without a change here; help texts are the fields' docstrings.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import attrs
import torch

from zero3_offload.config import (
    OptimizerConfig,
    Zero3CpuOffloadConfig,
    bool_field,
    field_docs,
    float_field,
    int_field,
    rule,
)
from zero3_offload.data.bad_records import BAD_RECORD_POLICIES
from zero3_offload.data.chat_render import LOSS_ON
from zero3_offload.data.record_format import DATA_FORMATS
from zero3_offload.errors import ConfigError
from zero3_offload.train.freeze import freeze_patterns
from zero3_offload.train.lora_spec import LoraSpec

__all__ = ["OPTIONS", "TRAIN_DEFAULTS", "Option", "TrainOptions", "format_size", "parse_size"]

_LOG_LEVELS = ("debug", "info", "warning", "error")
# Options with a fixed set of string values.
_CHOICES = {
    "log_level": _LOG_LEVELS,
    "data_format": DATA_FORMATS,
    "loss_on": LOSS_ON,
    "bad_records": BAD_RECORD_POLICIES,
}


def _choice(name: str) -> Any:
    values = _CHOICES[name]
    return attrs.field(
        default=values[0] if name != "log_level" else "info",
        validator=rule(f"must be one of {', '.join(values)}", lambda v: v in values),
    )


_optional_str = attrs.validators.optional(rule("must be a string", lambda v: isinstance(v, str)))
_optional_bool = attrs.validators.optional(
    rule("must be true or false", lambda v: isinstance(v, bool))
)


@attrs.frozen(kw_only=True)
class TrainOptions:
    """The training run (the ZeRO-3 configuration is a separate object)."""

    world_size: int = int_field(2, 1, "ranks")
    """Local ranks to start, gloo on 127.0.0.1 (under torchrun its WORLD_SIZE is used)."""
    steps: int = int_field(300, 1, "optimizer steps")
    """Optimizer steps of the whole run; a resumed run continues up to this step."""
    batch_size: int = int_field(8, 1, "sequences")
    """Sequences per rank per micro-step (examples, with examples in data)."""
    seq_len: int = int_field(128, 2, "tokens")
    """Tokens per training sequence, bytes for the built-in GPT (the model's context length).
    With examples (records or a dataset in data) the longest example, and the length of a
    packed row; longer examples are cut to it (see docs/sft.md)."""
    model: str | None = attrs.field(default=None, validator=_optional_str)
    """Fine-tune the transformers causal LM of this local directory (config.json; weights
    from model.safetensors or its index, else random init; its tokenizer, else bytes as
    tokens) instead of the built-in byte-level GPT."""
    export: str | None = attrs.field(default=None, validator=_optional_str)
    """At the end, write the trained model (and its tokenizer) here as a transformers
    directory that AutoModelForCausalLM.from_pretrained loads; with lora or peft_config the
    adapter directory that PeftModel.from_pretrained loads (export_merged: the merged
    model). The tokenizer's chat template and model's generation_config.json come along
    (needs model; must not exist or be empty)."""
    lora: LoraSpec | None = attrs.field(
        default=None, converter=attrs.converters.optional(LoraSpec.parse)
    )
    """Train LoRA adapters on model instead of its weights, e.g.
    r=16,alpha=32,dropout=0.05,target=q_proj,k_proj,v_proj,o_proj (keys r, alpha, dropout,
    target; target: module names, or all-linear; without it peft's default for the
    architecture); export then writes the adapter directory."""
    peft_config: str | None = attrs.field(default=None, validator=_optional_str)
    """Train the adapters of this peft config instead of lora's: an adapter_config.json
    (as peft's save_pretrained writes it) or a directory holding one."""
    freeze: tuple[str, ...] | None = attrs.field(default=None, converter=freeze_patterns)
    """Leave the parameters of model whose names match these comma-separated globs
    unchanged, e.g. 'model.embed_tokens.*,model.layers.[01].*' (fnmatch over the whole
    names of named_parameters(); each glob must match; not with lora)."""
    export_merged: bool = bool_field(False)
    """Export the model with the LoRA adapters merged into its weights (a transformers
    directory) instead of the adapter directory (needs export and lora or peft_config)."""
    d_model: int = int_field(128, 1)
    """Width of the built-in GPT (not used with model)."""
    layers: int = int_field(4, 1, "blocks")
    """Transformer blocks of the built-in GPT (not used with model)."""
    heads: int = int_field(4, 1)
    """Attention heads of the built-in GPT; must divide d_model (not used with model)."""
    lr: float = float_field(3e-3, "> 0", lambda v: v > 0)
    """Peak learning rate, reached after warmup_steps, then cosine decay to a tenth."""
    warmup_steps: int = int_field(20, 0, "steps")
    """Steps of linear learning-rate warmup."""
    eval_every: int = int_field(100, 0, "steps; 0: at the start and end only")
    """Evaluate on held-out text every this many steps (0: at the start and the end only)."""
    eval_batches: int = int_field(4, 1)
    """Micro-batches per rank in each evaluation."""
    log_every: int = int_field(10, 1, "steps")
    """Steps per printed line without a progress bar; the loss shown is their mean."""
    save_every: int = int_field(0, 0, "steps; 0: at the end only")
    """Save a checkpoint to OUT/checkpoints every this many steps (needs --out; 0: at the
    end only)."""
    seed: int = int_field(0, 0)
    """Seed of the initial values and of the data positions (batch i depends on seed and i)."""
    out: str | None = attrs.field(default=None, validator=_optional_str)
    """Directory for logs/rank{r}.jsonl and checkpoints/ (nothing is written without it)."""
    resume: bool = bool_field(False)
    """Continue from the latest checkpoint in OUT/checkpoints (needs --out)."""
    threads: int = int_field(0, 0, "0: CPU cores / local ranks")
    """torch threads per rank (0: the CPU cores divided by the local ranks)."""
    corpus_mb: float = float_field(16.0, "> 0", lambda v: v > 0)
    """Megabytes of text to read (from --data or the Python standard library)."""
    data: str | None = attrs.field(default=None, validator=_optional_str)
    """Train on this instead of the standard library's source: a text file or directory of
    text, or examples (needs model): .jsonl, .json, .parquet or .csv files, a directory of
    them, or a datasets.save_to_disk directory (see docs/sft.md)."""
    eval_data: str | None = attrs.field(default=None, validator=_optional_str)
    """Evaluate on the examples of this file or directory (records or a dataset, shaped as
    data): the token-mean loss over its learned tokens. Default: the last 5% of data's
    examples, or of its text."""
    data_format: str = _choice("data_format")
    """The shape of data's records: text ({"text"}), prompt ({"prompt", "completion"}),
    messages ({"messages": [{"role", "content"}, ...]}), or auto (from the first record)."""
    data_field: str | None = attrs.field(default=None, validator=_optional_str)
    """Other column names, as NAME=COLUMN,...: e.g. prompt=question,completion=answer or
    messages=conversations,role=from,content=value."""
    loss_on: str = _choice("loss_on")
    """Which tokens of an example are learned: assistant (every assistant turn, or the
    completion), completion (the last assistant turn, or the completion) or all."""
    pack: bool = bool_field(False)
    """Pack several examples into each row of seq_len tokens (position ids restart per
    example, no attention across examples); without it rows are padded to the longest
    example of the micro-batch."""
    bad_records: str = _choice("bad_records")
    """A record that cannot be an example (missing field, wrong type, empty conversation):
    fail (stop, naming its file and line or row) or skip (leave it out and count it)."""
    memory_per_rank: int = int_field(0, 0, "bytes; 0 = off")
    """Choose the memory options from this peak resident memory per rank (e.g. 6GiB; needs
    model): the planner predicts each configuration's peak and step time and the fastest
    that fits is trained (see docs/planning.md); options given on the command line or in
    a config file are kept as given. 0: train with the options as given."""
    device_memory: int = int_field(0, 0, "bytes; 0 = no limit")
    """With memory_per_rank on an accelerator: the device memory per rank the chosen
    configuration's device peak must fit in. 0: only the host peak is checked."""
    progress: bool | None = attrs.field(default=None, validator=_optional_bool)
    """Progress bar on rank 0 (default: only when stdout is a terminal)."""
    log_level: str = _choice("log_level")
    """Lowest level written to the JSON logs: debug, info, warning or error."""

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ConfigError(f"heads={self.heads} is invalid: must divide d_model={self.d_model}")
        if self.resume and self.out is None:
            raise ConfigError("resume=True is invalid: give out=DIR, where the checkpoints are")
        if self.export is not None and self.model is None:
            raise ConfigError(
                f"export={self.export} is invalid: only a transformers model (model=DIR) "
                "is exported; the built-in GPT's checkpoints are in out=DIR"
            )
        _check_adapters(self)
        if self.memory_per_rank and self.model is None:
            raise ConfigError(
                f"memory_per_rank={self.memory_per_rank} is invalid: the planner needs a "
                "transformers model (model=DIR) whose config.json it reads"
            )


def _check_adapters(opts: TrainOptions) -> None:
    """The rules between lora, peft_config, freeze, export_merged and model."""
    adapters = opts.lora is not None or opts.peft_config is not None
    if opts.lora is not None and opts.peft_config is not None:
        raise ConfigError(
            f"peft_config={opts.peft_config} is invalid: give lora=SPEC or peft_config=FILE, "
            "not both"
        )
    for name in ("lora", "peft_config", "freeze"):
        value = getattr(opts, name)
        if value is not None and opts.model is None:
            raise ConfigError(
                f"{name}={_shown(value)} is invalid: it applies to a transformers model (model=DIR)"
            )
    if opts.freeze is not None and adapters:
        raise ConfigError(
            f"freeze={_shown(opts.freeze)} is invalid with LoRA adapters, which already "
            "freeze every weight of the model: give freeze=PATTERN or lora=SPEC, not both"
        )
    if opts.export_merged and (opts.export is None or not adapters):
        raise ConfigError(
            "export_merged=True is invalid: it merges the adapters of lora=SPEC or "
            "peft_config=FILE into the model written to export=DIR; give both"
        )


def _shown(value: object) -> str:
    if isinstance(value, LoraSpec):
        return value.describe()
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


@attrs.frozen
class Option:
    """One option: its file key, its flag and how a value is read."""

    name: str  # key in --config files; flag is --name-with-dashes
    section: str  # "train", "zero3" or "optimizer"
    field: str  # the attrs field in its section
    kind: str  # "bool", "optional_bool", "int", "size", "float", "str", "choice", "betas", "json"
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The command-line flag, e.g. ``--cpu-memory-budget``."""
        return "--" + self.name.replace("_", "-")


# Byte counts accept suffixes (512MiB, 2GiB); which int fields hold bytes.
_SIZE_FIELDS = frozenset(
    {
        "cpu_memory_budget",
        "gpu_param_memory_budget",
        "prefetch_bucket_size",
        "memory_per_rank",
        "device_memory",
    }
)
_ALIASES = {
    "optimizer_weight_decay": ("--weight-decay",),
    "optimizer_betas": ("--betas",),
    "optimizer_eps": ("--eps",),
    "optimizer_momentum": ("--momentum",),
    "seq_len": ("--max-seq-len",),
}
# Config fields whose default in ``zero3-offload train`` is not the library's.
TRAIN_DEFAULTS: dict[str, Any] = {"skip_nonfinite_steps": True}
# Defaults the command resolves itself (see ``sources.resolve_device``).
_DEFAULT_TEXT = {"device": "cuda when available, else cpu", "threads": "0"}
_DTYPE_CHOICES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


def parse_size(text: str | int) -> int:
    """A byte count from ``text``: an integer, or a number with a unit such as ``2GiB``.

    Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024),
    and K/M/G/T (read as the binary units); case-insensitive.

    Raises:
        ValueError: for text that is not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)(b?)\s*", str(text).lower())
    if m is None:
        raise ConfigError(f"{text!r} is not a size: give bytes, or e.g. 512MiB, 2GiB, 1.5GB")
    number, unit, binary, b = m.groups()
    power = "kmgt".index(unit) + 1 if unit else 0
    base = (1000 if b and not binary else 1024) ** power  # "GB" is decimal, "G" and "GiB" binary
    return int(float(number) * base)


def _kind(field: attrs.Attribute[Any], default: Any) -> tuple[str, tuple[str, ...]]:
    type_text = str(field.type)
    if isinstance(default, bool):
        return "bool", ()
    if isinstance(default, enum.Enum):
        return "choice", tuple(member.value for member in type(default))
    if isinstance(default, torch.dtype):
        return "choice", _DTYPE_CHOICES
    if field.name == "options":
        return "json", ()
    if field.name in _CHOICES:
        return "choice", _CHOICES[field.name]
    if isinstance(default, tuple):
        return "betas", ()
    if default is None:
        return ("optional_bool" if "bool" in type_text else "str"), ()
    if isinstance(default, int):
        return ("size" if field.name in _SIZE_FIELDS else "int"), ()
    if isinstance(default, float):
        return "float", ()
    return "str", ()


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that divides it (``34359738368`` -> ``32GiB``)."""
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if nbytes and nbytes % 1024**power == 0:
            return f"{nbytes // 1024**power}{unit}"
    return str(nbytes)


def _default_text(name: str, default: Any) -> str:
    if name in _DEFAULT_TEXT:
        return _DEFAULT_TEXT[name]
    if name in _SIZE_FIELDS:
        return format_size(default)
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, torch.dtype):
        return str(default).removeprefix("torch.")
    return str(default)


def _options_of(cls: type, section: str, prefix: str = "") -> list[Option]:
    docs, out = field_docs(cls), []
    for field in attrs.fields(cls):
        if field.name == "optimizer":  # its fields become optimizer_* options
            continue
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        kind, choices = _kind(field, default)
        name = prefix + field.name
        default = TRAIN_DEFAULTS.get(name, default)
        note = "" if default is None else f" (default: {_default_text(name, default)})"
        out.append(
            Option(
                name=name,
                section=section,
                field=field.name,
                kind=kind,
                default=default,
                help=docs.get(field.name, "").replace("``", "") + note,
                choices=choices,
                aliases=_ALIASES.get(name, ()),
            )
        )
    return out


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        _options_of(TrainOptions, "train")
        + _options_of(Zero3CpuOffloadConfig, "zero3")
        + _options_of(OptimizerConfig, "optimizer", "optimizer_")
    )
}
"""Every option by name, training options first."""
