"""Step time and per-rank memory of zero3_offload vs model size and ranks; plain torch the baseline.

N = 1, 2, 4 gloo ranks and plain torch at each size; ratios to plain torch; docs/scaling.png."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from harness import train, workload
from harness.render import MIB, Col, machine_line, ratio
from harness.systems import System
from harness.train import LOSS_STEPS, LOSS_TOLERANCE

from suites import peers

TITLE = "zero3_offload scaling: step time and memory vs model size and ranks"
PLOT = Path(__file__).resolve().parents[2] / "docs" / "scaling.png"
TORCH = "torch"
# name: d, heads, blocks, warm-up and timed steps (seq 128, global batch 8). Blocks hold
# 12 d² + 10 d parameters; 20M and 300M are the peers suite's small and large models.
SIZES = {"5M": (256, 4, 6, 2, 8), "20M": (512, 8, 6, 2, 6), "80M": (768, 12, 11, 1, 5)}
SIZES["300M"] = (1024, 16, 24, 1, 4)
QUICK_SIZES = {"q20k": (32, 2, 1, 1, 4), "q60k": (64, 2, 1, 1, 4), "q120k": (64, 2, 2, 1, 4)}
QUICK_SIZES["q400k"] = (128, 4, 2, 1, 4)
TAKES = ["rounds", "seed", "timeout", "keep", "mmap_threshold"]
OPTIONS = {
    "--sizes": {"help": f"subset of {', '.join(SIZES)} (quick: {', '.join(QUICK_SIZES)})"},
    "--worlds": {"type": lambda s: sorted({int(w) for w in s.split(",")}), "default": [1, 2, 4]},
    "--torch-threads": {"type": int, "help": "plain torch's threads (default: --threads)"},
    "--plot": {"type": Path, "metavar": "PNG", "help": "plot path (docs/scaling.png; quick: none)"},
    "--no-plot": {"action": "store_true", "help": "write no plot"},
}
DEFAULTS = {"threads": 1, "timeout": 1800.0, "rounds": 1, "seed": 0}  # steps: the size's
QUICK = {"timeout": 300.0}
# fmt: off
DETAIL = [
    Col("size", "size"), Col("system", "label"), Col("ranks x threads", "ranks"),
    Col("median step s", "median_step_s", ".3f"), Col("vs torch", "median_step_s", "x", TORCH),
    Col("speed-up vs N=1", "median_step_s", "/x", "one"),
    Col("CPU s / step", "median_cpu_s", ".3f"), Col("vs torch", "median_cpu_s", "x", TORCH),
    Col("peak RSS / rank MiB", "peak_rss_bytes", "mib"),
    Col("vs torch", "peak_rss_bytes", "x", TORCH),
    Col("sum of rank peaks MiB", "sum_peak_rss_bytes", "mib"),
    Col("RSS after build MiB", "built_rss_bytes", "mib"),
    Col("model state / rank MiB", "model_state_bytes", "mib1"),
    Col("vs torch", "model_state_bytes", "x", TORCH), Col("loss max |diff| vs torch", "loss"),
    Col("runs", "runs", "d"),
]
RUNS = [
    Col("#", "{index}"), Col("round", "round", "d"), Col("size", "size"), Col("system", "label"),
    Col("load avg", "load", ".2f"), Col("median step s", "median_step_s", ".3f", missing="FAILED"),
    Col("CPU s / step", "cpu_s", ".3f"), Col("peak RSS / rank MiB", "peak_rss_bytes", "mib"),
    Col("run wall s", "wall_s", ".1f"),
]
PANELS = [("median_step_s", 1, "median step time (s)")]
PANELS.append(("peak_rss_bytes", MIB, "peak RSS per rank (MiB)"))
PIVOTS = [  # field, scale, format, the paragraph above the table
    ("median_step_s", 1.0, ".3f", "Median step time, s (ratio to plain torch at the same size; "
     "<1 is faster):"),
    ("peak_rss_bytes", MIB, ",.0f", "Peak RSS per rank, MiB (max over ranks; ratio to plain "
     "torch's one process):"),
    ("model_state_bytes", MIB, ",.1f", "Model state per rank, MiB (counted from tensors; ratio to "
     "plain torch):"),
]
# fmt: on


def check(args: Any) -> str | None:
    table = QUICK_SIZES if args.quick else SIZES
    names = args.sizes.split(",") if args.sizes else list(table)
    if unknown := [n for n in names if n not in table]:
        return f"unknown sizes {unknown}; known: {', '.join(table)}"
    if bad := [n for n in args.worlds if n < 1 or 8 % n]:
        return f"the global batch of 8 does not split over {bad} ranks"
    args.size_table, seq = {}, 32 if args.quick else 128
    for name, (d, heads, blocks, warmup, repeats) in ((n, table[n]) for n in names):
        warmup, repeats = warmup if args.warmup is None else args.warmup, args.repeats or repeats
        if warmup < 0 or warmup + repeats < LOSS_STEPS:
            return f"need --warmup >= 0, --warmup + --repeats >= {LOSS_STEPS} (loss check)"
        dims = dict(d=d, heads=heads, n_layers=blocks, seq=seq, global_batch=8)
        args.size_table[name] = {**dims, "warmup": warmup, "timed_steps": repeats}
    args.torch_threads = args.torch_threads or args.threads
    args.plot_path = None if args.no_plot else args.plot or (None if args.quick else PLOT)
    return None


def run(args: Any) -> dict[str, Any]:
    systems = {TORCH: peers.SYSTEMS["torch"]}
    for n in args.worlds:
        systems[f"ours_n{n}"] = System(f"zero3_offload N={n}", "zero3_offload", n, {})
    sizes, started = args.size_table, time.perf_counter()
    sizes = {n: {**s, "params": sum(workload.layer_params(s).values())} for n, s in sizes.items()}
    threads = {k: args.torch_threads if k == TORCH else args.threads for k in systems}
    runs = train.train_runs(args, systems, sizes, threads)
    config = {"model": workload.MODEL, "sizes": sizes, "worlds": args.worlds, "rounds": args.rounds}
    config.update(threads_per_rank=args.threads, torch_threads=args.torch_threads, seed=args.seed)
    config.update(lr=train.LR, weight_decay=train.WEIGHT_DECAY, corpus=workload.corpus_info())
    config["malloc_mmap_threshold"] = args.mmap_threshold
    config["systems"] = {k: s._asdict() for k, s in systems.items()}
    by_size = {}
    for name, size in sizes.items():  # no loss check without a plain-torch run
        got = train.summarize(runs, config["systems"], name)
        got["agreement"] = got["agreement"] if TORCH in got["systems"] else None
        by_size[name] = {"params": size["params"], **got}
    done = [b for b in by_size.values() if len(b["systems"]) == len(systems) and b["agreement"]]
    agree = len(done) == len(by_size) and all(b["agreement"]["agree"] for b in done)
    out = {"config": config}
    out.update(sizes=by_size, runs=[train.run_row(r) for r in runs], losses_agree=agree)
    out["failed"] = [f"{r['size']} {r['key']}: {r['error']}" for r in runs if not r["ok"]]
    return {**out, "total_wall_s": time.perf_counter() - started}


def layout(p: dict[str, Any]) -> list:
    systems, cores = p["config"]["systems"], p["machine"]["usable_cores"]
    blocks, heads = [], [Col(s["label"], k) for k, s in systems.items()]
    for field, scale, digits, title in PIVOTS:  # per size (rows) and system, ratio to torch's
        rows = []
        for name, b in p["sizes"].items():
            base = b["systems"].get(TORCH, {}).get(field)
            rows.append({"size": name, "params": f"{b['params']:,}"})
            for key, s in b["systems"].items():
                cell = f"{s[field] / scale:{digits}}"
                rows[-1][key] = cell if key == TORCH else f"{cell} ({ratio(s[field], base)})"
        blocks += [title, ([Col("size", "size"), Col("params", "params"), *heads], rows)]
    detail = []
    for name, b in p["sizes"].items():
        per = b["systems"]
        for key, s in per.items():
            over = " (oversubscribed)" if s["world_size"] * s["threads_per_rank"] > cores else ""
            row = {**s, "size": name, "ranks": f"{s['world_size']} x {s['threads_per_rank']}{over}"}
            row["loss"] = "no reference" if b["agreement"] is None else f"{s['loss_max_diff']:.1e}"
            row["loss"] += " (not finite)" * (b["agreement"] is not None and not s["loss_finite"])
            one = {} if key == TORCH else per.get("ours_n1", {})
            row.update({TORCH: per.get(TORCH, {}), "one": one})
            detail.append(row)
    runs = [{**r, "index": r["index"] + 1, "label": systems[r["key"]]["label"]} for r in p["runs"]]
    title = "Runs in the order they ran (1-minute load average at each run's start):"
    return [*blocks, "All figures:", (DETAIL, detail), title, (RUNS, runs)]


def oversubscribed(p: dict[str, Any]) -> str:
    cores, threads = p["machine"]["usable_cores"], p["config"]["threads_per_rank"]
    over = ", ".join(f"N={n}" for n in p["config"]["worlds"] if n * threads > cores) or "none"
    return (
        f"Machine: {cores} usable cores. Oversubscribed (more busy threads than cores: its step "
        f"time shows the cost of more ranks on the same cores, not of more hardware): {over}."
    )


def sizes_note(p: dict[str, Any]) -> str:
    sizes = "; ".join(
        f"{name}: d={s['d']}, {s['heads']} heads, {s['n_layers']} block(s), seq {s['seq']} = "
        f"{s['params']:,} params, {s['warmup']} warm-up + {s['timed_steps']} timed steps"
        for name, s in p["config"]["sizes"].items()
    )
    return f"Model: {p['config']['model']} (byte vocabulary 256), fp32. {sizes}."


NOTES = [
    sizes_note,
    "Global batch 8 windows per step for every N (each rank takes its contiguous share), the "
    "same batches ({config[corpus][description]}, sha256 {config[corpus][sha256]:.12}) and seed "
    "{config[seed]} for every system.",
    "AdamW lr {config[lr]}, betas (0.9, 0.999), eps 1e-8, weight decay {config[weight_decay]}. "
    "Plain torch: 1 process x {config[torch_threads]} torch thread(s), "
    "torch.optim.AdamW(fused=True), whole batch. zero3_offload: Zero3CpuOffloadManager, "
    "default config, gloo, N ranks x {config[threads_per_rank]} torch thread(s).",
    oversubscribed,
    "{config[rounds]} round(s), every run on fresh processes; order, columns and method as "
    f"docs/benchmarks.md (scaling) defines them. Losses: all finite and the first {LOSS_STEPS} of "
    f"every run within {LOSS_TOLERANCE:g} of plain torch's: {{losses_agree}}. glibc's "
    "MALLOC_MMAP_THRESHOLD_ in every process: {config[malloc_mmap_threshold]:or_default}.",
    "Whole benchmark {total_wall_s:.0f} s wall.",
]


def plot(p: dict[str, Any], path: Path) -> None:
    """Two log-log panels against parameters: median step time; peak RSS per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (field, scale, y_label) in zip(axes, PANELS, strict=True):
        for key, system in p["config"]["systems"].items():
            got = [(b["params"], b["systems"].get(key)) for b in p["sizes"].values()]
            xs, ys = [n for n, s in got if s], [s[field] / scale for _, s in got if s]
            ax.plot(xs, ys, label=system["label"], marker="s" if key == TORCH else "o")
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel=y_label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{TITLE}\n{machine_line(p['machine'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
