"""Step time on 2 gloo ranks with async_prefetch on vs off, and how much communication shows.

The same GPT, data and seed for both, runs alternating over rounds (ABBA); the library's stats,
snapshotted in every step, give compute, collective and exposed time and the prefetch hit rate.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import torch
from harness import train
from harness.report import Report, cols, markdown_table
from harness.systems import System

WORLD, LR, ISO_REPEATS, SEQ = 2, 1e-3, 5, 12
OFF, ON = "prefetch off", "prefetch on"
COMM_FIGURES = ("operations", "time_s")  # of each kind of collective, in the breakdown


OPTIONS = {
    "--d": {"type": int, "help": "model width (384; quick 64)"},
    "--heads": {"type": int, "help": "attention heads (6; quick 4)"},
    "--blocks": {"type": int, "help": "transformer blocks (6; quick 2)"},
    "--batch": {"type": int, "help": "global batch, split over 2 ranks (32; quick 8)"},
    "--rounds": {"type": int, "help": "rounds of both configurations, ABBA (4; quick 2)"},
    "--buffer": {"type": int, "default": 2, "help": "prefetch_buffer_size when on (2)"},
    "--seed": {"type": int, "default": 0, "help": "model and data seed (0)"},
    "--timeout": {"type": float, "default": 900.0, "help": "seconds per run (900)"},
}
DEFAULTS = dict(repeats=8, warmup=3, threads=1, d=384, heads=6, blocks=6, batch=32, rounds=4)
QUICK = dict(repeats=5, warmup=2, d=64, heads=4, blocks=2, batch=8, rounds=2)
EPILOG = "--repeats/--warmup: timed/untimed steps per run (8/3; quick 5/2); --threads: per rank (1)"


def check(args: Any) -> str | None:
    if args.d % args.heads or args.batch % WORLD or min(args.rounds, args.buffer, args.blocks) < 1:
        return "need --d divisible by --heads, an even --batch, and rounds/buffer/blocks >= 1"
    return None


def _span(events: list[Any], kind: str, phase: str | None = None) -> float:
    return sum(e.end - e.start for e in events if e.kind == kind and phase in (None, e.phase))


async def isolated_comm(manager: Any) -> dict[str, dict[str, float]]:
    """Median seconds of each layer's all-gather and reduce-scatter, run alone."""
    comm, out = manager.engine.comm, {"all_gather": {}, "reduce_scatter": {}}
    for name, layout in manager.engine.layouts.items():
        if not layout.padded_numel:
            continue
        full, shard = torch.zeros(layout.padded_numel), torch.zeros(layout.shard_numel)
        gather, scatter = comm.all_gather, comm.reduce_scatter_mean
        ops = {
            "all_gather": partial(gather, full, shard),
            "reduce_scatter": partial(scatter, shard, full),
        }
        for op, call in ops.items():
            samples = []
            for _ in range(ISO_REPEATS + 1):  # the first one warms up
                t0 = time.perf_counter()
                await call()
                samples.append(time.perf_counter() - t0)
            out[op][name] = statistics.median(samples[1:])
    return out


def derive(rec: dict[str, Any], prev: Any, snap: Any, iso: dict[str, Any]) -> dict[str, Any]:
    """A timed step's figures, from its clock record and the stats before and after it."""
    events = snap.timeline[len(prev.timeline) :]  # recorded during this step
    comm = {}
    for op, c in snap.communication.items():
        p = prev.communication.get(op, type(c)())
        comm[op] = {
            "operations": c.operations - p.operations,
            "time_s": c.time - p.time,
            "bytes": c.bytes - p.bytes,
        }
    pre = {k: v - prev.prefetch.get(k, 0) for k, v in snap.prefetch.items()}  # the counters
    uses = pre["hits"] + pre["partial_hits"] + pre["misses"]
    fwd, bwd = _span(events, "compute", "forward"), _span(events, "compute", "backward")
    compute = fwd + bwd + snap.total_optimizer_time - prev.total_optimizer_time
    gathered = [e.layer for e in events if e.kind == "gather"]
    t_comm = sum(c["time_s"] for c in comm.values())
    t_iso = sum(iso["all_gather"][n] for n in gathered) + sum(iso["reduce_scatter"].values())
    exposed = rec["step_s"] - compute
    return {
        "t_step_s": rec["step_s"],
        "t_compute_only_s": compute,
        "compute_forward_s": fwd,
        "compute_backward_s": bwd,
        "optimizer_s": compute - fwd - bwd,
        "t_comm_s": t_comm,
        "t_comm_isolated_s": t_iso,
        "exposed_s": exposed,
        "exposed_fraction": exposed / t_comm if t_comm > 0 else float("nan"),
        "exposed_fraction_isolated": exposed / t_iso if t_iso > 0 else float("nan"),
        "forward_call_s": rec["forward_s"],
        "loss_s": rec["loss_s"],
        "backward_call_s": rec["backward_s"],
        "optimizer_call_s": rec["optimizer_s"],
        "snapshot_s": rec["snapshot_s"],
        "gather_intervals_s": _span(events, "gather"),
        "gathers": len(gathered),
        "grad_accumulate_jobs_s": _span(events, "grad-accumulate"),
        "communication": comm,
        "prefetch": pre,
        "hit_rate": (pre["hits"] + pre["partial_hits"]) / uses if uses else 0.0,
        "full_hit_rate": pre["hits"] / uses if uses else 0.0,
    }


