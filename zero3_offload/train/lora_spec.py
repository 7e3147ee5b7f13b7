"""``--lora``: the LoRA adapters ``zero3-offload train`` puts on a ``--model``.

The flag is a comma-separated list of ``key=value`` items::

    --lora r=16,alpha=32,dropout=0.05,target=q_proj,k_proj,v_proj,o_proj

An item without ``=`` continues the list of the key before it, so ``target`` takes
several module names (``target=all-linear`` is peft's every linear layer but the
output head). In a ``--config`` file the value is that string or a table with the
same keys (``target`` a list). :meth:`LoraSpec.to_peft` gives the ``peft.LoraConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from zero3_offload.errors import ConfigError

__all__ = ["LoraSpec"]

_KEYS = ("r", "alpha", "dropout", "target")


def _invalid(value: object, text: str) -> ConfigError:
    shown = value if isinstance(value, str) else dict(value)  # type: ignore[call-overload]
    return ConfigError(f"lora={shown!r} is invalid: {text}")


def _items(text: str) -> dict[str, Any]:
    """``text``'s ``key=value`` items; values of a key continued without ``=`` form a list."""
    out: dict[str, Any] = {}
    key = None
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise _invalid(text, "an empty item (two commas, or one at an end)")
        if "=" not in item:
            if key != "target":
                raise _invalid(
                    text, f"{item!r} is not key=value (only target=... takes several values)"
                )
            out[key].append(item)
            continue
        key, _, value = (s.strip() for s in item.partition("="))
        if key in out:
            raise _invalid(text, f"{key!r} given twice")
        out[key] = [value] if key == "target" else value
    return out


@attrs.frozen
class LoraSpec:
    """LoRA adapters: rank ``r``, scale ``alpha / r``, ``dropout`` on their input, and the
    ``target`` modules (names or suffixes of module paths; None: peft's default for the
    model's architecture)."""

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | LoraSpec) -> LoraSpec:
        """The spec of a ``--lora`` string or a ``--config`` table.

        Raises:
            ConfigError: ``lora=... is invalid: ...`` naming the bad key or value.
        """
        if isinstance(value, LoraSpec):
            return value
        if isinstance(value, str):
            raw: Mapping[str, Any] = _items(value)
        elif isinstance(value, Mapping):
            raw = value
        else:
            raise _invalid(str(value), "give key=value items, e.g. r=16,alpha=32,target=q_proj")
        unknown = [k for k in raw if k not in _KEYS]
        if unknown:
            raise _invalid(value, f"unknown key {unknown[0]!r}; the keys are {', '.join(_KEYS)}")
        return cls(
            r=_number(value, raw, "r", int, lambda v: v >= 1, "a whole number >= 1", 8),
            alpha=_number(value, raw, "alpha", float, lambda v: v > 0, "a number > 0", 8.0),
            dropout=_number(
                value, raw, "dropout", float, lambda v: 0 <= v < 1, "a number in [0, 1)", 0.0
            ),
            target=_target(value, raw.get("target")),
        )

    def to_peft(self) -> Any:
        """The ``peft.LoraConfig`` of a causal LM with these adapters.

        Raises:
            ConfigError: when peft is not installed.
        """
        try:
            from peft import LoraConfig
        except ImportError as exc:
            raise ConfigError("--lora needs peft: pip install 'zero3_offload[hf]'") from exc
        target = list(self.target) if self.target is not None else None
        if target == ["all-linear"]:
            target = "all-linear"
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=target,
            task_type="CAUSAL_LM",
        )

    def describe(self) -> str:
        """The spec as a ``--lora`` string."""
        alpha = int(self.alpha) if self.alpha == int(self.alpha) else self.alpha
        text = f"r={self.r},alpha={alpha},dropout={self.dropout:g}"
        return text + (f",target={','.join(self.target)}" if self.target else "")


def _number(
    value: object,
    raw: Mapping[str, Any],
    key: str,
    kind: type,
    ok: Any,
    text: str,
    default: float,
) -> Any:
    given = raw.get(key, default)
    try:
        if isinstance(given, bool):
            raise ValueError(given)
        number = kind(given)
        if kind is int and isinstance(given, float) and given != number:
            raise ValueError(given)
    except (TypeError, ValueError):
        raise _invalid(value, f"{key}={given!r}: must be {text}") from None
    if (kind is float and not math.isfinite(number)) or not ok(number):
        raise _invalid(value, f"{key}={given!r}: must be {text}")
    return number


def _target(value: object, given: Any) -> tuple[str, ...] | None:
    if given is None:
        return None
    names = [given] if isinstance(given, str) else given
    if not isinstance(names, (list, tuple)) or not all(
        isinstance(n, str) and n.strip() for n in names
    ):
        raise _invalid(value, f"target={given!r}: must be module names, e.g. target=q_proj,v_proj")
    return tuple(n.strip() for n in names)
