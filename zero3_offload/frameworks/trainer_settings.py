"""What a transformers ``Trainer``'s arguments become for the manager, and what they ask for
that :class:`~zero3_offload.frameworks.trainer_mixin.Zero3TrainerMixin` cannot honour.

``TrainingArguments`` decide the accumulation (``gradient_accumulation_steps``), the
clipping (``max_grad_norm``), the optimizer (``optim``: ``adamw_torch``,
``adamw_torch_fused`` or ``sgd``, with ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``
and ``weight_decay``, split as Trainer splits it) and the compute dtype (``bf16``,
``fp16``); the device is ``args.device``'s. The ``zero3_config`` decides the rest
(offload, budgets, prefetch, checkpointing ...). A ``zero3_config`` field set to a
value other than its default that the arguments decide differently is refused, naming
both; so is every argument listed in :func:`refusals`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload.config import OptimizerConfig, Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError
from zero3_offload.logging import get_logger

__all__ = ["config_from_deepspeed", "refusals", "trainer_config"]

log = get_logger(__name__)

_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}


def config_from_deepspeed(
    path: str | os.PathLike[str], *, world_size: int = 1
) -> Zero3CpuOffloadConfig:
    """The config a DeepSpeed JSON maps to, as ``zero3-offload train --deepspeed-config``
    maps it (``train.deepspeed``): its notes (keys not mapped, ``"auto"`` values) are
    logged; its training keys (batch size, learning rate, ``steps_per_print``) are left
    to the framework's arguments.

    Raises:
        ConfigError: for an unreadable file or a setting that cannot be honoured (a ZeRO
            stage other than 3 ...), naming the DeepSpeed key.
    """
    from zero3_offload.train.sources import resolve  # the CLI's option table: imported here

    env = {"RANK": "0", "WORLD_SIZE": str(world_size), "MASTER_ADDR": "-", "MASTER_PORT": "0"}
    resolved = resolve({}, deepspeed=Path(path), env=env)
    for note in resolved.notes:
        log.info("deepspeed_config_note", note=note)
    return resolved.zero3


def _as_config(given: Any, world_size: int) -> Zero3CpuOffloadConfig:
    if given is None:
        return Zero3CpuOffloadConfig()
    if isinstance(given, Zero3CpuOffloadConfig):
        return given
    if isinstance(given, dict):
        return Zero3CpuOffloadConfig.from_dict(given)
    if isinstance(given, (str, os.PathLike)):
        return config_from_deepspeed(given, world_size=world_size)
    raise ConfigError(
        "zero3_config must be a Zero3CpuOffloadConfig, a dict of its fields, or the path of a "
        f"DeepSpeed JSON config; got {type(given).__name__}"
    )


def _decided(config: Zero3CpuOffloadConfig, field: str, value: Any, argument: str) -> None:
    """Refuse a ``zero3_config`` field the arguments decide otherwise."""
    default = attrs.fields_dict(Zero3CpuOffloadConfig)[field].default
    ours = getattr(config, field)
    if ours != default and ours != value:
        raise ConfigError(
            f"zero3_config.{field}={ours!r} but the TrainingArguments say {argument}: the "
            "arguments decide it; set it there (or leave the field at its default)"
        )


def trainer_config(args: Any, given: Any) -> Zero3CpuOffloadConfig:
    """The manager's config for ``args`` (a ``TrainingArguments``) over ``given``.

    Raises:
        ConfigError: for a field the arguments decide otherwise, an optimizer that is not
            AdamW or SGD, or an invalid ``given``.
    """
    config = _as_config(given, int(getattr(args, "world_size", 1)))
    accumulation, clip = int(args.gradient_accumulation_steps), float(args.max_grad_norm or 0.0)
    _decided(
        config,
        "gradient_accumulation_steps",
        accumulation,
        f"gradient_accumulation_steps={accumulation}",
    )
    _decided(config, "gradient_clipping", clip, f"max_grad_norm={args.max_grad_norm}")
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    _decided(config, "compute_dtype", dtype, f"bf16={args.bf16}, fp16={args.fp16}")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _OPTIMIZERS:
        raise ConfigError(
            f"TrainingArguments(optim={optim!r}) is not honoured: zero3_offload updates its "
            f"shards with {', '.join(sorted(_OPTIMIZERS))} (optim=...)"
        )
    if args.optim_args:
        raise ConfigError(
            f"TrainingArguments(optim_args={args.optim_args!r}) is not honoured: set the "
            "optimizer's options in zero3_config.optimizer"
        )
    kind = _OPTIMIZERS[optim]
    if kind == "adamw":
        optimizer = OptimizerConfig(
            kind="adamw",
            betas=(float(args.adam_beta1), float(args.adam_beta2)),
            eps=float(args.adam_epsilon),
            weight_decay=float(args.weight_decay),
        )
    else:
        optimizer = OptimizerConfig(kind="sgd", weight_decay=float(args.weight_decay))
    device = torch.device(args.device)
    return attrs.evolve(
        config,
        gradient_accumulation_steps=accumulation,
        gradient_clipping=clip,
        compute_dtype=dtype,
        optimizer=optimizer,
        device=str(device) if device.type != "cpu" else "cpu",
    )


def refusals(trainer: Any) -> list[str]:
    """What ``trainer``'s setup asks for that the manager cannot honour, one line each
    (empty: nothing)."""
    args, out = trainer.args, []

    def refuse(what: str, why: str) -> None:
        out.append(f"{what} is not honoured: {why}")

    if args.deepspeed:
        refuse(
            "TrainingArguments(deepspeed=...)",
            "zero3_offload replaces DeepSpeed; pass the "
            "DeepSpeed JSON as zero3_config=PATH instead",
        )
    if args.fsdp:
        refuse("TrainingArguments(fsdp=...)", "zero3_offload shards the model itself")
    if args.torch_compile:
        refuse("TrainingArguments(torch_compile=True)", "the manager runs the model's own code")
    if getattr(args, "use_liger_kernel", False):
        refuse("TrainingArguments(use_liger_kernel=True)", "it patches the model's modules")
    if getattr(args, "neftune_noise_alpha", None) is not None:
        refuse("TrainingArguments(neftune_noise_alpha=...)", "it hooks the embedding's output")
    if args.load_best_model_at_end:
        refuse(
            "TrainingArguments(load_best_model_at_end=True)",
            "load the best checkpoint's zero3 directory with resume_from_checkpoint",
        )
    if getattr(args, "fp16_full_eval", False) or getattr(args, "bf16_full_eval", False):
        refuse("TrainingArguments(fp16_full_eval/bf16_full_eval)", "use bf16=True or fp16=True")
    if args.n_gpu > 1:
        refuse("several GPUs in one process (DataParallel)", "launch one rank per GPU (torchrun)")
    if trainer.model_init is not None:
        refuse("Trainer(model_init=...)", "build the model once and pass it as model=")
    if trainer.optimizer is not None:
        refuse(
            "Trainer(optimizers=(optimizer, ...))",
            "the manager updates its shards itself: choose the optimizer with optim=",
        )
    if trainer.lr_scheduler is not None:
        refuse(
            "Trainer(optimizers=(..., lr_scheduler))",
            "choose the schedule with lr_scheduler_type= (it drives the manager's rate)",
        )
    if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        refuse("Trainer(optimizer_cls_and_kwargs=...)", "choose the optimizer with optim=")
    return out
