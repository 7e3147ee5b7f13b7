"""``zero3-offload plan``: the flags, the handler and the tables it prints.

Registered in ``zero3_offload.cli.build_parser`` by :func:`add_plan`. It takes every
flag ``train`` takes (the run to plan: ``--model``, ``--world-size``, ``--batch-size``,
``--seq-len``, ``--lora``, any configuration field, ``--config``), and prints the plan
as tables, or with ``--json`` as one object. ``--memory-per-rank SIZE`` searches the
configuration instead and prints the choice as a ``train --config`` file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from zero3_offload.errors import ConfigError, UsageError
from zero3_offload.plan.budget_search import BudgetChoice, NothingFitsError, choose_config
from zero3_offload.plan.calibrate import load_or_measure
from zero3_offload.plan.calibration import Calibration, cache_path
from zero3_offload.plan.planner import local_ranks, plan_run
from zero3_offload.plan.run_plan import RunPlan
from zero3_offload.train.command import add_option_flags, resolve_args
from zero3_offload.train.options import OPTIONS
from zero3_offload.train.sources import Resolved

__all__ = ["add_plan", "choose_for_train", "fixed_options"]

_DESCRIPTION = """\
Predict a run of `zero3-offload train --model DIR` before starting it: per rank, the
peak of host memory (whole-process RSS over loading the model and training) and of
device memory, the disk bytes, where in a step each peak falls, what holds it, and the
step time. Only the model's config.json is read: the model is built on the meta
device, its shards counted with the engine's own functions, and one decoder layer is
run for real at a few short lengths to measure what it saves for backward.

Step times and the runtime's memory come from this machine's figures, measured once
by --calibrate (about a minute) and cached; a plan without them measures them first.

--memory-per-rank SIZE chooses the configuration instead: the fastest planned one
whose peak leaves 5% of SIZE free, printed as a file that `train --config` takes, with
the runners-up and why they lost. See docs/planning.md.
"""
_EPILOG = """\
examples:
  zero3-offload plan --calibrate
  zero3-offload plan --model ./my-llama --world-size 2 --batch-size 1 --seq-len 2048
  zero3-offload plan --model ./my-llama --lora r=16 --seq-len 4096 --json
  zero3-offload plan --model ./my-llama --lora r=16 --memory-per-rank 6GiB > run.json
  zero3-offload train --config run.json --model ./my-llama --lora r=16 --data notes.txt
