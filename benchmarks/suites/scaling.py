"""Step time and per-rank memory of zero3_offload vs model size and ranks; plain torch the baseline.

At each size: zero3_offload on N = 1, 2, 4 gloo ranks and plain single-process torch, the global
batch the same for every N; tables with ratios to plain torch, and the plot docs/scaling.png.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from harness import train, workload
from harness.plan import progress
from harness.report import MIB, Report, cols, machine_line, markdown_table, mib, ratio
from harness.systems import System

from suites import peers

TITLE = "zero3_offload scaling: step time and memory vs model size and ranks"
PLOT = Path(__file__).resolve().parents[2] / "docs" / "scaling.png"
TORCH = "torch"
# name: d, heads, blocks, warm-up and timed steps (seq 128, global batch 8). Blocks hold
# 12 d² + 10 d parameters; 20M and 300M are the peers suite's small and large models.
SIZES = {
    "5M": (256, 4, 6, 2, 8),
    "20M": (512, 8, 6, 2, 6),
    "80M": (768, 12, 11, 1, 5),
    "300M": (1024, 16, 24, 1, 4),
}
QUICK_SIZES = {
    "q20k": (32, 2, 1, 1, 4),
    "q60k": (64, 2, 1, 1, 4),
    "q120k": (64, 2, 2, 1, 4),
    "q400k": (128, 4, 2, 1, 4),
}
OPTIONS = {
    "--sizes": {"help": f"subset of {', '.join(SIZES)} (quick: {', '.join(QUICK_SIZES)})"},
    "--worlds": {"default": "1,2,4", "help": "numbers of gloo ranks of ours (1,2,4)"},
    "--torch-threads": {"type": int, "help": "plain torch's threads (default: --threads)"},
    "--rounds": {"type": int, "default": 1, "help": "runs of every size and system (1)"},
    "--seed": {"type": int, "default": 0, "help": "model seed (0)"},
    "--timeout": {"type": float, "help": "seconds per run (1800; quick 300)"},
    "--plot": {"type": Path, "metavar": "PNG", "help": "plot path (docs/scaling.png; quick: none)"},
    "--no-plot": {"action": "store_true", "help": "write no plot"},
    **train.RANK_OPTIONS,
}
DEFAULTS, QUICK = {"threads": 1, "timeout": 1800.0}, {"timeout": 300.0}
EPILOG = (
    "--repeats/--warmup: timed/untimed steps per run (per size); --threads: per rank of ours (1)"
)


def check(args: Any) -> str | None:
    table = QUICK_SIZES if args.quick else SIZES
    names = args.sizes.split(",") if args.sizes else list(table)
    if unknown := [n for n in names if n not in table]:
        return f"unknown sizes {unknown}; known: {', '.join(table)}"
    try:
        args.world_list = sorted({int(w) for w in args.worlds.split(",")})
    except ValueError:
        return f"--worlds must be comma-separated integers, not {args.worlds!r}"
    if bad := [n for n in args.world_list if n < 1 or 8 % n]:
        return f"the global batch of 8 does not split over {bad} ranks"
    args.size_table = {}
    for name in names:
        d, heads, blocks, warmup, repeats = table[name]
        warmup = warmup if args.warmup is None else args.warmup
        repeats = args.repeats or repeats
        if warmup < 0 or warmup + repeats < train.LOSS_STEPS:
            return f"need --warmup >= 0, --warmup + --repeats >= {train.LOSS_STEPS} (loss check)"
        dims = dict(
            d=d, heads=heads, n_layers=blocks, seq=32 if args.quick else 128, global_batch=8
        )
        args.size_table[name] = {**dims, "warmup": warmup, "timed_steps": repeats}
    args.torch_threads = args.torch_threads or args.threads
    if min(args.threads, args.torch_threads, args.rounds) < 1:
        return "--threads, --torch-threads and --rounds must be >= 1"
    args.plot_path = None if args.no_plot else args.plot or (None if args.quick else PLOT)
    return None


def run(args: Any) -> dict[str, Any]:
    systems = {TORCH: peers.SYSTEMS["torch"]}
    for n in args.world_list:
        systems[f"ours_n{n}"] = System(f"zero3_offload N={n}", "zero3_offload", n, {})
    sizes = {}
    for name, size in args.size_table.items():
        per_layer = workload.layer_params(size)
        sizes[name] = {**size, "params": sum(per_layer.values()), "layer_params": per_layer}
    threads = {k: args.torch_threads if k == TORCH else args.threads for k in systems}
    progress("sizes: " + ", ".join(f"{n} = {s['params']:,} params" for n, s in sizes.items()))
    started = time.perf_counter()
    runs = train.train_runs(args, systems, sizes, threads)
    name = ("scaling-quick" if args.quick else "scaling") + ("-mmap" if args.mmap_threshold else "")
    config = {
        "model": workload.MODEL,
        "sizes": sizes,
        "worlds": args.world_list,
        "threads_per_rank": args.threads,
        "torch_threads": args.torch_threads,
        "rounds": args.rounds,
        "lr": train.LR,
        "weight_decay": train.WEIGHT_DECAY,
        "seed": args.seed,
        "malloc_mmap_threshold": args.mmap_threshold,
        "corpus": workload.corpus_info(),
        "systems": {k: s._asdict() for k, s in systems.items()},
    }
    total = time.perf_counter() - started
    payload = {"benchmark": name, "config": config, "runs": runs, "total_wall_s": total}
    failed = [f"{r['size']} {r['key']}: {r['error']}" for r in runs if not r["ok"]]
    return {**payload, "failed": failed, "losses_agree": losses_agree(payload)}


def by_size(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per size: its parameters, the systems' summaries and their loss check against plain torch
    (none without a plain-torch run)."""
    out = {}
    for name, size in payload["config"]["sizes"].items():
        systems = train.summarize(payload, name)
        losses = train.loss_agreement(systems) if TORCH in systems else None
        out[name] = {"params": size["params"], "systems": systems, "losses": losses}
    return out


