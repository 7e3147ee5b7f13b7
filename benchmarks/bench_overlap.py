"""Training-step time with and without asynchronous prefetch, and how much communication shows.

Two configurations of ``Zero3CpuOffloadManager`` train the same TinyGPT
(``tests/models.py``) on the same data from the same seed, on 2 gloo ranks
started by ``zero3_offload.testing.run_ranks`` (1 torch thread per rank):

- **prefetch off**: ``async_prefetch=False`` (every layer is gathered when it
  is needed, then awaited);
- **prefetch on**: ``async_prefetch=True, prefetch_buffer_size=2`` (the next
  two layers' all-gathers are launched before they are needed).

Each run builds a manager, runs ``--warmup`` untimed steps, then ``--repeats``
timed steps. A step is ``forward_pass`` + the loss (outside the manager) +
``backward_pass`` + ``optimizer_step``, the loop of ``tests/rank_bodies.py``
(no ``learning_rate`` is passed to ``backward_pass``, so every update runs in
``optimizer_step``). The two configurations alternate run by run over
``--rounds`` rounds in ABBA order (off/on, on/off, ...), so drift of the
machine shows in the per-round table and hits both alike.

Per timed step and rank (the figures in the tables are medians over all timed
steps of both ranks and all runs of a configuration):

- ``t_step``: wall time from the start of the step to the start of the next
  (``time.perf_counter``); it includes taking the stats snapshot at the end
  of the step (tens of microseconds, reported), so gathers launched for the
  next step get no untimed head start;
- ``t_compute_only``: the sum of the step's ``compute`` intervals on the
  library's timeline (each layer's forward and backward, on the event loop's
  thread) plus the step's ``total_optimizer_time`` delta (``optimizer_step``'s
  wall time, whose CPU optimizer and re-encode jobs run in worker threads);
- ``t_comm``: the step's delta of ``CommunicationStats.time`` summed over all
  collective ops (all_gather, reduce_scatter, ...). The library measures each
  collective from its launch to the moment its completion is observed by the
  awaiting code: a prefetched gather's time runs on until its layer needs it,
  and a reduce-scatter's until the end of the backward (or until its gradient
  buffer is reused), so this is an upper bound of the collectives' own time;
- ``exposed = t_step - t_compute_only``: time the step spends on anything but
  layer compute and the optimizer step (waiting for collectives, launching
  them, gradient landing, the loss, Python);
- ``exposed fraction = exposed / t_comm`` (the figure asked for), and, as a
  check on the inflated denominator, ``exposed / t_comm_isolated``, where
  ``t_comm_isolated`` is what the same collectives cost alone: after the timed
  steps every rank times each layer's all-gather and reduce-scatter by
  themselves (same sizes, median of ``ISO_REPEATS``), summed over the gathers
  the step did (from its timeline) and one reduce-scatter per layer;
- prefetch hit rate: the step's delta of the prefetcher's counters,
  (hits + partial_hits) / (hits + partial_hits + misses) (``prefetch_hit_rate``);
  the full hit rate counts only gathers already complete when needed.

Run: ``python benchmarks/bench_overlap.py`` (about a minute and a half here)
or with ``--quick`` (seconds). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import lm_loss, make_batches, make_model

try:
    from _common import (
        add_common_args,
        apply_threads,
        check_common_args,
        default_out,
        machine_info,
        machine_line,
        markdown_table,
        write_results,
    )
except ModuleNotFoundError:  # run as ``python -m benchmarks.bench_overlap``
    from benchmarks._common import (
        add_common_args,
        apply_threads,
        check_common_args,
        default_out,
        machine_info,
        machine_line,
        markdown_table,
        write_results,
    )

NAME = "overlap"
WORLD = 2
LR = 1e-3
ISO_REPEATS = 5
OFF, ON = "prefetch off", "prefetch on"
PREFETCH_KEYS = ("requests", "hits", "partial_hits", "misses", "wasted", "cancelled")


@attrs.frozen
class RunSpec:
    """One run: a configuration, the model, the data and how many steps."""

    async_prefetch: bool
    prefetch_buffer_size: int
    d: int
    heads: int
    n_blocks: int
    batch: int  # global batch (split over the ranks)
    warmup: int
    steps: int
    seed: int


def _local(t: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    per = t.shape[0] // ctx.world_size
    return t[ctx.rank * per : (ctx.rank + 1) * per]


def _span(events: list[Any], kind: str, phase: str | None = None) -> float:
    return sum(
        e.end - e.start for e in events if e.kind == kind and (phase is None or e.phase == phase)
    )


async def _isolated_comm(manager: Zero3CpuOffloadManager) -> dict[str, dict[str, float]]:
    """Median seconds of each layer's all-gather and reduce-scatter, run alone."""
    out: dict[str, dict[str, float]] = {"all_gather": {}, "reduce_scatter": {}}
    for name, layout in manager.layouts.items():
        if not layout.padded_numel:
            continue
        full = torch.zeros(layout.padded_numel, dtype=torch.float32)
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32)
        for op in out:
            samples = []
            for _ in range(ISO_REPEATS + 1):  # the first one is a warm-up
                t0 = time.perf_counter()
                if op == "all_gather":
                    await manager.comm.all_gather(full, shard)
                else:
                    await manager.comm.reduce_scatter_mean(shard, full)
                samples.append(time.perf_counter() - t0)
            out[op][name] = statistics.median(samples[1:])
    return out