class Hooks:
    """A stats snapshot at the end of every step, inside its time; the figures at the end."""

    def __init__(self, spec: dict[str, Any], rank: Any) -> None:
        self.warmup, self.snaps = spec["warmup"], []

    def setup(self, system: Any) -> None:
        self.snaps.append(system.manager.get_performance_stats())

    def step(self, i: int, clock: Any, system: Any) -> None:
        clock.phase("snapshot")
        self.snaps.append(system.manager.get_performance_stats())

    async def end(self, system: Any, result: dict[str, Any]) -> None:
        iso, records = await isolated_comm(system.manager), result["steps"]
        result.update(losses=[r["loss"] for r in records], isolated_comm_s=iso)
        result["steps"] = [
            derive(records[i], self.snaps[i], self.snaps[i + 1], iso)
            for i in range(self.warmup, len(records))
        ]


def run(args: Any) -> dict[str, Any] | None:
    dims = dict(d=args.d, heads=args.heads, n_layers=args.blocks, seq=SEQ, global_batch=args.batch)
    systems = {}
    for key in (OFF, ON):
        options = {"async_prefetch": key == ON, "prefetch_buffer_size": args.buffer}
        systems[key] = System(key, "zero3_offload", WORLD, options)
    spec = {"hooks": "suites.overlap:Hooks", "lr": LR, "weight_decay": 0.0}
    threads, describe = dict.fromkeys(systems, args.threads), lambda r: f"step {run_step(r):.4f} s"
    result = train.compare(args, systems, dims, threads=threads, spec=spec, describe=describe)
    if result["skipped"]:  # a run failed
        return None
    config = dict(world_size=WORLD, threads_per_rank=args.threads, buffer=args.buffer)
    result["config"].update(config, isolated_repeats=ISO_REPEATS)
    return result


def run_step(run: dict[str, Any]) -> float:
    return statistics.median(s["t_step_s"] for rk in run["ranks"] for s in rk["steps"])


