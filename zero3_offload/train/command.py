"""``zero3-offload train``: the flags, and the handler that resolves and launches.

Registered in ``zero3_offload.cli.build_parser`` by :func:`add_train`. Every
option of :data:`~zero3_offload.train.options.OPTIONS` becomes a flag whose
default is "not given", so the handler sees exactly the flags on the command
line and can let them override ``--config`` and ``--deepspeed-config``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from zero3_offload.errors import CommunicationError, UsageError
from zero3_offload.testing import RankFailedError
from zero3_offload.train.launch import launch
from zero3_offload.train.loop import TrainError
from zero3_offload.train.options import OPTIONS, Option, parse_size
from zero3_offload.train.sources import OptionError, Resolved, resolve

__all__ = ["add_option_flags", "add_train", "resolve_args"]

_DESCRIPTION = """\
Train a byte-level GPT with ZeRO-3 and CPU offloading. The default run needs no
download: it reads the Python standard library's own source as its text,
trains on 2 local ranks for 300 steps (about two minutes on 2 CPU cores) and
prints the evaluation loss before and after.

--model DIR fine-tunes a local transformers causal LM instead: its config.json,
its weights (model.safetensors or a sharded index; a config-only DIR starts
from a random init drawn with --seed), and its tokenizer (without one, bytes are
the tokens); --export OUT writes the result as a transformers directory.

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) each process
joins that job instead of starting ranks: NCCL when CUDA is present, one GPU
per local rank. Values come from the defaults, then --deepspeed-config, then
--config (TOML or JSON, keys as the flags below, or the layout that
--print-config writes), then the flags given, each overriding the one before.
"""
_EPILOG = """\
examples:
  zero3-offload train                                  # the default run
  zero3-offload train --world-size 2 --out run1 --save-every 50
  zero3-offload train --out run1 --resume --steps 600  # continue to step 600
  zero3-offload train --config run.toml --lr 1e-3      # flags override the file
  zero3-offload train --deepspeed-config ds_config.json --print-config
  zero3-offload train --model ./my-llama --data notes.txt --out run2 --export tuned
  zero3-offload train --model ./my-llama --data notes.txt --lora r=16,alpha=32 --export adapter
  torchrun --nproc-per-node 2 -m zero3_offload train --steps 3
  zero3-offload analyze run1/logs/*.jsonl              # per-layer timings
"""
_GROUPS = {
    "train": "training",
    "zero3": "ZeRO-3 configuration (the fields of Zero3CpuOffloadConfig)",
    "optimizer": "optimizer (the fields of OptimizerConfig; the learning rate is --lr)",
}
_METAVARS = {"int": "N", "size": "BYTES", "float": "X", "str": "VALUE", "json": "JSON"}
_PATH_METAVARS = {
    "out": "DIR",
    "data": "PATH",
    "eval_data": "PATH",
    "data_field": "NAME=COLUMN,...",
    "device": "DEVICE",
    "model": "DIR",
    "export": "DIR",
    "lora": "SPEC",
    "peft_config": "FILE",
    "freeze": "PATTERN",
}


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"alpha\": 0.9}'")
    return value


def _add_flag(group: Any, option: Option) -> None:
    names = [option.flag, *option.aliases]
    common: dict[str, Any] = {
        "dest": option.name,
        "default": argparse.SUPPRESS,
        "help": option.help.replace("%", "%%"),
    }
    if option.kind in ("bool", "optional_bool"):
        group.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
    elif option.kind == "choice":
        group.add_argument(*names, type=str.lower, choices=option.choices, **common)
    elif option.kind == "betas":
        group.add_argument(*names, type=float, nargs=2, metavar=("B1", "B2"), **common)
    else:
        convert = {"int": int, "size": _size, "float": float, "json": _json_object}.get(
            option.kind, str
        )
        metavar = _PATH_METAVARS.get(option.name, _METAVARS.get(option.kind, "VALUE"))
        group.add_argument(*names, type=convert, metavar=metavar, **common)


def add_train(commands: Any) -> None:
    """Register ``train`` on the ``zero3-offload`` subcommands ``commands``."""
    parser = commands.add_parser(
        "train",
        help="train a byte-level GPT, or fine-tune a transformers model, with ZeRO-3",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    files = parser.add_argument_group("configuration files")
    files.add_argument("--config", metavar="FILE", help="options from a TOML (.toml) or JSON file")
    files.add_argument(
        "--deepspeed-config",
        metavar="FILE",
        help="a DeepSpeed JSON config; its keys without a counterpart are listed on stderr",
    )
    files.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective options as a --config JSON file and exit",
    )
    add_option_flags(parser)
    parser.set_defaults(handler=_train)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every option of ``OPTIONS`` (default: not given), in its group."""
    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS.items()}
    for option in OPTIONS.values():
        _add_flag(groups[option.section], option)


def _speaks() -> bool:
    # Under torchrun every process runs this command; only rank 0 talks.
    return os.environ.get("RANK", "0") == "0"


def resolve_args(args: argparse.Namespace) -> Resolved:
    """The options of a parsed ``train`` or ``plan`` command line: its flags over its
    configuration files (``--config``, and ``--deepspeed-config`` where it has one).

    Raises:
        UsageError: for options that do not resolve (the message says which and why).
    """
    flags = {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}
    if "optimizer_betas" in flags:
        flags["optimizer_betas"] = tuple(flags["optimizer_betas"])
    deepspeed = getattr(args, "deepspeed_config", None)
    try:
        return resolve(
            flags,
            config=Path(args.config) if args.config else None,
            deepspeed=Path(deepspeed) if deepspeed else None,
        )
    except OptionError as exc:
        raise UsageError(str(exc)) from None


def _train(args: argparse.Namespace) -> int:
    resolved = resolve_args(args)
    if _speaks():
        for note in resolved.notes:
            print(note, file=sys.stderr)
        if resolved.unsupported:
            print(
                f"{args.deepspeed_config}: {len(resolved.unsupported)} unsupported key(s) "
                f"ignored: {', '.join(resolved.unsupported)}",
                file=sys.stderr,
            )
    if args.print_config:
        if _speaks():
            print(json.dumps(resolved.to_dict(), indent=2))
        return 0
    try:
        return launch(resolved)
    except (OptionError, TrainError) as exc:
        raise UsageError(str(exc)) from None
    except (RankFailedError, CommunicationError) as exc:  # a rank failed, stopped or diverged
        print(f"zero3-offload train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("zero3-offload train: interrupted (nothing saved)", file=sys.stderr)
        return 130