async def overlap_run(ctx: RankContext, spec: RunSpec) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; per timed step, times and the library's stats deltas."""
    model = make_model(seed=spec.seed, d=spec.d, heads=spec.heads, n_blocks=spec.n_blocks)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw"),
        async_prefetch=spec.async_prefetch,
        prefetch_buffer_size=spec.prefetch_buffer_size,
    )
    batches = make_batches(spec.warmup + spec.steps, spec.batch, seed=spec.seed + 1)
    marks: list[tuple[float, float, float, float, float, float]] = []
    snaps = []
    losses = []
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        first = manager.get_performance_stats()
        for x, y in batches:
            xs, ys = _local(x, ctx), _local(y, ctx)
            t0 = time.perf_counter()
            out = await manager.forward_pass(xs, names)
            t1 = time.perf_counter()
            out.requires_grad_()
            loss = lm_loss(out, ys)
            loss.backward()
            t2 = time.perf_counter()
            await manager.backward_pass(out.grad, names)
            t3 = time.perf_counter()
            await manager.optimizer_step(LR)
            t4 = time.perf_counter()
            snaps.append(manager.get_performance_stats())
            t5 = time.perf_counter()  # the next step starts now
            marks.append((t0, t1, t2, t3, t4, t5))
            losses.append(loss.item())
        iso = await _isolated_comm(manager)
        layer_numel = {n: lay.numel for n, lay in manager.layouts.items()}
    steps = []
    for i in range(spec.warmup, len(batches)):
        prev, snap = (snaps[i - 1] if i else first), snaps[i]
        t0, t1, t2, t3, t4, t5 = marks[i]
        events = snap.timeline[len(prev.timeline) :]  # recorded during this step
        comm = {
            op: {
                "operations": c.operations - prev.communication.get(op, type(c)()).operations,
                "time_s": c.time - prev.communication.get(op, type(c)()).time,
                "bytes": c.bytes - prev.communication.get(op, type(c)()).bytes,
            }
            for op, c in snap.communication.items()
        }
        pre = {k: snap.prefetch.get(k, 0) - prev.prefetch.get(k, 0) for k in PREFETCH_KEYS}
        uses = pre["hits"] + pre["partial_hits"] + pre["misses"]
        compute_fwd = _span(events, "compute", "forward")
        compute_bwd = _span(events, "compute", "backward")
        optimizer = snap.total_optimizer_time - prev.total_optimizer_time
        compute_only = compute_fwd + compute_bwd + optimizer
        t_step = t5 - t0
        t_comm = sum(c["time_s"] for c in comm.values())
        gathered = [e.layer for e in events if e.kind == "gather"]
        iso_comm = sum(iso["all_gather"][n] for n in gathered) + sum(iso["reduce_scatter"].values())
        exposed = t_step - compute_only
        steps.append(
            {
                "t_step_s": t_step,
                "t_compute_only_s": compute_only,
                "compute_forward_s": compute_fwd,
                "compute_backward_s": compute_bwd,
                "optimizer_s": optimizer,
                "t_comm_s": t_comm,
                "t_comm_isolated_s": iso_comm,
                "exposed_s": exposed,
                "exposed_fraction": exposed / t_comm if t_comm > 0 else float("nan"),
                "exposed_fraction_isolated": exposed / iso_comm if iso_comm > 0 else float("nan"),
                "forward_call_s": t1 - t0,
                "loss_s": t2 - t1,
                "backward_call_s": t3 - t2,
                "optimizer_call_s": t4 - t3,
                "snapshot_s": t5 - t4,
                "forward_not_compute_s": (t1 - t0) - compute_fwd,
                "backward_not_compute_s": (t3 - t2) - compute_bwd,
                "gather_intervals_s": _span(events, "gather"),
                "gathers": len(gathered),
                "cpu_optimizer_jobs_s": _span(events, "cpu-optimizer"),
                "compress_jobs_s": _span(events, "compress"),
                "grad_accumulate_jobs_s": _span(events, "grad-accumulate"),
                "communication": comm,
                "prefetch": pre,
                "hit_rate": (pre["hits"] + pre["partial_hits"]) / uses if uses else 0.0,
                "full_hit_rate": pre["hits"] / uses if uses else 0.0,
            }
        )
    return {
        "rank": ctx.rank,
        "losses": losses,
        "steps": steps,
        "isolated_comm_s": iso,
        "layer_numel": layer_numel,
        "torch_threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Median training-step time on 2 gloo ranks with async_prefetch on vs off "
        "(same model, data, seed; runs alternated over rounds), and the exposed-communication "
        "fraction from the library's own timeline and communication stats.",
        epilog="Here --repeats is the number of timed steps per run (default 8), --warmup the "
        "untimed steps before them (default 3), --threads the torch threads per rank (default 1).",
    )
    parser.add_argument("--d", type=int, default=None, help="model width (default 384; 64 quick)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 6; 4)")
    parser.add_argument(
        "--blocks", type=int, default=None, help="transformer blocks (default 6; 2 quick)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="global batch, split over 2 ranks (default 32; 8)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds; each runs both configurations, ABBA order (default 4; 2 quick)",
    )
    parser.add_argument(
        "--buffer", type=int, default=2, help="prefetch_buffer_size of 'prefetch on' (default 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    add_common_args(parser, default_repeats=8)
    parser.set_defaults(warmup=3, threads=1)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    quick = {"d": 64, "heads": 4, "blocks": 2, "batch": 8, "rounds": 2}
    full = {"d": 384, "heads": 6, "blocks": 6, "batch": 32, "rounds": 4}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.repeats = min(args.repeats, 5)
        args.warmup = min(args.warmup, 2)
    if args.d % args.heads or args.batch % WORLD or min(args.rounds, args.buffer, args.blocks) < 1:
        parser.error(
            "need --d divisible by --heads, an even --batch, and rounds/buffer/blocks >= 1"
        )
    return args


def _median(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_threads(args.threads)  # the parent only supervises; this makes machine info match
    info = machine_info()
    print(f"machine: {machine_line(info)} (per rank, {WORLD} ranks)", flush=True)
    common = {
        "prefetch_buffer_size": args.buffer,
        "d": args.d,
        "heads": args.heads,
        "n_blocks": args.blocks,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.repeats,
        "seed": args.seed,
    }
    specs = {
        OFF: RunSpec(async_prefetch=False, **common),
        ON: RunSpec(async_prefetch=True, **common),
    }
    model = make_model(seed=args.seed, d=args.d, heads=args.heads, n_blocks=args.blocks)
    n_params = sum(p.numel() for p in model.parameters())
    layer_params = {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_children()}
    print(
        f"TinyGPT d={args.d} heads={args.heads} blocks={args.blocks}: {n_params:,} params in "
        f"{len(layer_params)} layers; global batch {args.batch} x seq 12; "
        f"{args.rounds} rounds x 2 configs x ({args.warmup} warm-up + {args.repeats} timed steps)",
        flush=True,
    )

    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for r in range(args.rounds):
        order = (OFF, ON) if r % 2 == 0 else (ON, OFF)
        for cfg in order:
            t0 = time.perf_counter()
            ranks = asyncio.run(
                run_ranks(overlap_run, WORLD, specs[cfg], threads_per_rank=args.threads)
            )
            steps = [s for rk in ranks for s in rk["steps"]]
            run = {
                "round": r,
                "config": cfg,
                "run_wall_s": time.perf_counter() - t0,
                "median_step_s": _median(steps, "t_step_s"),
                "ranks": ranks,
            }
            runs.append(run)
            print(
                f"round {r} {cfg:>12}: median step {run['median_step_s']:.4f} s "
                f"(run {run['run_wall_s']:.1f} s)",
                flush=True,
            )
    total_wall = time.perf_counter() - started

    # Same model, data and seed: prefetch must not change the numbers.
    ref_losses = runs[0]["ranks"][0]["losses"]
    identical = all(rk["losses"] == ref_losses for run in runs for rk in run["ranks"][:1])
    threads_seen = sorted({rk["torch_threads"] for run in runs for rk in run["ranks"]})

    samples = {
        cfg: [s for run in runs if run["config"] == cfg for rk in run["ranks"] for s in rk["steps"]]
        for cfg in (OFF, ON)
    }
    summary: dict[str, dict[str, Any]] = {}
    keys = [
        "t_step_s",
        "t_compute_only_s",
        "compute_forward_s",
        "compute_backward_s",
        "optimizer_s",
        "t_comm_s",
        "t_comm_isolated_s",
        "exposed_s",
        "exposed_fraction",
        "exposed_fraction_isolated",
        "forward_call_s",
        "loss_s",
        "backward_call_s",
        "optimizer_call_s",
        "snapshot_s",
        "forward_not_compute_s",
        "backward_not_compute_s",
        "gather_intervals_s",
        "gathers",
        "cpu_optimizer_jobs_s",
        "compress_jobs_s",
        "grad_accumulate_jobs_s",
        "hit_rate",
        "full_hit_rate",
    ]
    for cfg, ss in samples.items():
        summary[cfg] = {k: _median(ss, k) for k in keys}
        summary[cfg]["min_step_s"] = min(s["t_step_s"] for s in ss)
        summary[cfg]["max_step_s"] = max(s["t_step_s"] for s in ss)
        summary[cfg]["samples"] = len(ss)
        ops = sorted({op for s in ss for op in s["communication"]})
        summary[cfg]["communication"] = {
            op: {
                f: statistics.median(s["communication"].get(op, {}).get(f, 0) for s in ss)
                for f in ("operations", "time_s", "bytes")
            }
            for op in ops
        }
        summary[cfg]["prefetch"] = {
            k: statistics.median(s["prefetch"][k] for s in ss) for k in PREFETCH_KEYS
        }
    ratio = summary[OFF]["t_step_s"] / summary[ON]["t_step_s"]

    def pct(v: float) -> str:
        return f"{100 * v:.0f}%"

    headers = [
        "config",
        "median t_step s",
        "off / this",
        "t_compute_only s",
        "exposed s",
        "t_comm s (library)",
        "exposed / t_comm",
        "t_comm isolated s",
        "exposed / isolated",
        "hit rate (full)",
    ]
    rows = []
    for cfg in (OFF, ON):
        m = summary[cfg]
        rows.append(
            [
                cfg,
                f"{m['t_step_s']:.4f}",
                f"{summary[OFF]['t_step_s'] / m['t_step_s']:.3f}x",
                f"{m['t_compute_only_s']:.4f}",
                f"{m['exposed_s']:.4f}",
                f"{m['t_comm_s']:.4f}",
                f"{m['exposed_fraction']:.2f}",
                f"{m['t_comm_isolated_s']:.4f}",
                f"{m['exposed_fraction_isolated']:.2f}",
                f"{pct(m['hit_rate'])} ({pct(m['full_hit_rate'])})",
            ]
        )
    table = markdown_table(headers, rows)

    b_headers = [
        "config",
        "forward call s",
        "fwd compute s",
        "loss s",
        "backward call s",
        "bwd compute s",
        "optimizer_step s",
        "all_gather s (n)",
        "reduce_scatter s (n)",
        "gather intervals s",
        "grad-accumulate jobs s",
    ]
    b_rows = []
    for cfg in (OFF, ON):
        m = summary[cfg]
        comm = m["communication"]

        def op_cell(op: str, comm: dict[str, Any] = comm) -> str:
            c = comm.get(op)
            return f"{c['time_s']:.4f} ({c['operations']:g})" if c else "-"

        b_rows.append(
            [
                cfg,
                f"{m['forward_call_s']:.4f}",
                f"{m['compute_forward_s']:.4f}",
                f"{m['loss_s']:.4f}",
                f"{m['backward_call_s']:.4f}",
                f"{m['compute_backward_s']:.4f}",
                f"{m['optimizer_call_s']:.4f}",
                op_cell("all_gather"),
                op_cell("reduce_scatter"),
                f"{m['gather_intervals_s']:.4f}",
                f"{m['grad_accumulate_jobs_s']:.4f}",
            ]
        )
    breakdown = markdown_table(b_headers, b_rows)

    r_rows = []
    for r in range(args.rounds):
        by = {run["config"]: run for run in runs if run["round"] == r}
        first = next(run["config"] for run in runs if run["round"] == r)
        r_rows.append(
            [
                str(r),
                f"{first} first",
                f"{by[OFF]['median_step_s']:.4f}",
                f"{by[ON]['median_step_s']:.4f}",
                f"{by[OFF]['median_step_s'] / by[ON]['median_step_s']:.3f}x",
            ]
        )
    rounds_table = markdown_table(
        ["round", "order", "off median step s", "on median step s", "off / on"], r_rows
    )
    tables_md = "\n\n".join(
        [
            table,
            "Per-step breakdown (medians; 'n' = collectives per step):",
            breakdown,
            "Per round (median step of each run; drift of the machine shows here):",
            rounds_table,
        ]
    )

    n_samples = summary[OFF]["samples"]
    notes = [
        f"TinyGPT d={args.d}, heads={args.heads}, {args.blocks} blocks, {n_params:,} fp32 "
        f"params in {len(layer_params)} layers (largest {max(layer_params.values()):,}); "
        f"global batch {args.batch} (x 12 tokens), {args.batch // WORLD} per rank; AdamW lr {LR}.",
        f"{WORLD} gloo ranks on this machine, {args.threads} torch thread per rank "
        f"(ranks saw {threads_seen}), cpu_worker_threads 2, fp32, no compression.",
        f"'prefetch off': async_prefetch=False; 'prefetch on': async_prefetch=True, "
        f"prefetch_buffer_size={args.buffer}. {args.rounds} rounds, ABBA order, each run "
        f"{args.warmup} warm-up + {args.repeats} timed steps; medians over {n_samples} "
        "samples per config (timed steps x 2 ranks x runs).",
        f"off / this = median t_step of 'prefetch off' / median t_step of the row "
        f"(>1: faster than off); prefetch on: {ratio:.3f}x.",
        "t_step: wall time of forward_pass + loss + backward_pass + optimizer_step, start of "
        "one step to start of the next (includes the stats snapshot, median "
        f"{1e6 * summary[ON]['snapshot_s']:.0f} us).",
        "t_compute_only: sum of the step's 'compute' timeline intervals (every layer's forward "
        "and backward) + the step's total_optimizer_time delta (optimizer_step wall time).",
        "exposed = t_step - t_compute_only (collective waits and launches, gradient landing, "
        "the loss, Python).",
        "t_comm (library): the step's delta of CommunicationStats.time over all ops; each "
        "collective counts from launch until its completion is observed by the code that "
        "awaits it, so prefetched gathers and reduce-scatters (awaited at the end of backward "
        "or when their buffer is reused) include time spent computing: an upper bound.",
        f"t_comm isolated: each layer's all-gather and reduce-scatter timed alone (median of "
        f"{ISO_REPEATS}, after the timed steps), summed over the gathers the step did and one "
        "reduce-scatter per layer.",
        "exposed / t_comm and exposed / isolated: median over samples of the per-step ratio.",
        "hit rate = (hits + partial_hits) / uses of the step's prefetch counter deltas (the "
        "library's prefetch_hit_rate); in parentheses the full hit rate (hits / uses: gather "
        "already complete when the layer needed it).",
        f"losses identical across all runs of both configs: {identical}.",
        f"whole benchmark {total_wall:.0f} s wall.",
    ]
    print()
    print(tables_md)
    print()
    for n in notes:
        print(f"- {n}")

    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "machine": info,
        "config": {
            "world_size": WORLD,
            "threads_per_rank": args.threads,
            "model": {"d": args.d, "heads": args.heads, "n_blocks": args.blocks},
            "params": n_params,
            "layer_params": layer_params,
            "global_batch": args.batch,
            "seq": 12,
            "lr": LR,
            "rounds": args.rounds,
            "warmup_steps": args.warmup,
            "timed_steps": args.repeats,
            "seed": args.seed,
            "isolated_repeats": ISO_REPEATS,
            "specs": {cfg: attrs.asdict(s) for cfg, s in specs.items()},
        },
        "definitions": notes[3:11],
        "ratio_off_over_on": ratio,
        "losses_identical": identical,
        "summary": summary,
        "runs": runs,
        "total_wall_s": total_wall,
    }
    out = args.out or default_out(NAME, args.quick)
    json_path, md_path = write_results(
        out,
        payload,
        tables_md,
        title=f"Prefetch overlap ({WORLD} gloo ranks, step time and exposed communication)",
        notes=notes,
    )
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
