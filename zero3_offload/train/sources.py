"""Where each option's value comes from: defaults < config files < flags.

``--deepspeed-config`` is read first, then ``--config`` (so our own format wins
where both set a key), then the flags given on the command line. Every value
remembers its origin, and a bad value is reported naming that origin: the flag
(``--cpu-memory-budget=...``), or the file and key it was read from.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError
from zero3_offload.train.deepspeed import DeepSpeedError, from_deepspeed
from zero3_offload.train.options import OPTIONS, TRAIN_DEFAULTS, TrainOptions, parse_size

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport, if installed
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

__all__ = [
    "OptionError",
    "Resolved",
    "explain",
    "flagify",
    "in_torchrun",
    "load_config_file",
    "resolve",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class OptionError(ConfigError):
    """A bad option: the message is one line that names the flag or the file and key."""


@attrs.frozen
class Resolved:
    """The effective options of a run and what was said about them."""

    train: TrainOptions
    zero3: Zero3CpuOffloadConfig
    origins: dict[str, str]  # option name -> "--flag", "FILE" or "FILE: deepspeed.key"
    notes: list[str]  # lines for stderr (e.g. DeepSpeed keys that were not mapped)
    unsupported: list[str]  # DeepSpeed keys that were not mapped

    def to_dict(self) -> dict[str, Any]:
        """The effective options as a ``--config`` file (JSON-safe)."""
        return {"train": attrs.asdict(self.train), "zero3": self.zero3.to_dict()}


def in_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when torchrun (or an equivalent launcher) started this process."""
    env = os.environ if env is None else env
    return all(name in env for name in _TORCHRUN_VARS)


