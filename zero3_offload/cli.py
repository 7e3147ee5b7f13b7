"""The ``zero3-offload`` command (also ``python -m zero3_offload``).

Each subcommand is added by one ``_add_<command>`` function that registers its
arguments and its handler (``handler(args) -> exit status``). User errors (a
missing file, a bad flag) print one line to stderr and exit with status 2.
This is an application: it prints (with rich) and may configure logging.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from rich.console import Console

from zero3_offload.errors import UsageError

T = TypeVar("T")

__all__ = ["build_parser", "main"]

PROG = "zero3-offload"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the usage too; one line is easier to read in a log.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # A terminal's width is respected; piped output (a file, a test, CI) keeps
    # the tables whole instead of wrapping them at rich's default of 80 columns.
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, highlight=False, soft_wrap=stderr)


# ----------------------------------------------------------------- analyze

_ANALYZE_DESCRIPTION = """\
Summarise the logs that zero3_offload.logging.configure(json_path=...) wrote
on each rank: a per-layer table per rank and over all ranks, and a step
summary; optionally a Chrome/Perfetto trace and a timeline plot. Lines that
are not valid records are reported as FILE:LINE: reason on stderr and skipped.

Tables show milliseconds, MiB, GB/s and percentages; --json gives seconds
(keys ending _s), bytes (_bytes), bytes/s (_bytes_per_s) and fractions (0-1).
"""


def _add_analyze(commands: Any) -> None:
    from zero3_offload.analyze import report

    parser = commands.add_parser(
        "analyze",
        help="per-layer and per-step figures, trace and plot from JSON-lines logs",
        description=_ANALYZE_DESCRIPTION,
        epilog=(report.__doc__ or "").replace("``", "").replace("*", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines log files (any ranks)")
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON (stable keys) instead"
    )
    parser.add_argument(
        "--trace", metavar="OUT.json", help="write a Chrome trace-event file (Perfetto)"
    )
    parser.add_argument(
        "--plot", metavar="OUT.png", help="write a PNG timeline and memory plot (needs matplotlib)"
    )
    parser.add_argument(
        "--plot-steps",
        type=int,
        default=2,
        metavar="N",
        help="steps drawn per rank by --plot: the last N (default 2)",
    )
    parser.set_defaults(handler=_analyze)


def _repeated_steps(steps: Sequence[Any]) -> list[int]:
    seen = Counter((s.rank, s.step) for s in steps)
    return sorted({rank for (rank, _), n in seen.items() if n > 1})


def _analyze(args: argparse.Namespace) -> int:
    from zero3_offload.analyze import (
        PlotUnavailableError,
        build_report,
        plot_run,
        read_logs,
        report_tables,
        report_to_json,
        write_trace,
    )
    from zero3_offload.analyze.plot import require_matplotlib

    if args.plot_steps < 1:
        raise UsageError(f"--plot-steps={args.plot_steps} is invalid: give 1 or more")
    for path in args.logs:
        if not Path(path).is_file():
            raise UsageError(f"{path}: no such log file")
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailableError as exc:
            raise UsageError(str(exc)) from None
    out, err = _console(), _console(stderr=True)
    try:
        log = read_logs(args.logs)
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None
    for skipped in log.skipped:
        err.print(str(skipped), markup=False)
    if not log.work and not log.steps:
        raise UsageError(
            f"no work or step event in {', '.join(args.logs)}: configure logging in each rank "
            "with zero3_offload.logging.configure(json_path=..., level='info')"
        )
    for rank in _repeated_steps(log.steps):
        err.print(
            f"warning: rank {rank} logs the same step more than once; the files may hold "
            "several runs (configure appends), and the figures cover all of them",
            markup=False,
        )
    report = build_report(log)
    written = []
    try:
        if args.trace:
            write_trace(log, args.trace)
            written.append(f"trace: {args.trace}")
        if args.plot:
            drawn = plot_run(log, args.plot, steps=args.plot_steps)
            written.append(f"plot: {args.plot} (steps {', '.join(map(str, drawn))})")
    except OSError as exc:
        raise UsageError(f"cannot write {exc.filename}: {exc.strerror}") from None
    except (ValueError, PlotUnavailableError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        out.out(json.dumps(report_to_json(report), indent=2), highlight=False)
    else:
        for table in report_tables(report):
            out.print(table)
        others = ", ".join(f"{k} x{n}" for k, n in report.other_events.items()) or "none"
        out.print(
            f"{len(log.work)} work and {len(log.steps)} step events from {len(log.files)} "
            f"file(s), ranks {', '.join(map(str, log.ranks))}; {report.skipped_lines} "
            f"line(s) skipped; other events: {others}",
            markup=False,
            soft_wrap=True,
        )
    for line in written:
        err.print(f"wrote {line}", markup=False)
    return 0


# ----------------------------------------------------------------- consolidate


def _add_consolidate(commands: Any) -> None:
    parser = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint's full fp32 parameters to one file",
        description=(
            "Assemble every parameter of a sharded checkpoint (a checkpoint directory, or a "
            "root whose `latest` names one) and write a state dict that "
            "model.load_state_dict(..., strict=True) accepts. safetensors output is "
            "streamed parameter by parameter (peak memory near the largest tensor); "
            "--format pt holds the whole model in memory."
        ),
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or root")
    parser.add_argument("out", metavar="OUT", help="output file")
    parser.add_argument(
        "--format", choices=("safetensors", "pt"), default=None, help="default: from OUT's suffix"
    )
    parser.set_defaults(handler=_consolidate)


def _with_progress(label: str, work: Callable[[Callable[[int, int], None]], T]) -> T:
    """``work(advance)`` under a transient progress bar on stderr; library errors of the
    checkpoint or the config become one-line usage errors."""
    from rich.progress import Progress

    from zero3_offload.errors import CheckpointError, ConfigError

    with Progress(console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task(label, total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        try:
            return work(advance)
        except (CheckpointError, ConfigError) as exc:
            raise UsageError(str(exc)) from exc


def _consolidate(args: argparse.Namespace) -> int:
    from zero3_offload.checkpoint.consolidate import consolidate_checkpoint

    fmt = args.format or ("pt" if Path(args.out).suffix in (".pt", ".pth") else "safetensors")
    out = _with_progress(
        "consolidating",
        lambda advance: consolidate_checkpoint(
            args.checkpoint, args.out, fmt=fmt, progress=advance
        ),
    )
    size = out.stat().st_size
    _console().print(f"wrote {out} ({size} bytes, {fmt})", markup=False)
    return 0


# ----------------------------------------------------------------- export


def _add_export(commands: Any) -> None:
    parser = commands.add_parser(
        "export",
        help="write a checkpoint as a transformers model directory",
        description=(
            "Write the parameters of a checkpoint saved in module mode from a transformers "
            "model as a directory that AutoModelForCausalLM.from_pretrained(OUT) loads: "
            "config.json and safetensors weights (sharded when large), streamed parameter by "
            "parameter. A checkpoint of a peft model is written as its adapter directory "
            "(what PeftModel.from_pretrained loads), or with --merged as the base model with "
            "the LoRA adapters merged. Needs transformers (pip install 'zero3_offload[hf]')."
        ),
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or root")
    parser.add_argument("out", metavar="OUT", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--config",
        metavar="DIR",
        default=None,
        help="directory of the model's config.json, for checkpoints that do not record it",
    )
    parser.add_argument(
        "--max-shard-mib",
        type=int,
        default=5 * 1024,
        metavar="MIB",
        help="largest weight file in MiB (default: 5120)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the stored weights (default: float32)",
    )
    parser.add_argument(
        "--merged",
        action="store_true",
        help="for a checkpoint of a peft (LoRA) model: write the base model with the adapters "
        "merged into its weights, instead of the adapter directory",
    )
    parser.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    import torch

    from zero3_offload.integrations.checkpoint_export import export_checkpoint

    if args.max_shard_mib <= 0:
        raise UsageError(f"--max-shard-mib must be > 0, got {args.max_shard_mib}")
    files = _with_progress(
        "exporting",
        lambda advance: export_checkpoint(
            args.checkpoint,
            args.out,
            config_dir=args.config,
            max_shard_bytes=args.max_shard_mib * 2**20,
            dtype=getattr(torch, args.dtype),
            progress=advance,
            merged=args.merged,
        ),
    )
    size = sum(f.stat().st_size for f in files)
    _console().print(f"wrote {args.out} ({len(files)} files, {size} bytes)", markup=False)
    return 0


# ----------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = _Parser(prog=PROG, description="ZeRO-3 with CPU offloading: tools.")
    from zero3_offload.plan.command import add_plan
    from zero3_offload.train.command import add_train

    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_analyze(commands)
    _add_consolidate(commands)
    _add_export(commands)
    add_plan(commands)
    add_train(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 for a usage error (reported on stderr
        in one line).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad argument (2, already reported)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "train":  # --memory-per-rank: the planner chooses the options
            from zero3_offload.plan.command import choose_for_train

            choose_for_train(args)
        return int(args.handler(args))
    except UsageError as exc:
        _console(stderr=True).print(f"{PROG} {args.command}: error: {exc}", markup=False)
        return 2
