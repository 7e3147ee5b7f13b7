"""Summaries, tables and notes of ``bench_overlap.py``."""

from __future__ import annotations

import statistics
from typing import Any

from _common import markdown_table
from _overlap_run import ISO_REPEATS, LR, OFF, ON, PREFETCH_KEYS, WORLD


def _median(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: medians over every timed step of both ranks and all runs."""
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
    return summary


def render_tables(
    summary: dict[str, dict[str, Any]], runs: list[dict[str, Any]], rounds: int
) -> str:
    """The main table, the per-step breakdown and the per-round table, as markdown."""

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
    for r in range(rounds):
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
    return tables_md


def make_notes(
    args: Any,
    summary: dict[str, dict[str, Any]],
    ratio: float,
    n_params: int,
    layer_params: dict[str, int],
    threads_seen: list[int],
    identical: bool,
    total_wall: float,
) -> list[str]:
    """The notes under the tables (``notes[3:11]`` are the definitions kept in the JSON)."""
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
    return notes
