"""Step time on 2 gloo ranks with async_prefetch on vs off, and how much communication shows.

Runs alternate (ABBA); get_performance_stats() over every step: compute, collectives, hits."""

from __future__ import annotations

import statistics
from typing import Any

from harness import train
from harness.render import Col
from harness.systems import System

WORLD, LR, SEQ = 2, 1e-3, 12
OFF, ON = "prefetch off", "prefetch on"
OPTIONS = {
    "--d": {"type": int, "help": "model width"},
    "--heads": {"type": int, "help": "attention heads"},
    "--blocks": {"type": int, "help": "transformer blocks"},
    "--batch": {"type": int, "help": "global batch, split over 2 ranks"},
    "--buffer": {"type": int, "default": 2, "help": "prefetch_buffer_size when on"},
}
TAKES = ["rounds", "seed", "timeout"]
DEFAULTS = dict(repeats=8, warmup=3, threads=1, d=384, heads=6, blocks=6, batch=32, rounds=4)
DEFAULTS.update(seed=0, timeout=900.0)
QUICK = dict(repeats=5, warmup=2, d=64, heads=4, blocks=2, batch=8, rounds=2)
TITLE = "Prefetch overlap ({config[world_size]} gloo ranks, step time and exposed communication)"
# fmt: off
MAIN = [
    Col("config", "name"), Col("median t_step s", "t_step_s", ".4f"),
    Col("off / this", "{speedup:.3f}x"), Col("t_compute_only s", "t_compute_only_s", ".4f"),
    Col("exposed s", "exposed_s", ".4f"), Col("t_comm s (library)", "t_comm_s", ".4f"),
    Col("exposed / t_comm", "exposed_fraction", ".2f"),
    Col("hit rate (full)", "{hit_rate:.0%} ({full_hit_rate:.0%})"),
]
BREAKDOWN = [
    Col("config", "name"),
    *(Col(h, k, ".4f") for h, k in [
        ("forward call s", "forward_call_s"), ("fwd compute s", "compute_forward_s"),
        ("loss s", "loss_s"), ("backward call s", "backward_call_s"),
        ("bwd compute s", "compute_backward_s"), ("optimizer_step s", "optimizer_call_s")]),
    *(Col(f"{op} s (n)", f"{{communication[{op}][time_s]:.4f}} "
          f"({{communication[{op}][operations]:g}})") for op in ("all_gather", "reduce_scatter")),
    Col("gather intervals s", "gather_intervals_s", ".4f"),
    Col("grad-accumulate jobs s", "grad_accumulate_jobs_s", ".4f"),
]
ROUNDS = [
    Col("round", "round", "d"), Col("order", "{first} first"),
    Col("off median step s", "off", ".4f"), Col("on median step s", "on", ".4f"),
    Col("off / on", "{ratio:.3f}x"),
]
# fmt: on
CALLS = {"forward_call_s": "forward_s", "loss_s": "loss_s", "backward_call_s": "backward_s"}
CALLS.update(optimizer_call_s="optimizer_s", snapshot_s="snapshot_s")  # clock phases
FIELDS = ("operations", "time_s")  # of a collective, per step
SPANS = {"gather_intervals_s": "gather", "grad_accumulate_jobs_s": "grad-accumulate"}


def check(args: Any) -> str | None:
    if args.d % args.heads or args.batch % WORLD or min(args.rounds, args.buffer, args.blocks) < 1:
        return "need --d divisible by --heads, an even --batch, and rounds/buffer/blocks >= 1"
    return None