def report(payload: dict[str, Any]) -> Report:
    cfg, runs = payload["config"], payload["runs"]
    # per configuration, medians over every timed step of both ranks and all runs
    summary = {}
    for key in (OFF, ON):
        ss = [s for run in runs if run["key"] == key for rk in run["ranks"] for s in rk["steps"]]
        scalars = [k for k, v in ss[0].items() if not isinstance(v, dict)]
        m = {k: statistics.median(s[k] for s in ss) for k in scalars}
        m["communication"] = {}
        for op in {op for s in ss for op in s["communication"]}:  # collectives: median per step
            per_step = [s["communication"].get(op, {}) for s in ss]
            median = {f: statistics.median(c.get(f, 0) for c in per_step) for f in COMM_FIGURES}
            m["communication"][op] = median
        summary[key] = {**m, "samples": len(ss)}
    off = summary[OFF]["t_step_s"]

    def pct(v: float) -> str:
        return f"{100 * v:.0f}%"

    def op(m: dict[str, Any], name: str) -> str:
        c = m["communication"].get(name)
        return f"{c['time_s']:.4f} ({c['operations']:g})" if c else "-"

    def cells(m: dict[str, Any], keys: str) -> list[str]:
        return [f"{m[k]:.4f}" for k in keys.split()]

    rows = [
        [
            key,
            *cells(m, "t_step_s"),
            f"{off / m['t_step_s']:.3f}x",
            *cells(m, "t_compute_only_s exposed_s t_comm_s"),
            f"{m['exposed_fraction']:.2f}",
            *cells(m, "t_comm_isolated_s"),
            f"{m['exposed_fraction_isolated']:.2f}",
            f"{pct(m['hit_rate'])} ({pct(m['full_hit_rate'])})",
        ]
        for key, m in summary.items()
    ]
    phases = "forward_call_s compute_forward_s loss_s backward_call_s compute_backward_s"
    b_rows = []
    for key, m in summary.items():
        comm = [op(m, "all_gather"), op(m, "reduce_scatter")]
        jobs = cells(m, "gather_intervals_s grad_accumulate_jobs_s")
        b_rows.append([key, *cells(m, f"{phases} optimizer_call_s"), *comm, *jobs])
    r_rows = []
    for r in range(cfg["rounds"]):
        by = {run["key"]: run_step(run) for run in runs if run["round"] == r}
        first = next(run["key"] for run in runs if run["round"] == r)
        off_s, on_s = by[OFF], by[ON]
        r_rows.append(
            [str(r), f"{first} first", f"{off_s:.4f}", f"{on_s:.4f}", f"{off_s / on_s:.3f}x"]
        )
    headers = cols(
        "config; median t_step s; off / this; t_compute_only s; exposed s; t_comm s (library); "
        "exposed / t_comm; t_comm isolated s; exposed / isolated; hit rate (full)"
    )
    b_headers = cols(
        "config; forward call s; fwd compute s; loss s; backward call s; bwd compute s; "
        "optimizer_step s; all_gather s (n); reduce_scatter s (n); gather intervals s; "
        "grad-accumulate jobs s"
    )
    r_headers = cols("round; order; off median step s; on median step s; off / on")
    tables = "\n\n".join(
        [
            markdown_table(headers, rows),
            "Per-step breakdown (medians; 'n' = collectives per step):",
            markdown_table(b_headers, b_rows),
            "Per round (median step of each run; drift of the machine shows here):",
            markdown_table(r_headers, r_rows),
        ]
    )
    dims, per_layer, gb = cfg["dims"], cfg["layer_params"], cfg["dims"]["global_batch"]
    # runs recorded before the suite used train.compare named them warmup_steps and timed_steps
    warmup = cfg.get("warmup", cfg.get("warmup_steps"))
    steps = cfg.get("steps", cfg.get("timed_steps"))
    threads = sorted({rk["torch_threads"] for run in runs for rk in run["ranks"]})
    ref = runs[0]["ranks"][0]["losses"]
    notes = [
        f"{cfg['model']} d={dims['d']}, heads={dims['heads']}, {dims['n_layers']} blocks, "
        f"{cfg['params']:,} fp32 params in {len(per_layer)} layers (largest "
        f"{max(per_layer.values()):,}); global batch {gb} (x {dims['seq']} tokens), "
        f"{gb // cfg['world_size']} per rank; AdamW lr {cfg['lr']}.",
        f"{cfg['world_size']} gloo ranks on this machine, {cfg['threads_per_rank']} torch thread "
        f"per rank (ranks saw {threads}), cpu_worker_threads 2, fp32, no compression.",
        f"'prefetch off': async_prefetch=False; 'prefetch on': async_prefetch=True, "
        f"prefetch_buffer_size={cfg['buffer']}. {cfg['rounds']} rounds, ABBA order, each run "
        f"{warmup} warm-up + {steps} timed steps; medians over "
        f"{summary[OFF]['samples']} samples per config (timed steps x 2 ranks x runs).",
        f"prefetch on: {off / summary[ON]['t_step_s']:.3f}x the speed of off. The stats snapshot "
        f"in every step took {1e6 * summary[ON]['snapshot_s']:.0f} us (median). Columns as "
        f"docs/benchmarks.md (overlap) defines them; isolated collectives: median of "
        f"{cfg['isolated_repeats']}.",
        "losses identical across all runs of both configs: "
        f"{all(run['ranks'][0]['losses'] == ref for run in runs)}.",
        f"whole benchmark {payload['total_wall_s']:.0f} s wall.",
    ]
    title = (
        f"Prefetch overlap ({cfg['world_size']} gloo ranks, step time and exposed communication)"
    )
    return Report(title, tables, notes)
