"""The cost curve of zero3_offload: step time and per-rank memory vs model size and ranks.

Trains the GPT of ``_peers_model.py`` (children are the layers) at several
sizes (default about 5M, 20M, 80M and 300M parameters) with
``Zero3CpuOffloadManager`` (default config, AdamW) on N = 1, 2 and 4 gloo
ranks of 1 torch thread each, and plain single-process torch
(``torch.optim.AdamW(fused=True)``, 1 process x 1 thread by default, the
thread count of N = 1) at every size as the baseline, so every figure has a
ratio to plain torch measured in the same run. The global batch (8 windows
of 128 bytes) is the same for every N and size; each rank takes its
contiguous 8 / N windows.

Every run is ``_peers_run.launch()``: fresh interpreters (one per rank)
running ``_peers_worker.py`` with torchrun's environment variables, the same
model seed, data and optimizer settings as ``compare_peers.py``. Within each
size the systems run in an order rotated by one per size and round (a Latin
square over the 4 default sizes), so slow phases of the shared machine do not
fall on one N; the 1-minute load average at each run's start is recorded.

Per (size, system): median step time over the timed steps of every rank and
run (after ``--warmup`` untimed steps), CPU seconds per step (all ranks
summed), per-rank peak RSS (``VmHWM``; max over ranks, median over runs), the
model-state bytes per rank counted from tensors (ours:
``get_memory_stats().model_state_bytes()``), and a loss check: every loss
finite and the first 5 within 1e-3 of plain torch's.

Outputs: ``results/scaling.json`` (every per-step, per-rank sample, machine,
config), ``results/scaling.md`` (tables with ratios) and the plot
``docs/scaling.png`` (``--plot PATH``, ``--no-plot``). ``--quick`` runs tiny
sizes as a smoke test, writes ``scaling-quick.json``/``.md`` and a plot only
with an explicit ``--plot``. ``--render JSON`` rebuilds the markdown (and,
with ``--plot``, the plot) of an earlier run from its results JSON without
running anything. ``--help`` lists the options.

The pieces: ``_scaling_run.py`` (sizes, plan, time estimate, running it),
``_scaling_report.py`` (summaries, loss check, tables, notes) and
``_scaling_plot.py`` (the plot).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_common_args,
    add_rank_run_args,
    load_average,
    machine_info,
    machine_line,
    markdown_report,
    work_directory,
    write_results,
)
from _peers_model import corpus_info
from _peers_report import LOSS_CHECK_STEPS
from _peers_run import LR, WEIGHT_DECAY, describe_systems
from _scaling_plot import plot
from _scaling_report import TITLE, losses_agree, notes_for, rebuild, render, summarize_sizes
from _scaling_run import (
    DEFAULT_WORLDS,
    QUICK_SIZES,
    SIZES,
    fmt_duration,
    param_count,
    predict,
    progress,
    run_all,
    schedule,
    size_config,
    steps_of,
    systems_for,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLOT = REPO_ROOT / "docs" / "scaling.png"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Step time and per-rank memory of zero3_offload vs model size and number "
        "of gloo ranks, with plain single-process torch as the baseline at every size.",
        epilog="Here --repeats is the number of timed steps per run and --warmup the untimed "
        "steps before them (defaults per size: "
        + ", ".join(f"{s.name} {s.warmup}+{s.repeats}" for s in SIZES.values())
        + "; quick 1+4), --threads the torch threads per rank of zero3_offload (default 1).",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated subset of {', '.join(SIZES)} (quick: {', '.join(QUICK_SIZES)})",
    )
    parser.add_argument(
        "--worlds",
        default=",".join(map(str, DEFAULT_WORLDS)),
        help="comma-separated numbers of gloo ranks for zero3_offload (default 1,2,4)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads of the plain-torch baseline (default: --threads, as N=1)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every (size, system) (default 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="model seed (default 0)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default 1800; quick 300)"
    )
    plot_opts = parser.add_mutually_exclusive_group()
    plot_opts.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"PNG path (default {DEFAULT_PLOT.relative_to(REPO_ROOT)}; --quick plots only "
        "when this is given)",
    )
    plot_opts.add_argument("--no-plot", action="store_true", help="write no plot")
    add_rank_run_args(parser, render_extra=", and the plot only with --plot")
    add_common_args(parser)
    parser.set_defaults(warmup=None, repeats=None, threads=1)
    args = parser.parse_args(argv)
    validate(parser, args)
    return args


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve defaults and reject values that break the method (via ``parser.error``)."""
    table = QUICK_SIZES if args.quick else SIZES
    names = args.sizes.split(",") if args.sizes else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {', '.join(table)}")
    args.size_list = [table[n] for n in names]
    try:
        args.world_list = sorted({int(w) for w in args.worlds.split(",")})
    except ValueError:
        parser.error(f"--worlds must be comma-separated integers, not {args.worlds!r}")
    if not args.world_list or min(args.world_list) < 1:
        parser.error("--worlds must be >= 1")
    for size in args.size_list:
        bad = [n for n in args.world_list if size.global_batch % n]
        if bad:
            parser.error(
                f"global batch {size.global_batch} of {size.name} does not split over {bad}"
            )
    if args.torch_threads is None:
        args.torch_threads = args.threads
    if args.threads < 1 or args.torch_threads < 1 or args.rounds < 1:
        parser.error("--threads, --torch-threads and --rounds must be >= 1")
    if args.timeout is None:
        args.timeout = 300.0 if args.quick else 1800.0
    for size in args.size_list:
        warmup, repeats = steps_of(size, args)
        if warmup < 0 or repeats < 1:
            parser.error("--warmup must be >= 0 and --repeats >= 1")
        if warmup + repeats < LOSS_CHECK_STEPS:
            parser.error(f"--warmup + --repeats must be >= {LOSS_CHECK_STEPS} (the loss check)")
    if args.no_plot:
        args.plot_path = None
    else:
        args.plot_path = args.plot if (args.plot or args.quick) else DEFAULT_PLOT