"""


def add_plan(commands: Any) -> None:
    """Register ``plan`` on the ``zero3-offload`` subcommands ``commands``."""
    parser = commands.add_parser(
        "plan",
        help="predict a training run's peak memory, disk and step time; choose a config",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    own = parser.add_argument_group("plan")
    own.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    own.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's figures again (matmul and decoder-layer FLOP/s, "
        "frozen-weight decode rates, copy and fresh-memory rates, collective and disk "
        "bandwidth, the runtime's memory and a training step's time per unit) and cache "
        "them; with no --model, only that",
    )
    files = parser.add_argument_group("configuration files")
    files.add_argument("--config", metavar="FILE", help="options from a TOML (.toml) or JSON file")
    add_option_flags(parser)
    parser.set_defaults(handler=_plan)


def fixed_options(resolved: Resolved) -> set[str]:
    """The configuration fields the user set (flags or files): the search keeps them."""
    fixed = {name for name in resolved.origins if OPTIONS[name].section == "zero3"}
    if "batch_size" in resolved.origins and "gradient_accumulation_steps" in resolved.origins:
        fixed.add("batch_split")
    return fixed


def _plan(args: argparse.Namespace) -> int:
    resolved = resolve_args(args)
    opts, zero3 = resolved.train, resolved.zero3
    out, err = _console(), _console(stderr=True)
    if args.calibrate:
        local = local_ranks(opts.world_size)
        err.print(f"measuring this machine's figures for {local} local rank(s)", markup=False)
        try:
            calibration = load_or_measure(local, remeasure=True)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        err.print(f"calibrated: {cache_path(local)}", markup=False)
        if opts.model is None:
            out.print(_calibration_table(calibration))
            return 0
    if opts.model is None:
        raise UsageError("give --model DIR (a transformers model directory), or --calibrate")
    local = local_ranks(opts.world_size)
    if not cache_path(local).is_file() and not args.calibrate:
        err.print(
            f"measuring this machine's figures for {local} local rank(s) first (about a "
            f"minute; cached in {cache_path(local)})",
            markup=False,
        )
    try:
        figures = load_or_measure(local)
        if opts.memory_per_rank:
            device = opts.device_memory or None
            choice = choose_config(
                opts,
                zero3,
                opts.memory_per_rank,
                device_budget=device,
                fixed=fixed_options(resolved),
                calibration=figures,
            )
            _print_choice(choice, out, err, as_json=args.json)
            return 0
        planned = plan_run(opts, zero3, figures)
    except NothingFitsError as exc:
        if args.json:
            out.out(json.dumps({"fits": False, "error": str(exc)}, indent=2), highlight=False)
        err.print(f"zero3-offload plan: {exc}", markup=False)
        return 1
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        out.out(json.dumps(planned.to_json(), indent=2), highlight=False)
    else:
        for table in plan_tables(planned):
            out.print(table)
    return 0


def _console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, highlight=False, soft_wrap=stderr)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def plan_tables(planned: RunPlan) -> list[Table]:
    """The plan as rich tables: the peak by part, the step's points, the step time."""
    train = planned.train
    title = (
        f"plan: {train['model']} on {train['world_size']} rank(s), {train['batch_size']} x "
        f"{train['seq_len']} tokens per rank and micro-step"
        + (f", LoRA {train['lora']}" if train["lora"] else "")
    )
    peak = Table(title=title, title_justify="left")
    peak.add_column(f"host peak per rank, at {planned.host_peak_at}")
    peak.add_column("MiB", justify="right")
    for name, n in sorted(planned.breakdown.items(), key=lambda kv: -kv[1]):
        peak.add_row(name, _mib(n))
    peak.add_row("[b]total (peak RSS)[/b]", f"[b]{_mib(planned.host_peak_bytes)}[/b]")
    tables = [peak]
    if planned.device_breakdown:
        device = Table(title=f"device peak per rank, at {planned.device_peak_at}")
        device.add_column("part")
        device.add_column("MiB", justify="right")
        for name, n in sorted(planned.device_breakdown.items(), key=lambda kv: -kv[1]):
            device.add_row(name, _mib(n))
        device.add_row("[b]total[/b]", f"[b]{_mib(planned.device_peak_bytes)}[/b]")
        tables.append(device)
    phases = Table(title="host memory per rank at each point")
    phases.add_column("point")
    phases.add_column("MiB", justify="right")
    for name, n in planned.phases.items():
        phases.add_row(name, _mib(n))
    tables.append(phases)
    step = Table(
        title=f"predicted step: {planned.predicted_step_s:.3f} s "
        f"(disk: {_mib(planned.disk_bytes)} MiB per rank)"
    )
    step.add_column("work")
    step.add_column("s", justify="right")
    for name, seconds in planned.step_breakdown.items():
        step.add_row(name, f"{seconds:.3f}")
    tables.append(step)
    return tables


