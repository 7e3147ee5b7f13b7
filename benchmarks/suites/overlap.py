"""Step time on 2 gloo ranks with async_prefetch on vs off, and how much communication shows.

The same GPT, data and seed for both, runs alternating over rounds (ABBA); the change of the
library's `get_performance_stats()` over every step gives compute, collective and exposed time
and the prefetch hit rate; after the steps, each layer's collectives are timed alone.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from harness import train
from harness.render import Col
from harness.systems import System

WORLD, LR, ISO_REPEATS, SEQ = 2, 1e-3, 5, 12
OFF, ON = "prefetch off", "prefetch on"
SHARED_MEMORY_BLOCK = 8 * 2**20  # the block size the engine gives its collectives
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
MAIN = [
    Col("config", "name"),
    Col("median t_step s", "t_step_s", ".4f"),
    Col("off / this", "{speedup:.3f}x"),
    Col("t_compute_only s", "t_compute_only_s", ".4f"),
    Col("exposed s", "exposed_s", ".4f"),
    Col("t_comm s (library)", "t_comm_s", ".4f"),
    Col("exposed / t_comm", "exposed_fraction", ".2f"),
    Col("t_comm isolated s", "t_comm_isolated_s", ".4f"),
    Col("exposed / isolated", "exposed_fraction_isolated", ".2f"),
    Col("hit rate (full)", "{hit_rate:.0%} ({full_hit_rate:.0%})"),
]
BREAKDOWN = [
    Col("config", "name"),
    *(
        Col(h, k, ".4f")
        for h, k in [
            ("forward call s", "forward_call_s"),
            ("fwd compute s", "compute_forward_s"),
            ("loss s", "loss_s"),
            ("backward call s", "backward_call_s"),
            ("bwd compute s", "compute_backward_s"),
            ("optimizer_step s", "optimizer_call_s"),
        ]
    ),
    *(
        Col(
            f"{op} s (n)",
            f"{{communication[{op}][time_s]:.4f}} ({{communication[{op}][operations]:g}})",
        )
        for op in ("all_gather", "reduce_scatter")
    ),
    Col("gather intervals s", "gather_intervals_s", ".4f"),
    Col("grad-accumulate jobs s", "grad_accumulate_jobs_s", ".4f"),
]
ROUNDS = [
    Col("round", "round", "d"),
    Col("order", "{first} first"),
    Col("off median step s", "off", ".4f"),
    Col("on median step s", "on", ".4f"),
    Col("off / on", "{ratio:.3f}x"),
]


def check(args: Any) -> str | None:
    if args.d % args.heads or args.batch % WORLD or min(args.rounds, args.buffer, args.blocks) < 1:
        return "need --d divisible by --heads, an even --batch, and rounds/buffer/blocks >= 1"
    return None


async def isolated(spec: dict[str, Any], system: Any, result: dict[str, Any]) -> None:
    """After the steps: each layer's all-gather and reduce-scatter alone (median of
    ISO_REPEATS after one), on a ``zero3_offload.Collectives`` of its own on the ranks' group."""
    import torch

    from zero3_offload import Collectives, Zero3RankMapping

    group = system.group
    mapping = Zero3RankMapping(rank=group.rank(), world_size=group.size())
    comm = Collectives(
        group, device=torch.device("cpu"), shared_memory_block_bytes=SHARED_MEMORY_BLOCK
    )
    out: dict[str, dict[str, float]] = {"all_gather": {}, "reduce_scatter": {}}
    for name, numel in system.layer_numels.items():
        if not (padded := mapping.padded_numel(numel)):
            continue
        full, shard = torch.zeros(padded), torch.zeros(mapping.shard_numel(numel))
        calls = {
            "all_gather": (comm.all_gather, full, shard),
            "reduce_scatter": (comm.reduce_scatter_mean, shard, full),
        }
        for op, (call, a, b) in calls.items():
            samples = []
            for _ in range(ISO_REPEATS + 1):  # the first one warms up
                t0 = time.perf_counter()
                await call(a, b)
                samples.append(time.perf_counter() - t0)
            out[op][name] = statistics.median(samples[1:])
    comm.close()
    result["isolated_comm_s"] = out


def derive(rec: dict[str, Any], iso: dict[str, Any]) -> dict[str, Any]:
    """A timed step's figures, from its clock record and the library's stats over it."""
    st = rec["stats"]
    comm = {
        op: {"operations": c["operations"], "time_s": c["time"], "bytes": c["bytes"]}
        for op, c in st["communication"].items()
    }
    pre, spans = st["prefetch"], st["spans"]
    uses = pre["hits"] + pre["partial_hits"] + pre["misses"]
    fwd, bwd = spans.get("compute forward", 0.0), spans.get("compute backward", 0.0)
    compute = fwd + bwd + st["optimizer_s"]
    t_comm = sum(c["time_s"] for c in comm.values())
    t_iso = sum(iso["all_gather"][n] for n in st["gathered"]) + sum(iso["reduce_scatter"].values())
    exposed = rec["step_s"] - compute
    kinds = {
        k: sum(v for name, v in spans.items() if name.startswith(f"{k} "))
        for k in ("gather", "grad-accumulate")
    }
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
        "gather_intervals_s": kinds["gather"],
        "grad_accumulate_jobs_s": kinds["grad-accumulate"],
        "communication": comm,
        "hit_rate": (pre["hits"] + pre["partial_hits"]) / uses if uses else 0.0,
        "full_hit_rate": pre["hits"] / uses if uses else 0.0,
    }


