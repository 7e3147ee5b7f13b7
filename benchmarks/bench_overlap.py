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
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from zero3_offload.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_common_args,
    apply_threads,
    check_common_args,
    default_out,
    machine_info,
    machine_line,
    write_results,
)
from _overlap_report import _median, make_notes, render_tables, summarize
from _overlap_run import ISO_REPEATS, LR, OFF, ON, WORLD, RunSpec, make_model, overlap_run

NAME = "overlap"


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

    summary = summarize(runs)
    ratio = summary[OFF]["t_step_s"] / summary[ON]["t_step_s"]
    tables_md = render_tables(summary, runs, args.rounds)
    notes = make_notes(
        args, summary, ratio, n_params, layer_params, threads_seen, identical, total_wall
    )
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
