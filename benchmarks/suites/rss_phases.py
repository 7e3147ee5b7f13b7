"""Where a zero3_offload step's resident memory peaks: per phase, and per layer of the backward.

A diagnostic: 2 gloo ranks in several configurations, each rank's RSS sampled from outside every
2 ms; the samples lined up with each step's phases (their wall-clock starts) and, in the last
step's backward, with each layer's compute (the `work` events of the rank's JSON log, read with
zero3_offload.analyze): RSS at the start of the layer's backward and its peak during it.
"""

from __future__ import annotations

import bisect
from typing import Any

from harness import train
from harness.render import Col, mib
from harness.systems import System

from zero3_offload.analyze import read_logs

TUNED = {"lr_in_backward": True, "prefetch_buffer_size": 1}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "lr-in-backward": {"lr_in_backward": True},
    "lr-in-backward+depth1": TUNED,
    "ckpt+lr-in-backward+depth1": {**TUNED, "activation_checkpointing": True},
}
OPTIONS = {
    "--blocks": {"type": int, "default": 8, "help": "transformer blocks (8; 24 = the 303M model)"},
    "--configs": {"default": ",".join(CONFIGS), "help": f"subset of {', '.join(CONFIGS)}"},
}
DEFAULTS = dict(repeats=3, warmup=0, threads=1, rounds=1, seed=0, timeout=3600)
DEFAULTS["mmap_threshold"] = 2**20  # glibc's threshold as `zero3-offload train` sets it
TITLE = "RSS by phase (zero3_offload, rank 0)"
COUNTED = ["activations", "gathered", "in flight", "pool", "grad shards", "state"]  # earlier runs
TRACE = [
    Col("layer", "layer"),
    Col("RSS", "rss", "mib"),
    Col("peak RSS in its backward", "peak", "mib"),
    *(Col(k, k, "mib") for k in COUNTED),
    Col("RSS - counted - grad buffers", "uncounted", "mib"),
]


def check(args: Any) -> str | None:
    args.warmup, args.repeats = 0, args.warmup + args.repeats  # every step is sampled
    args.config_list = args.configs.split(",")
    if unknown := [c for c in args.config_list if c not in CONFIGS]:
        return f"unknown configs {unknown}"
    return "--blocks must be >= 1" if args.blocks < 1 else None


def read(rank: dict[str, Any]) -> dict[str, Any]:
    """A rank's samples lined up with its steps' phases (peak RSS per phase) and with its log's
    `work` events (the last step's backward, layer by layer); the samples are dropped."""
    samples, steps = rank.pop("samples"), rank["steps"]
    times, rss = [s[0] for s in samples], [s[1] for s in samples]
    bounds = [(0.0, "setup")]  # (start, phase): every phase of every step, then what follows
    for i, step in enumerate(steps):
        t = step["t0"]
        for key in [k for k in step if k.endswith("_s") and k not in ("cpu_s", "step_s")]:
            bounds.append((t, f"{key[:-2]} {i}"))
            t += step[key]
    bounds.append((steps[-1]["t0"] + steps[-1]["step_s"], "after"))
    peaks: dict[str, int] = {}
    starts = [b[0] for b in bounds]
    for t, value in zip(times, rss, strict=True):
        phase = bounds[bisect.bisect_right(starts, t) - 1][1]
        peaks[phase] = max(peaks.get(phase, 0), value)
    trace = []
    work = read_logs([rank["log"]]).work
    last = [
        w
        for w in work
        if w.kind == "compute" and w.phase == "backward" and w.step == len(steps) - 1
    ]
    for w in sorted(last, key=lambda w: w.start):
        lo, hi = bisect.bisect_right(times, w.start), bisect.bisect_right(times, w.end)
        if lo:
            trace.append(
                {"layer": w.layer, "rss": rss[lo - 1], "peak": max(rss[lo - 1 : max(hi, lo)])}
            )
    return {"peaks": peaks, "trace": trace}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's figures of each run."""
    out = []
    for r in runs:
        rank0 = r["ranks"][0]
        buffers = rank0.get(
            "gradient_buffers", rank0.get("library_memory_stats", {}).get("gradient_buffer_bytes")
        )
        row = {
            "key": r["key"],
            "wall_s": r["wall_s"],
            "peaks": rank0["peaks"],
            "gradient_buffers": buffers,
        }
        row.update(model_state=rank0["model_state"]["total"], trace=rank0["trace"])
        for t in row["trace"]:  # earlier runs: what the library counted there, and the rest
            if "state" in t:
                t["uncounted"] = t["rss"] - sum(t[k] for k in COUNTED) - buffers
        out.append(row)
    return out


def run(args: Any) -> dict[str, Any] | None:
    dims = dict(d=1024, heads=16, n_layers=args.blocks, seq=128, global_batch=8)
    if args.quick:
        dims.update(d=128, heads=4, n_layers=2, seq=32)
    systems = {name: System(name, "zero3_offload", 2, CONFIGS[name]) for name in args.config_list}
    spec = {"log": True, "read": "suites.rss_phases:read"}
    compared = train.compare(args, systems, dims, threads=dict.fromkeys(systems, 1), spec=spec)
    if compared["skipped"]:  # a run failed
        return None
    config = {**compared["config"], "ranks": 2, "malloc_mmap_threshold": args.mmap_threshold}
    name = "rss-phases-quick" if args.quick else f"rss-phases-{args.blocks}blocks"
    return {"benchmark": name, "config": config, "runs": summarize(compared["runs"])}


def layout(p: dict[str, Any]) -> list:
    blocks: list = []
    for r in p["runs"]:
        peaks = ", ".join(f"{phase} {mib(peak)}" for phase, peak in r["peaks"].items())
        blocks.append(
            f"{r['key']} ({r['wall_s']:.0f} s): peak RSS MiB per phase: {peaks}; model state "
            f"{mib(r['model_state'])} MiB; flat gradient buffers {mib(r['gradient_buffers'])} MiB."
        )
        blocks += [(TRACE, r["trace"])] if r["trace"] else []
    return blocks


NOTES = [
    "GPT d={config[dims][d]}, {config[dims][heads]} heads, {config[dims][n_layers]} blocks, seq "
    "{config[dims][seq]}, global batch {config[dims][global_batch]}; 2 gloo ranks x 1 thread, "
    "MALLOC_MMAP_THRESHOLD_={config[malloc_mmap_threshold]}; rank 0's figures; {config[steps]} "
    "steps. Phases, trace and the last column as docs/benchmarks.md (rss-phases) describes them."
]