def render_only(path: Path, out: Path | None, plot_path: Path | None) -> int:
    """``--render``: the markdown of the results JSON at ``path``; the plot at ``plot_path``."""
    payload = json.loads(path.read_text(encoding="utf-8"))
    info = payload["machine"]
    cores = info["usable_cores"] or 1
    sizes, systems, by_size = rebuild(payload)
    tables_md = render(sizes, systems, by_size, payload["runs"], cores)
    notes = notes_for({**payload, "summary": by_size})
    md = markdown_report(info, tables_md, title=TITLE, notes=notes)
    if out is None:
        print(md, end="")
    else:
        md_path = out.with_suffix(".md")
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(md, encoding="utf-8")
        progress(f"wrote {md_path}")
    if plot_path is not None:
        plot(plot_path, sizes, systems, by_size, f"{TITLE}\n{machine_line(info)}", cores)
        progress(f"wrote {plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        return render_only(args.render, args.out, args.plot)
    torch.set_num_threads(args.threads)
    info = machine_info()
    info["threads_per_rank"] = args.threads
    cores = info["usable_cores"] or 1
    systems = systems_for(args.world_list)
    params = {s.name: param_count(s)[0] for s in args.size_list}
    plan = schedule(args.size_list, list(systems), args.rounds)
    predicted = predict(plan, systems, args, params, cores)
    progress(f"machine: {machine_line(info)}")
    progress(
        "sizes: "
        + ", ".join(f"{s.name} = {params[s.name]:,} params" for s in args.size_list)
        + f"; systems: {', '.join(v[0] for v in systems.values())}; {len(plan)} runs"
    )
    progress(f"estimate: about {fmt_duration(sum(predicted))} on an idle machine like this one")
    started = time.perf_counter()
    with work_directory("scaling-", keep=args.keep, report=progress) as workdir:
        runs = run_all(plan, systems, args, predicted, workdir)
    total_wall = time.perf_counter() - started
    warmups = {s.name: steps_of(s, args)[0] for s in args.size_list}
    by_size = summarize_sizes(args.size_list, systems, runs, warmups, params)
    tables_md = render(args.size_list, systems, by_size, runs, cores)
    name = "scaling-quick" if args.quick else "scaling"
    if args.mmap_threshold is not None:
        name += "-mmap"
    payload = {
        "benchmark": name,
        "machine": info,
        "load_average_at_end": load_average(),
        "config": {
            "sizes": {s.name: size_config(s, args) for s in args.size_list},
            "worlds": args.world_list,
            "threads_per_rank": args.threads,
            "torch_threads": args.torch_threads,
            "rounds": args.rounds,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "seed": args.seed,
            "malloc_mmap_threshold": args.mmap_threshold,
            "corpus": corpus_info(),
            "systems": describe_systems(systems),
            "order": [(r, s.name, k) for r, s, k in plan],
        },
        "summary": by_size,
        "runs": runs,
        "estimated_run_s": predicted,
        "estimated_total_s": sum(predicted),
        "total_wall_s": total_wall,
    }
    notes = notes_for(payload)
    print(tables_md)
    print()
    print("\n".join(f"- {n}" for n in notes))

    out = args.out or RESULTS_DIR / f"{name}.json"
    json_path, md_path = write_results(out, payload, tables_md, title=TITLE, notes=notes)
    print(f"\nwrote {json_path} and {md_path}")
    if args.plot_path is not None:
        plot(
            args.plot_path,
            args.size_list,
            systems,
            by_size,
            f"{TITLE}\n{machine_line(info)}",
            cores,
        )
        print(f"wrote {args.plot_path}")
    if any(not r["ok"] for r in runs):
        return 1
    return 0 if losses_agree(by_size) else 2


if __name__ == "__main__":
    raise SystemExit(main())