def _calibration_table(calibration: Calibration) -> Table:
    table = Table(title=f"this machine, {calibration.ranks} local rank(s)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for dtype, flops in calibration.matmul_flops.items():
        table.add_row(f"matmul {dtype} per rank", f"{flops / 1e9:,.1f} GFLOP/s")
    for dtype, flops in calibration.layer_flops.items():
        table.add_row(f"decoder layer step {dtype} per rank", f"{flops / 1e9:,.1f} GFLOP/s")
    for fmt, rate in calibration.decode_elements_per_s.items():
        table.add_row(f"decode {fmt} to fp32", f"{rate / 1e9:,.2f} G elements/s")
    table.add_row("memory copy", f"{calibration.copy_bytes_per_s / 1e9:,.2f} GB/s")
    table.add_row("gloo all-gather", f"{calibration.gather_bytes_per_s / 1e9:,.2f} GB/s")
    shared = calibration.shared_gather_bytes_per_s
    table.add_row("all-gather through shared memory", f"{shared / 1e9:,.2f} GB/s")
    table.add_row("fresh memory", f"{calibration.fresh_bytes_per_s / 1e9:,.2f} GB/s")
    table.add_row("disk write", f"{calibration.disk_write_bytes_per_s / 1e9:,.2f} GB/s")
    table.add_row("disk read", f"{calibration.disk_read_bytes_per_s / 1e9:,.2f} GB/s")
    table.add_row("runtime per rank", f"{_mib(calibration.runtime_rss_bytes)} MiB")
    table.add_row("runtime with LoRA", f"{_mib(calibration.adapter_runtime_rss_bytes)} MiB")
    return table


def _print_choice(choice: BudgetChoice, out: Console, err: Console, *, as_json: bool) -> None:
    chosen = choice.chosen
    if as_json:
        data = {
            "fits": True,
            "config_file": choice.config_file(),
            "plan": chosen.plan.to_json(),
            "considered": choice.considered,
            "runners_up": [
                {
                    "changes": r.changes,
                    "host_peak_bytes": r.plan.host_peak_bytes,
                    "predicted_step_s": r.plan.predicted_step_s,
                    "why": r.why,
                }
                for r in choice.runners_up
            ],
        }
        out.out(json.dumps(data, indent=2), highlight=False)
        return
    out.out(json.dumps(choice.config_file(), indent=2), highlight=False)
    err.print(
        f"chosen of {choice.considered} planned: peak {_mib(chosen.plan.host_peak_bytes)} MiB "
        f"of {_mib(choice.budget)} MiB, {chosen.plan.predicted_step_s:.3f} s per step",
        markup=False,
    )
    table = Table(title="runners-up")
    table.add_column("differs from the choice")
    table.add_column("peak MiB", justify="right")
    table.add_column("step s", justify="right")
    table.add_column("why it lost")
    for runner in choice.runners_up:
        differs = {k: v for k, v in runner.changes.items() if chosen.changes.get(k) != v} or {
            "batch_size": runner.opts.batch_size
        }
        table.add_row(
            ", ".join(f"{k}={v}" for k, v in differs.items()),
            _mib(runner.plan.host_peak_bytes),
            f"{runner.plan.predicted_step_s:.3f}",
            runner.why,
        )
    err.print(table)


def choose_for_train(args: argparse.Namespace) -> None:
    """``zero3-offload train --memory-per-rank SIZE``: plan, say the choice on stderr, and
    set the chosen options on ``args`` as flags, so the run trains with them. Nothing
    happens without ``memory_per_rank`` (from a flag or a ``--config`` file).

    Raises:
        UsageError: a bad option, or no configuration fits (the smallest peak named).
    """
    resolved = resolve_args(args)
    opts = resolved.train
    if not opts.memory_per_rank:
        return
    try:
        choice = choose_config(
            opts,
            resolved.zero3,
            opts.memory_per_rank,
            device_budget=opts.device_memory or None,
            fixed=fixed_options(resolved),
        )
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    for name, value in choice.config_file().items():
        setattr(args, name, value)
    if os.environ.get("RANK", "0") == "0":
        chosen = ", ".join(f"{k}={v}" for k, v in choice.config_file().items())
        print(
            f"memory_per_rank={opts.memory_per_rank}: chose {chosen} of "
            f"{choice.considered} planned (predicted peak "
            f"{_mib(choice.chosen.plan.host_peak_bytes)} MiB per rank, "
            f"{choice.chosen.plan.predicted_step_s:.2f} s per step)",
            file=sys.stderr,
        )
