"""Private field validators and converters shared by the configuration classes.

Every failure raises :class:`~zero3_offload.errors.ConfigError` whose message names
the field, the value given and what is allowed. Converters never raise: they
normalise what they recognise and leave the rest to the validators.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from zero3_offload.errors import ConfigError

_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _fail(name: str, value: object, rule: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: {rule}")


def _as_float(value: object) -> object:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _rule(text: str, ok: Callable[[Any], bool]) -> _Validator:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not ok(value):
            _fail(attribute.name, value, text)

    return check


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_rule(minimum: int, unit: str = "") -> _Validator:
    text = f"must be an integer >= {minimum}" + (f" ({unit})" if unit else "")
    return _rule(text, lambda v: _is_int(v) and v >= minimum)


_check_bool = _rule("must be a bool (True or False)", lambda v: isinstance(v, bool))


def _bool_field(default: bool) -> Any:
    return attrs.field(default=default, validator=_check_bool)


def _int_field(default: int, minimum: int, unit: str = "") -> Any:
    return attrs.field(default=default, validator=_int_rule(minimum, unit))


def _float_field(default: float, text: str, ok: Callable[[float], bool]) -> Any:
    def valid(value: object) -> bool:
        return isinstance(value, float) and math.isfinite(value) and ok(value)

    rule = _rule(f"must be a finite number {text}", valid)
    return attrs.field(default=default, converter=_as_float, validator=rule)


def _non_negative(default: float) -> Any:
    return _float_field(default, ">= 0", lambda v: v >= 0)


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


_check_dtype = _rule(
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


_check_device = _rule(
    "must be 'cpu', 'cuda' or 'cuda:N' (a str or torch.device)",
    lambda v: isinstance(v, str) and re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
)
