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

Every run is ``compare_peers.launch()``: fresh interpreters (one per rank)
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
with an explicit ``--plot``. ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_common_args,
    fmt_rate,
    load_average,
    machine_info,
    machine_line,
    markdown_table,
    write_results,
)
from _peers_model import GPT, corpus_info, count_params
from compare_peers import (
    LOSS_CHECK_STEPS,
    LOSS_TOLERANCE,
    LR,
    MIB,
    SYSTEMS,
    WEIGHT_DECAY,
    _global_losses,
    _ratio,
    _step_cpu,
    launch,
    summarize,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLOT = REPO_ROOT / "docs" / "scaling.png"
DEFAULT_WORLDS = (1, 2, 4)
TORCH_KEY = "torch"
System = tuple[str, str, int, dict[str, Any]]  # label, kind, world size, options


@dataclass(frozen=True)
class Size:
    """One model size: GPT dimensions, global batch and default step counts."""

    name: str
    d: int
    heads: int
    n_layers: int
    seq: int = 128
    global_batch: int = 8
    warmup: int = 1
    repeats: int = 4

    @property
    def dims(self) -> dict[str, int]:
        return {
            "d": self.d,
            "heads": self.heads,
            "n_layers": self.n_layers,
            "seq": self.seq,
            "global_batch": self.global_batch,
        }

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq


# Blocks hold 12 d^2 + 10 d parameters. 300M is compare_peers' large model and
# 20M its small one, so those rows can be checked against results/peers*.md.
SIZES = {
    s.name: s
    for s in (
        Size("5M", d=256, heads=4, n_layers=6, warmup=2, repeats=8),
        Size("20M", d=512, heads=8, n_layers=6, warmup=2, repeats=6),
        Size("80M", d=768, heads=12, n_layers=11, warmup=1, repeats=5),
        Size("300M", d=1024, heads=16, n_layers=24, warmup=1, repeats=4),
    )
}
QUICK_SIZES = {
    s.name: s
    for s in (
        Size("q20k", d=32, heads=2, n_layers=1, seq=32),
        Size("q60k", d=64, heads=2, n_layers=1, seq=32),
        Size("q120k", d=64, heads=2, n_layers=2, seq=32),
        Size("q400k", d=128, heads=4, n_layers=2, seq=32),
    )
}

# Cost model for the time estimate only (nothing reported is estimated). CPU
# seconds per parameter and token of one step, from this machine's
# `compare_peers.py --large --mmap-threshold 1048576` (results/peers-large-mmap.json,
# 303M params, 1,024 tokens): plain torch 24.8 CPU s / step, zero3_offload on
# 2 ranks 39.2 CPU s / step (both ranks). Start-up: interpreter + imports per
# rank, and building (and, for ours, sharding) the model in every rank.
CPU_S_PER_PARAM_TOKEN = {"torch": 8.0e-11, "zero3_offload": 1.26e-10}
START_S = 3.0
BUILD_S_PER_PARAM = 3e-8


# ---------------------------------------------------------------- plan


def systems_for(worlds: list[int]) -> dict[str, System]:
    """Plain torch plus zero3_offload (compare_peers' default config) at every world size."""
    torch_label, torch_kind, _, torch_opts = SYSTEMS["torch"]
    _, ours_kind, _, ours_opts = SYSTEMS["ours_default"]
    systems: dict[str, System] = {TORCH_KEY: (torch_label, torch_kind, 1, torch_opts)}
    for n in worlds:
        systems[f"ours_n{n}"] = (f"zero3_offload N={n}", ours_kind, n, ours_opts)
    return systems


def schedule(sizes: list[Size], keys: list[str], rounds: int) -> list[tuple[int, Size, str]]:
    """(round, size, system) in run order: sizes in turn, systems rotated by size + round."""
    plan = []
    for r in range(rounds):
        for i, size in enumerate(sizes):
            k = (i + r) % len(keys)
            plan += [(r, size, key) for key in keys[k:] + keys[:k]]
    return plan


def param_count(size: Size) -> tuple[int, dict[str, int]]:
    """Parameters of the GPT at ``size`` (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        model = GPT(d=size.d, heads=size.heads, n_layers=size.n_layers, seq=size.seq)
    return count_params(model)


def estimate_run_s(
    system: System, rank_threads: int, n_params: int, size: Size, steps: int, cores: int
) -> float:
    """Predicted wall seconds of one run (for the progress estimate only)."""
    _, kind, world, _ = system
    busy = max(1, min(world * rank_threads, cores))
    parallel_ranks = max(1, min(world, cores))
    start = START_S * math.ceil(world / cores) + BUILD_S_PER_PARAM * n_params * world / (
        parallel_ranks
    )
    step_cpu = CPU_S_PER_PARAM_TOKEN[kind] * n_params * size.tokens
    return start + steps * step_cpu / busy


def predict(
    plan: list[tuple[int, Size, str]],
    systems: dict[str, System],
    args: argparse.Namespace,
    params: dict[str, int],
    cores: int,
) -> list[float]:
    """Predicted wall seconds of every planned run, in plan order."""
    return [
        estimate_run_s(
            systems[key],
            rank_threads(key, args),
            params[size.name],
            size,
            sum(steps_of(size, args)),
            cores,
        )
        for _, size, key in plan
    ]


def fmt_duration(seconds: float) -> str:
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes}m{sec:02d}s" if minutes else f"{sec}s"


# ---------------------------------------------------------------- running


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_median_step(run: dict[str, Any]) -> float:
    w = run["warmup"]
    return statistics.median(x["step_s"] for rk in run["ranks"] for x in rk["steps"][w:])


def run_all(
    plan: list[tuple[int, Size, str]],
    systems: dict[str, System],
    args: argparse.Namespace,
    predicted: list[float],
    workdir: Path,
) -> list[dict[str, Any]]:
    """Launch every planned run (fresh processes each); progress and an ETA on stderr.

    The ETA scales the predicted time of the remaining runs by how the runs so
    far compared with their prediction.
    """
    runs: list[dict[str, Any]] = []
    failed: set[tuple[str, str]] = set()
    started = time.perf_counter()
    for i, (r, size, key) in enumerate(plan):
        tag = f"[{i + 1}/{len(plan)}] round {r} {size.name:>5} {systems[key][0]}"
        if (size.name, key) in failed:
            progress(f"{tag}: skipped (failed before)")
            continue
        warmup, repeats = steps_of(size, args)
        progress(f"{tag}: running ({warmup} warm-up + {repeats} timed steps) ...")
        run = launch(
            key,
            systems[key],
            common_spec(size, args, warmup, repeats),
            workdir / f"round{r}-{size.name}-{key}",
            threads=args.threads,
            timeout_s=args.timeout,
            mmap_threshold=args.mmap_threshold,
            rank_threads=rank_threads(key, args),
        )
        run.update({"round": r, "size": size.name, "warmup": warmup, "index": i})
        runs.append(run)
        elapsed = time.perf_counter() - started
        scale = elapsed / max(sum(predicted[: i + 1]), 1e-9)
        eta = fmt_duration(scale * sum(predicted[i + 1 :]))
        if run["ok"]:
            rss = max(rk["peak_rss_bytes"] for rk in run["ranks"]) / MIB
            progress(
                f"{tag}: median step {run_median_step(run):.3f} s, peak RSS/rank {rss:,.0f} MiB, "
                f"run {run['wall_s']:.1f} s; elapsed {fmt_duration(elapsed)}, ~{eta} left"
            )
        else:
            failed.add((size.name, key))
            progress(f"{tag}: FAILED: {run['error']} (run {run['wall_s']:.1f} s)")
            for rank, tail in run["log_tails"].items():
                progress("\n    ".join([f"  rank {rank} log tail:", *tail]))
    return runs


def steps_of(size: Size, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up, timed) steps of a run at ``size``: the options, else the size's defaults."""
    warmup = size.warmup if args.warmup is None else args.warmup
    repeats = size.repeats if args.repeats is None else args.repeats
    return warmup, repeats


def rank_threads(key: str, args: argparse.Namespace) -> int:
    return args.torch_threads if key == TORCH_KEY else args.threads


def common_spec(size: Size, args: argparse.Namespace, warmup: int, repeats: int) -> dict[str, Any]:
    """The worker spec fields every system of one size shares."""
    return {
        "dims": size.dims,
        "global_batch": size.global_batch,
        "seed": args.seed,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "warmup": warmup,
        "steps": repeats,
    }


# ---------------------------------------------------------------- summaries


def loss_check(keys: list[str], runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: every loss finite; max |diff| of the first steps of every run vs plain torch.

    A system without a successful run, or a size without a plain-torch run,
    does not agree (nothing was checked).
    """
    ref_run = next((r for r in runs if r["key"] == TORCH_KEY and r["ok"]), None)
    ref = _global_losses(ref_run) if ref_run else None
    out = {}
    for key in keys:
        losses = [_global_losses(r) for r in runs if r["key"] == key and r["ok"]]
        finite = all(math.isfinite(v) for ls in losses for v in ls)
        if ref is None or not losses:
            out[key] = {"finite": finite, "max_diff": None, "agree": False, "runs": len(losses)}
            continue
        n = min(LOSS_CHECK_STEPS, len(ref))
        diff = max(abs(a - b) for ls in losses for a, b in zip(ls[:n], ref[:n], strict=True))
        out[key] = {
            "finite": finite,
            "max_diff": diff,
            "agree": finite and diff <= LOSS_TOLERANCE,
            "runs": len(losses),
        }
    return out


def summarize_sizes(
    sizes: list[Size],
    systems: dict[str, System],
    runs: list[dict[str, Any]],
    args: argparse.Namespace,
    params: dict[str, int],
) -> dict[str, dict[str, Any]]:
    """size name -> {"params", "systems": compare_peers.summarize() per system, "losses"}."""
    out = {}
    for size in sizes:
        size_runs = [r for r in runs if r["size"] == size.name]
        summary = summarize(systems, size_runs, steps_of(size, args)[0])
        for key, s in summary.items():
            ok = [r for r in size_runs if r["ok"] and r["key"] == key]
            s["sum_peak_rss_bytes"] = statistics.median(
                sum(rk["peak_rss_bytes"] for rk in r["ranks"]) for r in ok
            )
            s["built_rss_bytes"] = statistics.median(
                max(rk["marks"]["model_built"]["rss_bytes"] for rk in r["ranks"]) for r in ok
            )
        out[size.name] = {
            "params": params[size.name],
            "dims": size.dims,
            "systems": summary,
            "losses": loss_check(list(systems), size_runs),
        }
    return out


# ---------------------------------------------------------------- tables


def _cell(s: dict[str, Any] | None, field: str, scale: float, digits: str) -> str:
    return "-" if s is None else f"{s[field] / scale:{digits}}"


def pivot_table(
    sizes: list[Size],
    keys: list[str],
    systems: dict[str, System],
    by_size: dict[str, dict[str, Any]],
    field: str,
    scale: float,
    digits: str,
) -> str:
    """Rows: sizes; columns: plain torch's figure, then each N's figure (ratio to torch)."""
    headers = ["size", "params", *[systems[k][0] for k in keys]]
    rows = []
    for size in sizes:
        per = by_size[size.name]["systems"]
        ref = per.get(TORCH_KEY)
        cells = []
        for key in keys:
            s = per.get(key)
            txt = _cell(s, field, scale, digits)
            if s is not None and key != TORCH_KEY:
                txt += f" ({_ratio(s[field], ref and ref[field])})"
            cells.append(txt)
        rows.append([size.name, f"{by_size[size.name]['params']:,}", *cells])
    return markdown_table(headers, rows)


def speedup(key: str, s: dict[str, Any], one: dict[str, Any] | None) -> str:
    """step(N=1) / step(N) for zero3_offload rows; "-" for plain torch or without N=1."""
    if key == TORCH_KEY or one is None:
        return "-"
    return _ratio(one["median_step_s"], s["median_step_s"])


def loss_cell(check: dict[str, Any]) -> str:
    text = "no reference" if check["max_diff"] is None else f"{check['max_diff']:.1e}"
    return text if check["finite"] else text + " (not finite)"


def detail_table(
    sizes: list[Size], keys: list[str], by_size: dict[str, dict[str, Any]], cores: int
) -> str:
    """Every figure of every (size, system), with ratios to plain torch and to N=1."""
    headers = [
        "size",
        "system",
        "ranks x threads",
        "median step s",
        "vs torch",
        "speed-up vs N=1",
        "CPU s / step",
        "vs torch",
        "peak RSS / rank MiB",
        "vs torch",
        "sum of rank peaks MiB",
        "RSS after build MiB",
        "model state / rank MiB",
        "vs torch",
        "loss max |diff| vs torch",
        "runs",
    ]
    rows = []
    for size in sizes:
        per = by_size[size.name]["systems"]
        ref, one = per.get(TORCH_KEY), per.get("ours_n1")
        for key in keys:
            s = per.get(key)
            if s is None:
                continue
            over = " (oversubscribed)" if s["world_size"] * s["threads_per_rank"] > cores else ""
            rows.append(
                [
                    size.name,
                    s["label"],
                    f"{s['world_size']} x {s['threads_per_rank']}{over}",
                    f"{s['median_step_s']:.3f}",
                    _ratio(s["median_step_s"], ref and ref["median_step_s"]),
                    speedup(key, s, one),
                    f"{s['median_cpu_s']:.3f}",
                    _ratio(s["median_cpu_s"], ref and ref["median_cpu_s"]),
                    f"{s['peak_rss_bytes'] / MIB:,.0f}",
                    _ratio(s["peak_rss_bytes"], ref and ref["peak_rss_bytes"]),
                    f"{s['sum_peak_rss_bytes'] / MIB:,.0f}",
                    f"{s['built_rss_bytes'] / MIB:,.0f}",
                    f"{s['model_state_bytes'] / MIB:,.1f}",
                    _ratio(s["model_state_bytes"], ref and ref["model_state_bytes"]),
                    loss_cell(by_size[size.name]["losses"][key]),
                    str(s["runs"]),
                ]
            )
    return markdown_table(headers, rows)


def runs_table(runs: list[dict[str, Any]], systems: dict[str, System]) -> str:
    """Every run in the order it ran: load average at its start and its own medians."""
    headers = ["#", "round", "size", "system", "load avg", "median step s", "CPU s / step",
               "peak RSS / rank MiB", "run wall s"]  # fmt: skip
    rows = []
    for run in runs:
        load = run.get("load_average_at_start")
        ok = run["ok"]
        rows.append(
            [
                str(run["index"] + 1),
                str(run["round"]),
                run["size"],
                systems[run["key"]][0],
                f"{load[0]:.2f}" if load else "-",
                f"{run_median_step(run):.3f}" if ok else "FAILED",
                f"{statistics.median(_step_cpu(run, run['warmup'])):.3f}" if ok else "-",
                f"{max(rk['peak_rss_bytes'] for rk in run['ranks']) / MIB:,.0f}" if ok else "-",
                f"{run['wall_s']:.1f}",
            ]
        )
    return markdown_table(headers, rows)


def render(
    sizes: list[Size],
    systems: dict[str, System],
    by_size: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    cores: int,
) -> str:
    keys = list(systems)
    return "\n\n".join(
        [
            "Median step time, s (ratio to plain torch at the same size; <1 is faster):",
            pivot_table(sizes, keys, systems, by_size, "median_step_s", 1.0, ".3f"),
            "Peak RSS per rank, MiB (max over ranks; ratio to plain torch's one process):",
            pivot_table(sizes, keys, systems, by_size, "peak_rss_bytes", MIB, ",.0f"),
            "Model state per rank, MiB (counted from tensors; ratio to plain torch):",
            pivot_table(sizes, keys, systems, by_size, "model_state_bytes", MIB, ",.1f"),
            "All figures:",
            detail_table(sizes, keys, by_size, cores),
            "Runs in the order they ran (1-minute load average at each run's start):",
            runs_table(runs, systems),
        ]
    )


# ---------------------------------------------------------------- plot


def _log_axes(ax: Any, params: list[int], y_fmt: str) -> None:
    """Log-log axes: x ticks at the measured sizes, y ticks at 1-2-5 steps, no minor labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(params))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_rate(v)))
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format(v, y_fmt)))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("parameters")
    ax.grid(True, which="both", alpha=0.3)