def run_step(run: dict[str, Any]) -> float:
    return statistics.median(s["t_step_s"] for rk in run["ranks"] for s in rk["steps"])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration the medians over every timed step of both ranks and all runs (of each
    collective's seconds and operations too); per round the runs' medians."""
    configs = {}
    for key in (OFF, ON):
        ss = [s for run in runs if run["key"] == key for rk in run["ranks"] for s in rk["steps"]]
        m = {
            k: statistics.median(s[k] for s in ss)
            for k, v in ss[0].items()
            if not isinstance(v, dict)
        }
        m["communication"] = {}
        for op in sorted({op for s in ss for op in s["communication"]}):
            per_step = [s["communication"].get(op, {}) for s in ss]
            m["communication"][op] = {
                f: statistics.median(c.get(f, 0) for c in per_step)
                for f in ("operations", "time_s")
            }
        configs[key] = {"name": key, **m, "samples": len(ss)}
    for m in configs.values():
        m["speedup"] = configs[OFF]["t_step_s"] / m["t_step_s"]
    rounds = []
    for r in sorted({run["round"] for run in runs}):
        by = {run["key"]: run_step(run) for run in runs if run["round"] == r}
        first = next(run["key"] for run in runs if run["round"] == r)
        rounds.append(
            {"round": r, "first": first, "off": by[OFF], "on": by[ON], "ratio": by[OFF] / by[ON]}
        )
    ref = runs[0]["ranks"][0]["losses"]
    return {
        "configs": configs,
        "rounds": rounds,
        "ranks_threads": sorted({rk["torch_threads"] for run in runs for rk in run["ranks"]}),
        "losses_identical": all(run["ranks"][0]["losses"] == ref for run in runs),
    }


def run(args: Any) -> dict[str, Any] | None:
    dims = dict(d=args.d, heads=args.heads, n_layers=args.blocks, seq=SEQ, global_batch=args.batch)
    systems = {}
    for key in (OFF, ON):
        options = {"async_prefetch": key == ON, "prefetch_buffer_size": args.buffer}
        systems[key] = System(key, "zero3_offload", WORLD, options)
    spec = {"stats": True, "finish": "suites.overlap:isolated", "lr": LR, "weight_decay": 0.0}
    threads = dict.fromkeys(systems, args.threads)
    describe = lambda r: f"step {train.run_median(r):.4f} s"  # noqa: E731
    compared = train.compare(args, systems, dims, threads=threads, spec=spec, describe=describe)
    if compared["skipped"]:  # a run failed
        return None
    for r in compared["runs"]:
        for rk in r["ranks"]:
            rk["losses"] = [s["loss"] for s in rk["steps"]]
            rk["steps"] = [derive(s, rk["isolated_comm_s"]) for s in rk["steps"][r["warmup"] :]]
    config = dict(world_size=WORLD, threads_per_rank=args.threads, buffer=args.buffer)
    config.update(compared["config"], isolated_repeats=ISO_REPEATS)
    return {
        "config": config,
        **summarize(compared["runs"]),
        "total_wall_s": compared["total_wall_s"],
    }


def layout(p: dict[str, Any]) -> list:
    return [
        (MAIN, p["configs"]),
        "Per-step breakdown (medians; 'n' = collectives per step):",
        (BREAKDOWN, p["configs"]),
        "Per round (median step of each run; drift of the machine shows here):",
        (ROUNDS, p["rounds"]),
    ]


def model_note(p: dict[str, Any]) -> str:
    cfg, dims = p["config"], p["config"]["dims"]
    return (
        f"{cfg['model']} d={dims['d']}, heads={dims['heads']}, {dims['n_layers']} blocks, "
        f"{cfg['params']:,} fp32 params in {cfg['layers']} layers (largest "
        f"{cfg['largest_layer']:,}); global batch {dims['global_batch']} (x {dims['seq']} "
        f"tokens), {dims['global_batch'] // cfg['world_size']} per rank; AdamW lr {cfg['lr']}."
    )


NOTES = [
    model_note,
    "{config[world_size]} gloo ranks on this machine, {config[threads_per_rank]} torch thread per "
    "rank (ranks saw {ranks_threads}), cpu_worker_threads 2, fp32, no compression.",
    "'prefetch off': async_prefetch=False; 'prefetch on': async_prefetch=True, "
    "prefetch_buffer_size={config[buffer]}. {config[rounds]} rounds, ABBA order, each run "
    "{config[warmup]} warm-up + {config[steps]} timed steps; medians over "
    "{configs[prefetch off][samples]} samples per config (timed steps x 2 ranks x runs).",
    lambda p: (
        f"prefetch on: {p['configs'][ON]['speedup']:.3f}x the speed of off. The stats "
        f"snapshot in every step took {1e6 * p['configs'][ON]['snapshot_s']:.0f} us (median). "
        "Columns as docs/benchmarks.md (overlap) defines them; isolated collectives: median of "
        f"{p['config']['isolated_repeats']}."
    ),
    "losses identical across all runs of both configs: {losses_identical}.",
    "whole benchmark {total_wall_s:.0f} s wall.",
]