def losses_agree(payload: dict[str, Any]) -> bool:
    """Whether every planned size and system ran and passed the loss check."""
    planned = len(payload["config"]["systems"])
    return all(
        b["losses"] and b["losses"]["agree"] and len(b["systems"]) == planned
        for b in by_size(payload).values()
    )


def report(payload: dict[str, Any]) -> Report:
    summary, systems = by_size(payload), payload["config"]["systems"]
    cores = payload["machine"]["usable_cores"] or 1

    def pivot(field: str, scale: float, digits: str) -> str:
        """``field`` per size (rows) and system (columns), with its ratio to plain torch's."""
        rows = []
        for name, b in summary.items():
            per, base = b["systems"], b["systems"].get(TORCH, {}).get(field)
            cells = [
                "-"
                if key not in per
                else f"{per[key][field] / scale:{digits}}"
                + ("" if key == TORCH else f" ({ratio(per[key][field], base)})")
                for key in systems
            ]
            rows.append([name, f"{b['params']:,}", *cells])
        return markdown_table(["size", "params", *(s["label"] for s in systems.values())], rows)

    def vs(s: dict[str, Any], ref: dict[str, Any], field: str) -> str:
        return ratio(s[field], ref.get(field))

    detail = []
    for name, b in summary.items():
        ref, one = b["systems"].get(TORCH, {}), b["systems"].get("ours_n1")
        for key, s in b["systems"].items():
            check = b["losses"]["systems"][key] if b["losses"] else None
            loss = "no reference" if check is None else f"{check['max_diff']:.1e}"
            loss += "" if check is None or check["finite"] else " (not finite)"
            over = " (oversubscribed)" if s["world_size"] * s["threads_per_rank"] > cores else ""
            step = s["median_step_s"]
            detail.append(
                [
                    name,
                    s["label"],
                    f"{s['world_size']} x {s['threads_per_rank']}{over}",
                    f"{step:.3f}",
                    vs(s, ref, "median_step_s"),
                    "-" if key == TORCH or one is None else ratio(one["median_step_s"], step),
                    f"{s['median_cpu_s']:.3f}",
                    vs(s, ref, "median_cpu_s"),
                    mib(s["peak_rss_bytes"]),
                    vs(s, ref, "peak_rss_bytes"),
                    mib(s["sum_peak_rss_bytes"]),
                    mib(s["built_rss_bytes"]),
                    mib(s["model_state_bytes"], 1),
                    vs(s, ref, "model_state_bytes"),
                    loss,
                    str(s["runs"]),
                ]
            )
    runs = []
    for r in payload["runs"]:
        ok, load = r["ok"], r.get("load_average_at_start")
        which = [str(r["index"] + 1), str(r["round"]), r["size"], systems[r["key"]]["label"]]
        step = f"{train.run_median(r):.3f}" if ok else "FAILED"
        cpu = f"{statistics.median(train.step_cpu(r)):.3f}" if ok else "-"
        rss = mib(max(rk["peak_rss_bytes"] for rk in r["ranks"])) if ok else "-"
        runs.append(
            [*which, f"{load[0]:.2f}" if load else "-", step, cpu, rss, f"{r['wall_s']:.1f}"]
        )
    d_headers = cols(
        "size; system; ranks x threads; median step s; vs torch; speed-up vs N=1; CPU s / step; "
        "vs torch; peak RSS / rank MiB; vs torch; sum of rank peaks MiB; RSS after build MiB; "
        "model state / rank MiB; vs torch; loss max |diff| vs torch; runs"
    )
    r_headers = cols(
        "#; round; size; system; load avg; median step s; CPU s / step; peak RSS / rank MiB; "
        "run wall s"
    )
    tables = "\n\n".join(
        [
            "Median step time, s (ratio to plain torch at the same size; <1 is faster):",
            pivot("median_step_s", 1.0, ".3f"),
            "Peak RSS per rank, MiB (max over ranks; ratio to plain torch's one process):",
            pivot("peak_rss_bytes", MIB, ",.0f"),
            "Model state per rank, MiB (counted from tensors; ratio to plain torch):",
            pivot("model_state_bytes", MIB, ",.1f"),
            "All figures:",
            markdown_table(d_headers, detail),
            "Runs in the order they ran (1-minute load average at each run's start):",
            markdown_table(r_headers, runs),
        ]
    )
    cfg = payload["config"]
    sizes = "; ".join(
        f"{name}: d={s['d']}, {s['heads']} heads, {s['n_layers']} block(s), seq {s['seq']} = "
        f"{s['params']:,} params, {s['warmup']} warm-up + {s['timed_steps']} timed steps"
        for name, s in cfg["sizes"].items()
    )
    threads, mmap = cfg["threads_per_rank"], cfg["malloc_mmap_threshold"]
    over = ", ".join(str(n) for n in cfg["worlds"] if n * threads > cores)
    oversubscribed = "No configuration is oversubscribed."
    if over:
        oversubscribed = (
            f"N={over} runs more busy threads than cores (oversubscribed): its ranks share the "
            "cores, so its step time shows the cost of more ranks on the same cores, not of more "
            "hardware."
        )
    agree = losses_agree(payload)
    unchecked = "" if agree else " (or a system has no run to check)"
    malloc = f"MALLOC_MMAP_THRESHOLD_={mmap}" if mmap else "defaults"
    notes = [
        f"Model: {cfg['model']} (byte vocabulary 256), fp32. {sizes}.",
        "Global batch 8 windows per step for every N (each rank takes its contiguous share), the "
        f"same batches ({cfg['corpus']['description']}, sha256 {cfg['corpus']['sha256'][:12]}) "
        f"and seed {cfg['seed']} for every system.",
        f"AdamW lr {cfg['lr']}, betas (0.9, 0.999), eps 1e-8, weight decay {cfg['weight_decay']}. "
        f"Plain torch: 1 process x {cfg['torch_threads']} torch thread(s), "
        "torch.optim.AdamW(fused=True), whole batch. zero3_offload: Zero3CpuOffloadManager, "
        f"default config, gloo, N ranks x {threads} torch thread(s).",
        f"Machine: {cores} usable cores. {oversubscribed}",
        f"Each run: fresh processes. {cfg['rounds']} round(s); within a size the order of the "
        "systems is rotated by one per size and round. Columns as docs/benchmarks.md (scaling) "
        "defines them.",
        f"Losses: all finite and the first {train.LOSS_STEPS} of every run within "
        f"{train.LOSS_TOLERANCE:g} of plain torch's: {agree}{unchecked}.",
        f"glibc malloc: {malloc} in every process.",
        f"Whole benchmark {payload['total_wall_s']:.0f} s wall.",
    ]
    return Report(TITLE, tables, notes)


def plot(payload: dict[str, Any], path: Path) -> None:
    """Two log-log panels against parameters: median step time; peak RSS per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, cores = by_size(payload), payload["machine"]["usable_cores"] or 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for key, system in payload["config"]["systems"].items():
        label = system["label"]
        if key != TORCH and system["world"] > cores:
            label += f" ({system['world']} ranks on {cores} cores)"
        pts = [(b["params"], b["systems"][key]) for b in summary.values() if key in b["systems"]]
        style = (
            {"color": "k", "linestyle": "--", "marker": "s"} if key == TORCH else {"marker": "o"}
        )
        for ax, (field, scale) in zip(
            axes, (("median_step_s", 1), ("peak_rss_bytes", MIB)), strict=True
        ):
            ax.plot([p for p, _ in pts], [s[field] / scale for _, s in pts], label=label, **style)
    labels = ("median step time (s)", "peak RSS per rank (MiB, VmHWM)")
    for ax, y_label in zip(axes, labels, strict=True):
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel=y_label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{TITLE}\n{machine_line(payload['machine'])}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