def _read(path: Path, what: str) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise OptionError(f"{what} {path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise OptionError(f"{what} {path}: not UTF-8 text") from None
    toml = path.suffix == ".toml"
    if toml and tomllib is None:
        raise OptionError(f"{what} {path}: reading TOML needs Python 3.11 or tomli; or use JSON")
    try:
        data = tomllib.loads(text) if toml else json.loads(text)
    except (ValueError, json.JSONDecodeError) as exc:  # TOMLDecodeError is a ValueError
        raise OptionError(f"{what} {path}: invalid {'TOML' if toml else 'JSON'}: {exc}") from None
    if not isinstance(data, Mapping):
        raise OptionError(f"{what} {path}: expected a table of options, got {type(data).__name__}")
    return data


def _check_name(name: str, where: str) -> None:
    if name not in OPTIONS:
        close = difflib.get_close_matches(name, list(OPTIONS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; see zero3-offload train --help"
        raise OptionError(f"{where}: unknown key {name!r}{hint}")


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a ``--config`` file (TOML for ``.toml``, else JSON) into option values.

    Keys are option names (dashes or underscores), at the top level or in the
    tables ``train``, ``zero3`` (the fields of ``Zero3CpuOffloadConfig``) and
    ``optimizer`` (also ``zero3.optimizer``) -- the layout ``--print-config`` writes.

    Raises:
        OptionError: for a missing or malformed file or an unknown key.
    """
    out: dict[str, Any] = {}

    def take(table: Mapping[str, Any], prefix: str, where: str) -> None:
        for key, value in table.items():
            name = str(key).replace("-", "_")
            if isinstance(value, Mapping) and prefix == "" and name in ("train", "zero3"):
                take(value, "", f"{where}: [{name}]")
            elif isinstance(value, Mapping) and prefix == "" and name == "optimizer":
                take(value, "optimizer_", f"{where}: [optimizer]")
            else:
                _check_name(prefix + name, where)
                out[prefix + name] = value

    take(_read(path, "--config"), "", str(path))
    return out


def _normalise(name: str, value: Any) -> Any:
    kind = OPTIONS[name].kind
    if kind == "size" and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            return value  # left to the config's validator, which names the field
    if kind == "betas" and isinstance(value, list):
        return tuple(value)
    return value


def flagify(message: str) -> str:
    """``message`` with the option names it mentions written as flags (``--cpu-memory-budget``)."""
    for option in OPTIONS.values():
        name = option.name
        message = re.sub(rf"(?<![\w-]){name}(?==)", option.flag, message)
        if "_" in name:  # distinctive enough to replace where no '=' follows
            message = re.sub(rf"(?<![\w-]){name}\b", option.flag, message)
    return message


def explain(exc: ConfigError, origins: Mapping[str, str]) -> str:
    """``exc``'s message naming the flag, or the file and key, that gave the value."""
    message = str(exc)
    if message.startswith("optimizer: "):
        message = re.sub(r"(?<![\w-])(\w+)(?==)", r"optimizer_\1", message[len("optimizer: ") :])
    m = re.match(r"(\w+)=", message)
    origin = origins.get(m.group(1), "") if m else ""
    if origin and not origin.startswith("--"):
        return f"{origin}: {message}"
    return flagify(message)


def resolve_device(values: dict[str, Any], origins: dict[str, str], env: Mapping[str, str]) -> None:
    """Pick the device when none was given: CUDA when present, one GPU per rank.

    Raises:
        OptionError: a CUDA device was asked for on a machine without CUDA.
    """
    if "device" in values:
        if str(values["device"]).startswith("cuda") and not torch.cuda.is_available():
            where = origins["device"]
            label = where if where.startswith("--") else f"{where}: device"
            raise OptionError(f"{label}={values['device']} is invalid: CUDA is not available here")
        return
    if not torch.cuda.is_available():
        return
    if in_torchrun(env):
        values["device"] = f"cuda:{env.get('LOCAL_RANK', '0')}"
    elif values.get("world_size", OPTIONS["world_size"].default) <= torch.cuda.device_count():
        values["device"] = "cuda"


def _check_sequence_parallel(
    train: TrainOptions, zero3: Zero3CpuOffloadConfig, origins: Mapping[str, str]
) -> None:
    """``sequence_parallel_size`` needs a transformers model and divides the ranks."""
    size = zero3.sequence_parallel_size
    problem = None
    if size > 1 and train.model is None:
        problem = "needs model=DIR: it splits the sequences of a transformers model"
    elif train.world_size % size:
        problem = f"must divide world_size={train.world_size}"
    if problem is not None:
        raise OptionError(
            explain(ConfigError(f"sequence_parallel_size={size} is invalid: {problem}"), origins)
        )


def resolve(
    flags: Mapping[str, Any],
    *,
    config: Path | None = None,
    deepspeed: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Resolved:
    """Merge defaults, ``deepspeed``, ``config`` and ``flags`` (later wins) and validate.

    Args:
        flags: option name -> value, only for the flags given explicitly.
        config: a ``--config`` file.
        deepspeed: a ``--deepspeed-config`` file.
        env: the environment (default ``os.environ``): torchrun's variables.

    Returns:
        The effective options.

    Raises:
        OptionError: one line naming the flag or the file and key at fault.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    from_config = load_config_file(config) if config else {}
    world = flags.get("world_size", from_config.get("world_size"))
    if in_torchrun(env):
        if world is not None and world != int(env["WORLD_SIZE"]):
            raise OptionError(
                f"--world-size={world} is invalid under torchrun, which started "
                f"WORLD_SIZE={env['WORLD_SIZE']} ranks: leave --world-size out"
            )
        world = int(env["WORLD_SIZE"])
    notes: list[str] = []
    unsupported: list[str] = []
    if deepspeed:
        ds_world = world if isinstance(world, int) and world > 0 else None
        try:
            mapped = from_deepspeed(
                _read(deepspeed, "--deepspeed-config"),
                world_size=ds_world or OPTIONS["world_size"].default,
            )
        except DeepSpeedError as exc:
            raise OptionError(f"{deepspeed}: {exc}") from None
        for name, (value, key) in mapped.values.items():
            values[name], origins[name] = value, f"{deepspeed}: {key}"
        notes += [f"{deepspeed}: {note}" for note in mapped.notes]
        unsupported = mapped.unsupported
    for name, value in from_config.items():
        values[name], origins[name] = value, str(config)
    for name, value in flags.items():
        values[name], origins[name] = value, OPTIONS[name].flag
    for name, value in TRAIN_DEFAULTS.items():
        values.setdefault(name, value)
    if world is not None:
        values["world_size"] = world
    values = {name: _normalise(name, value) for name, value in values.items()}
    resolve_device(values, origins, env)
    sections: dict[str, dict[str, Any]] = {"train": {}, "zero3": {}, "optimizer": {}}
    for name, value in values.items():
        sections[OPTIONS[name].section][OPTIONS[name].field] = value
    if sections["optimizer"]:
        sections["zero3"]["optimizer"] = sections["optimizer"]
    try:
        train = TrainOptions(**sections["train"])
        zero3 = Zero3CpuOffloadConfig.from_dict(sections["zero3"])
    except ConfigError as exc:
        raise OptionError(explain(exc, origins)) from None
    _check_sequence_parallel(train, zero3, origins)
    return Resolved(train=train, zero3=zero3, origins=origins, notes=notes, unsupported=unsupported)