def derive(rec: dict[str, Any]) -> dict[str, Any]:
    """A timed step's figures, from its clock record and the library's stats over it."""
    st, ops = rec["stats"], rec["stats"]["communication"]
    comm = {op: {"operations": c["operations"], "time_s": c["time"]} for op, c in ops.items()}
    pre, spans, t_comm = st["prefetch"], st["spans"], sum(c["time_s"] for c in comm.values())
    uses = pre["hits"] + pre["partial_hits"] + pre["misses"]
    fwd, bwd = spans.get("compute forward", 0.0), spans.get("compute backward", 0.0)
    out = {"t_step_s": rec["step_s"], "t_compute_only_s": fwd + bwd + st["optimizer_s"]}
    out.update(compute_forward_s=fwd, compute_backward_s=bwd, optimizer_s=st["optimizer_s"])
    out.update(t_comm_s=t_comm, exposed_s=rec["step_s"] - out["t_compute_only_s"])
    out["exposed_fraction"] = out["exposed_s"] / t_comm if t_comm > 0 else float("nan")
    out.update({k: rec[phase] for k, phase in CALLS.items()})
    for name, kind in SPANS.items():
        out[name] = sum(v for k, v in spans.items() if k.startswith(f"{kind} "))
    out["hit_rate"] = (pre["hits"] + pre["partial_hits"]) / uses if uses else 0.0
    out["full_hit_rate"] = pre["hits"] / uses if uses else 0.0
    return {**out, "communication": comm}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration the medians over the timed steps of both ranks and all runs; per round."""
    configs, median = {}, statistics.median
    for key in (OFF, ON):
        steps = [s for run in runs if run["key"] == key for rank in train.timed(run) for s in rank]
        ss = [derive(s) for s in steps]
        m = {k: median(s[k] for s in ss) for k, v in ss[0].items() if not isinstance(v, dict)}
        m["communication"] = {}
        for op in sorted({op for s in ss for op in s["communication"]}):
            got = [s["communication"].get(op, {}) for s in ss]
            m["communication"][op] = {f: median(c.get(f, 0) for c in got) for f in FIELDS}
        configs[key] = {"name": key, **m, "samples": len(ss)}
    for m in configs.values():
        m["speedup"] = configs[OFF]["t_step_s"] / m["t_step_s"]
    rounds = []
    for r in sorted({run["round"] for run in runs}):
        by = {run["key"]: train.run_median(run) for run in runs if run["round"] == r}
        rounds.append({"round": r, "first": next(iter(by)), "off": by[OFF], "on": by[ON]})
        rounds[-1]["ratio"] = by[OFF] / by[ON]
    losses = [[s["loss"] for s in run["ranks"][0]["steps"]] for run in runs]
    threads = sorted({rk["torch_threads"] for run in runs for rk in run["ranks"]})
    out = {"configs": configs, "rounds": rounds, "ranks_threads": threads}
    return {**out, "losses_identical": all(ls == losses[0] for ls in losses)}


def run(args: Any) -> dict[str, Any] | None:
    dims = dict(d=args.d, heads=args.heads, n_layers=args.blocks, seq=SEQ, global_batch=args.batch)
    systems = {}
    for key in (OFF, ON):
        options = {"async_prefetch": key == ON, "prefetch_buffer_size": args.buffer}
        systems[key] = System(key, "zero3_offload", WORLD, options)
    spec = {"stats": True, "lr": LR, "weight_decay": 0.0}
    config = dict(world_size=WORLD, threads_per_rank=args.threads, buffer=args.buffer)
    threads = dict.fromkeys(systems, args.threads)
    part, runs = train.compare(args, systems, dims, threads, spec=spec, **config)
    if part["skipped"]:  # a run failed
        return None
    return {"config": part["config"], **summarize(runs), "total_wall_s": part["total_wall_s"]}


def layout(p: dict[str, Any]) -> list:
    breakdown = "Per-step breakdown (medians; 'n' = collectives per step):"
    rounds = "Per round (median step of each run; drift of the machine shows here):"
    configs = p["configs"]
    return [(MAIN, configs), breakdown, (BREAKDOWN, configs), rounds, (ROUNDS, p["rounds"])]


NOTES = [
    "{config[model]} d={config[dims][d]}, heads={config[dims][heads]}, {config[dims][n_layers]} "
    "blocks, {config[params]:,} fp32 params in {config[layers]} layers (largest "
    "{config[largest_layer]:,}); global batch {config[dims][global_batch]} (x {config[dims][seq]} "
    "tokens) split over the ranks; AdamW lr {config[lr]}.",
    "{config[world_size]} gloo ranks on this machine, {config[threads_per_rank]} torch thread per "
    "rank (ranks saw {ranks_threads}), cpu_worker_threads 2, fp32, no compression.",
    "'prefetch off': async_prefetch=False; 'prefetch on': async_prefetch=True, "
    "prefetch_buffer_size={config[buffer]}. {config[rounds]} rounds, ABBA order, each run "
    "{config[warmup]} warm-up + {config[steps]} timed steps; medians over "
    "{configs[prefetch off][samples]} samples per config (timed steps x 2 ranks x runs).",
    "prefetch on: {configs[prefetch on][speedup]:.3f}x the speed of off; the stats snapshot in "
    "every step took {configs[prefetch on][snapshot_s]:us} us (median); columns as "
    "docs/benchmarks.md (overlap) defines them; losses identical across all runs of both "
    "configs: {losses_identical}; whole benchmark {total_wall_s:.0f} s wall.",
]
