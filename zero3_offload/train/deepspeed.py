"""Read a DeepSpeed JSON config as ``zero3-offload train`` options.

The keys with a counterpart here are mapped (table below); every other key is
listed as unsupported, with the reason where one is known, and ``"auto"`` values
(as in the configs written for the transformers integration) are ignored with a
note, so the option keeps its value; so are the ``fp16`` loss-scaling keys when
fp16 is not enabled. Values are not checked here: the options they become are
validated like any other, and errors name the DeepSpeed key.

=========================================================  ==================================
DeepSpeed                                                  zero3-offload
=========================================================  ==================================
zero_optimization.stage                                    must be 3
zero_optimization.offload_param.device (cpu/nvme/none)     offload_params, offload_param_device
zero_optimization.offload_optimizer.device (cpu/nvme/none) offload_optimizer_states,
                                                           offload_grads, offload_optimizer_device
zero_optimization.offload_{param,optimizer}.nvme_path      nvme_path (one directory for both)
zero_optimization.offload_{param,optimizer}.pin_memory     pin_cpu_memory
zero_optimization.stage3_prefetch_bucket_size (elements)   prefetch_bucket_size (bytes)
zero_optimization.stage3_max_live_parameters (elements)    gpu_param_memory_budget (bytes)
zero_optimization.stage3_param_persistence_threshold       param_persistence_threshold
zero_optimization.zero_quantized_weights (qwZ)             gather_compression int8
zero_optimization.zero_quantized_gradients (qgZ)           reduce_dtype bf16 (approximate)
fp16.enabled / bf16.enabled                                compute_dtype float16 / bfloat16
gradient_clipping, gradient_accumulation_steps             the options of the same name
optimizer.type (Adam, AdamW, SGD) and optimizer.params     optimizer_*, lr
train_micro_batch_size_per_gpu, train_batch_size           batch_size (per rank)
steps_per_print                                            log_every
=========================================================  ==================================

DeepSpeed's ``Adam`` is AdamW unless ``adam_w_mode`` is false, and its
offloaded optimizer keeps gradients on the CPU too; both are followed here.
ZeRO++'s quantized weights (qwZ, int8 blocks) are ``gather_compression``
int8 exactly in kind; its quantized gradients (qgZ: int4/int8 all-to-all) have
no exact counterpart and are read, with a note, as the nearest lossy reduce
here, a bf16 reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from zero3_offload.errors import ConfigError

__all__ = ["DeepSpeedError", "DeepSpeedMapping", "from_deepspeed"]

_Z = "zero_optimization."
_SAME = {
    "gradient_clipping": "gradient_clipping",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "batch_size",
    "steps_per_print": "log_every",
    _Z + "stage3_param_persistence_threshold": "param_persistence_threshold",
    _Z + "offload_param.pin_memory": "pin_cpu_memory",
    _Z + "offload_optimizer.pin_memory": "pin_cpu_memory",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "optimizer_betas",
    "optimizer.params.eps": "optimizer_eps",
    "optimizer.params.weight_decay": "optimizer_weight_decay",
    "optimizer.params.momentum": "optimizer_momentum",
    "optimizer.params.dampening": "optimizer_dampening",
    "optimizer.params.nesterov": "optimizer_nesterov",
    "optimizer.params.amsgrad": "optimizer_amsgrad",
}
# Keys whose value equals our fixed behaviour when it has this value.
_FIXED = {
    "fp16.loss_scale": (0, "dynamic loss scaling only (loss_scale 0)"),
    "fp16.initial_scale_power": (16, "the initial loss scale is fixed at 2^16"),
    "fp16.loss_scale_window": (2000, "the scale grows after 2000 good steps, fixed"),
    "optimizer.params.bias_correction": (True, "Adam always uses bias correction"),
    "optimizer.params.torch_adam": (None, ""),  # any value: the kernel is picked here
}
_REASONS = {
    "overlap_comm": "collectives always overlap compute here",
    "contiguous_gradients": "gradients are always one flat buffer per layer here",
    "reduce_bucket_size": "gradients are reduce-scattered per layer",
    "reduce_scatter": "gradients are always reduce-scattered",
    "allgather_bucket_size": "parameters are all-gathered per layer",
    "allgather_partitions": "parameters are all-gathered per layer",
    "sub_group_size": "the optimizer steps one layer shard at a time",
    "stage3_max_reuse_distance": "prefetch follows the recorded execution order",
    "stage3_gather_16bit_weights_on_model_save": (
        "--export DIR writes the model at the end (fp32); or zero3-offload export / consolidate"
    ),
    "scheduler": "the schedule is --lr, --warmup-steps and cosine decay",
}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


class DeepSpeedError(ConfigError):
    """A DeepSpeed setting that cannot be honoured (e.g. a ZeRO stage other than 3)."""


@attrs.define
class DeepSpeedMapping:
    """The options a DeepSpeed config becomes, and what was not mapped."""

    values: dict[str, tuple[Any, str]] = attrs.Factory(dict)  # option -> (value, DeepSpeed key)
    notes: list[str] = attrs.Factory(list)  # one line each, for stderr
    unsupported: list[str] = attrs.Factory(list)  # DeepSpeed keys not mapped

    def set(self, option: str, value: Any, key: str) -> None:
        self.values[option] = (value, key)

    def skip(self, key: str, value: Any, reason: str) -> None:
        self.unsupported.append(key)
        self.notes.append(f"unsupported key {key}={_show(value)} ignored: {reason}")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value).lower()


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


def _dtype(data: Mapping[str, Any]) -> str:
    fp16 = _table(data, "fp16").get("enabled", False) is True
    bf16 = (_table(data, "bf16") or _table(data, "bfloat16")).get("enabled", False) is True
    if fp16 and bf16:
        raise DeepSpeedError("fp16.enabled and bf16.enabled are both true: enable one")
    return "float16" if fp16 else "bfloat16" if bf16 else "float32"


def _optimizer(kind: Any, params: Mapping[str, Any], out: DeepSpeedMapping) -> None:
    name = str(kind).lower()
    if name not in ("adam", "adamw", "sgd"):
        raise DeepSpeedError(f"optimizer.type={kind!r} is not supported: use Adam, AdamW or SGD")
    if name == "adam":
        name = "adamw" if params.get("adam_w_mode", True) else "adam"
        out.notes.append(f"optimizer.type='Adam' read as {name} (DeepSpeed's adam_w_mode)")
    out.set("optimizer_kind", name, "optimizer.type")


def _batch(data: Mapping[str, Any], world_size: int, out: DeepSpeedMapping) -> None:
    total = data["train_batch_size"]
    micro = data.get("train_micro_batch_size_per_gpu")
    micro = None if micro == "auto" else micro
    accum = data.get("gradient_accumulation_steps", 1)
    accum = 1 if accum == "auto" else accum
    if not all(isinstance(v, int) and v > 0 for v in (total, accum, micro or 1)):
        return  # the mapped options report their own bad values
    if micro is not None:
        if total != micro * accum * world_size:
            raise DeepSpeedError(
                f"train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={accum} x {world_size} ranks"
            )
        return
    if total % (accum * world_size):
        raise DeepSpeedError(
            f"train_batch_size={total} does not divide into gradient_accumulation_steps="
            f"{accum} x {world_size} ranks"
        )
    out.set("batch_size", total // (accum * world_size), "train_batch_size")


def _zero_stage(data: Mapping[str, Any]) -> None:
    stage = _table(data, "zero_optimization").get("stage")
    if stage != 3:
        raise DeepSpeedError(
            f"zero_optimization.stage={_show(stage)} is not supported: zero3-offload runs "
            "ZeRO stage 3 only; set it to 3"
        )


def _offload(key: str, value: Any, out: DeepSpeedMapping) -> bool:
    device = str(value).lower()
    if device not in ("cpu", "nvme", "none"):
        raise DeepSpeedError(f"{key}={_show(value)} is invalid: must be cpu, nvme or none")
    on = device != "none"
    tier = "nvme" if device == "nvme" else "cpu"
    if key.endswith("offload_param.device"):
        out.set("offload_params", on, key)
        out.set("offload_param_device", tier, key)
    else:
        out.set("offload_optimizer_states", on, key)
        out.set("offload_grads", on, key)
        out.set("offload_optimizer_device", tier, key)
    return True


def _nvme_path(key: str, value: Any, out: DeepSpeedMapping) -> bool:
    earlier = out.values.get("nvme_path")
    if earlier is not None and earlier[0] != value:
        raise DeepSpeedError(
            f"{key}={_show(value)} differs from {earlier[1]}={_show(earlier[0])}: both disk "
            "tiers live under one nvme_path here; give them the same directory"
        )
    out.set("nvme_path", value, key)
    return True


def _elements(key: str, value: Any, dtype: str, out: DeepSpeedMapping) -> bool:
    option = "prefetch_bucket_size" if "prefetch" in key else "gpu_param_memory_budget"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        nbytes = int(value) * _DTYPE_BYTES[dtype]
        out.set(option, nbytes, key)
        out.notes.append(f"{key}={int(value)} elements read as {option}={nbytes} bytes ({dtype})")
    else:
        out.set(option, value, key)
    return True


def _quantized(key: str, value: Any, out: DeepSpeedMapping) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedError(f"{key}={_show(value)} is invalid: must be true or false")
    if key.endswith("zero_quantized_weights"):
        out.set("gather_compression", "int8" if value else "none", key)
        return True
    out.set("reduce_dtype", "bf16" if value else "fp32", key)
    if value:
        out.notes.append(
            f"{key}=true read as reduce_dtype='bf16' (approximate: DeepSpeed's qgZ "
            "quantizes gradients to int8/int4 for an all-to-all; here they are "
            "reduce-scattered in bf16, half of fp32's bytes)"
        )
    return True


def _map_leaf(key: str, value: Any, dtype: str, out: DeepSpeedMapping) -> bool:
    """Map one key; False when it has no counterpart."""
    if key in _SAME:
        out.set(_SAME[key], value, key)
    elif key.endswith(("offload_param.device", "offload_optimizer.device")):
        return _offload(key, value, out)
    elif key.endswith(("offload_param.nvme_path", "offload_optimizer.nvme_path")):
        return _nvme_path(key, value, out)
    elif key in (_Z + "stage3_prefetch_bucket_size", _Z + "stage3_max_live_parameters"):
        return _elements(key, value, dtype, out)
    elif key in (_Z + "zero_quantized_weights", _Z + "zero_quantized_gradients"):
        return _quantized(key, value, out)
    elif key in _FIXED:
        expected, reason = _FIXED[key]
        if expected is not None and value != expected:
            out.skip(key, value, reason)
    elif key in ("fp16.enabled", "bf16.enabled", "bfloat16.enabled"):
        if value is True:
            out.set("compute_dtype", dtype, key)
    else:
        return key in (
            _Z + "stage",
            "optimizer.type",
            "optimizer.params.adam_w_mode",
            "train_batch_size",
        )
    return True


def from_deepspeed(data: Mapping[str, Any], *, world_size: int) -> DeepSpeedMapping:
    """Map a parsed DeepSpeed config to option values.

    Args:
        data: the parsed JSON.
        world_size: ranks of the run, to split ``train_batch_size``.

    Returns:
        Option values with the DeepSpeed key each came from, notes for the
        user, and the keys that were not mapped.

    Raises:
        DeepSpeedError: for a ZeRO stage other than 3, an optimizer other than
            Adam/AdamW/SGD, fp16 and bf16 both enabled, batch sizes that do not
            agree, or a ``zero_quantized_*`` value that is not a bool.
    """
    _zero_stage(data)
    dtype = _dtype(data)
    out = DeepSpeedMapping()
    optimizer = _table(data, "optimizer")
    if "type" in optimizer and optimizer["type"] != "auto":
        _optimizer(optimizer["type"], _table(optimizer, "params"), out)
    if data.get("train_batch_size", "auto") != "auto":
        _batch(data, world_size, out)
    for key, value in _leaves(data):
        if value == "auto":
            out.notes.append(f"{key}='auto' ignored: the option keeps its default")
        elif key.startswith("fp16.") and key != "fp16.enabled" and dtype != "float16":
            out.notes.append(f"{key}={_show(value)} ignored: fp16 is not enabled")
        elif not _map_leaf(key, value, dtype, out):
            reason = _REASONS.get(key.rsplit(".", 1)[-1]) or _REASONS.get(key.split(".", 1)[0])
            out.skip(key, value, reason or "no counterpart in zero3-offload")
    return out