def plot(
    path: Path,
    sizes: list[Size],
    systems: dict[str, System],
    by_size: dict[str, dict[str, Any]],
    title: str,
    cores: int,
) -> None:
    """Two panels against parameters (log-log): median step time; peak RSS per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.4))
    for key, (label, _, world, _) in systems.items():
        if key != TORCH_KEY and world > cores:
            label += f" ({world} ranks on {cores} cores)"
        pts = [
            (by_size[sz.name]["params"], by_size[sz.name]["systems"][key])
            for sz in sizes
            if key in by_size[sz.name]["systems"]
        ]
        if not pts:
            continue
        xs = [p for p, _ in pts]
        style = {"marker": "o", "label": label}
        if key == TORCH_KEY:
            style.update({"color": "black", "linestyle": "--", "marker": "s"})
        ax_t.plot(xs, [s["median_step_s"] for _, s in pts], **style)
        ax_m.plot(xs, [s["peak_rss_bytes"] / MIB for _, s in pts], **style)
    params = [by_size[sz.name]["params"] for sz in sizes]
    _log_axes(ax_t, params, ".3g")
    _log_axes(ax_m, params, ",.0f")
    ax_t.set_ylabel("median step time (s)")
    ax_m.set_ylabel("peak RSS per rank (MiB, VmHWM)")
    ax_t.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set MALLOC_MMAP_THRESHOLD_=BYTES in every process (as `zero3-offload train` "
        "does with 1048576); the output name gets '-mmap'",
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
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs, per-rank results)"
    )
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


def losses_agree(by_size: dict[str, dict[str, Any]]) -> bool:
    """Whether every planned (size, system) ran and passed the loss check."""
    return all(v["agree"] for b in by_size.values() for v in b["losses"].values())


def notes_for(
    args: argparse.Namespace,
    by_size: dict[str, dict[str, Any]],
    cores: int,
    total_wall: float,
    predicted: float,
) -> list[str]:
    sizes_txt = "; ".join(
        f"{s.name}: d={s.d}, {s.heads} heads, {s.n_layers} block(s), seq {s.seq} = "
        f"{by_size[s.name]['params']:,} params, {steps_of(s, args)[0]} warm-up + "
        f"{steps_of(s, args)[1]} timed steps"
        for s in args.size_list
    )
    gb = {s.global_batch for s in args.size_list}
    over = [n for n in args.world_list if n * args.threads > cores]
    agree = losses_agree(by_size)
    return [
        f"Model: GPT of `benchmarks/_peers_model.py` (byte vocabulary 256), fp32. {sizes_txt}.",
        f"Global batch {'/'.join(map(str, sorted(gb)))} windows per step for every N (each rank "
        "takes its contiguous share), the same batches (windows of the Python stdlib's *.py "
        f"bytes, sha256 {corpus_info()['sha256'][:12]}) and seed {args.seed} for every system.",
        f"AdamW lr {LR}, betas (0.9, 0.999), eps 1e-8, weight decay {WEIGHT_DECAY}. Plain torch: "
        f"1 process x {args.torch_threads} torch thread(s), torch.optim.AdamW(fused=True), whole "
        f"batch. zero3_offload: Zero3CpuOffloadManager, default config, gloo, N ranks x "
        f"{args.threads} torch thread(s) (compare_peers' `ours_default`).",
        f"Machine: {cores} usable cores. "
        + (
            f"N={', '.join(map(str, over))} runs more busy threads than cores "
            "(oversubscribed): its ranks share the cores, so its step time shows the cost of "
            "more ranks on the same cores, not of more hardware."
            if over
            else "No configuration is oversubscribed."
        ),
        f"Each run: fresh processes (compare_peers.launch). {args.rounds} round(s); within a "
        "size the systems run in an order rotated by one per size and round (with as many "
        "sizes as systems, each system runs in each position once per round), so drift of the "
        "machine does not fall on one N. The load average at each run's start is in the last "
        "table.",
        "Median step: over every timed step of every rank and run. CPU s / step: process time "
        "of all ranks during a step, summed (less sensitive than wall time to other load). "
        "speed-up vs N=1 = step(N=1) / step(N).",
        "Peak RSS / rank: VmHWM at the end of a run, max over ranks, median over runs (includes "
        "the interpreter with torch imported and the full model each rank builds before "
        "sharding). RSS after build: VmRSS right after that build, max over ranks. Sum of rank "
        "peaks: the per-rank peaks added up (an upper bound of the machine's total; the peaks "
        "need not coincide).",
        "Model state / rank: bytes of the storages behind parameters, gradients and optimizer "
        "state after the last step (torch: p, p.grad, AdamW state; ours: "
        "get_memory_stats().model_state_bytes(), gradient shards released after the update).",
        f"Losses: all finite and the first {LOSS_CHECK_STEPS} of every run within "
        f"{LOSS_TOLERANCE:g} of plain torch's: {agree}"
        + ("" if agree else " (or a system has no successful run to check)")
        + ".",
        "glibc malloc: "
        + (
            f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold} in every process."
            if args.mmap_threshold is not None
            else "defaults in every process."
        ),
        f"Whole benchmark {total_wall:.0f} s wall (estimated beforehand: {predicted:.0f} s).",
    ]


def size_config(size: Size, args: argparse.Namespace) -> dict[str, Any]:
    """A size's dimensions, parameter counts (total and per layer) and step counts."""
    total, per_layer = param_count(size)
    warmup, repeats = steps_of(size, args)
    return {
        **size.dims,
        "params": total,
        "layer_params": per_layer,
        "warmup": warmup,
        "timed_steps": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    workdir = Path(tempfile.mkdtemp(prefix="scaling-"))
    started = time.perf_counter()
    try:
        runs = run_all(plan, systems, args, predicted, workdir)
    finally:
        if args.keep:
            progress(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    total_wall = time.perf_counter() - started
    by_size = summarize_sizes(args.size_list, systems, runs, args, params)
    tables_md = render(args.size_list, systems, by_size, runs, cores)
    notes = notes_for(args, by_size, cores, total_wall, sum(predicted))
    print(tables_md)
    print()
    print("\n".join(f"- {n}" for n in notes))

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
            "systems": {
                k: {"label": v[0], "kind": v[1], "world": v[2], "options": v[3]}
                for k, v in systems.items()
            },
            "order": [(r, s.name, k) for r, s, k in plan],
        },
        "summary": by_size,
        "runs": runs,
        "estimated_run_s": predicted,
        "estimated_total_s": sum(predicted),
        "total_wall_s": total_wall,
    }
    out = args.out or RESULTS_DIR / f"{name}.json"
    title = "zero3_offload scaling: step time and memory vs model size and ranks"
    json_path, md_path = write_results(out, payload, tables_md, title=title, notes=notes)
    print(f"\nwrote {json_path} and {md_path}")
    if args.plot_path is not None:
        plot(
            args.plot_path,
            args.size_list,
            systems,
            by_size,
            f"{title}\n{machine_line(info)}",
            cores,
        )
        print(f"wrote {args.plot_path}")
    if any(not r["ok"] for r in runs):
        return 1
    return 0 if losses_agree(by_size) else 2


if __name__ == "__main__":
    raise SystemExit(main())
