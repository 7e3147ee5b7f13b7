"""``scaling.py``'s report: per-size summaries, the loss check, markdown tables and notes.

Everything here works on what a run recorded (the runs and the results
JSON), so ``--render`` can rebuild the markdown from a results file without
running anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from _common import markdown_table
from _peers_report import (
    LOSS_CHECK_STEPS,
    LOSS_TOLERANCE,
    MIB,
    fmt_ratio,
    global_losses,
    step_cpu,
    summarize,
)
from _peers_run import System
from _scaling_run import TORCH_KEY, Size, run_median_step

TITLE = "zero3_offload scaling: step time and memory vs model size and ranks"


def loss_check(keys: list[str], runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: every loss finite; max |diff| of the first steps of every run vs plain torch.

    A system without a successful run, or a size without a plain-torch run,
    does not agree (nothing was checked).
    """
    ref_run = next((r for r in runs if r["key"] == TORCH_KEY and r["ok"]), None)
    ref = global_losses(ref_run) if ref_run else None
    out = {}
    for key in keys:
        losses = [global_losses(r) for r in runs if r["key"] == key and r["ok"]]
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
    warmups: Mapping[str, int],
    params: Mapping[str, int],
) -> dict[str, dict[str, Any]]:
    """size name -> {"params", "systems": ``_peers_report.summarize()`` per system, "losses"}.

    ``warmups``: size name -> untimed steps at the start of each of its runs.
    """
    out = {}
    for size in sizes:
        size_runs = [r for r in runs if r["size"] == size.name]
        summary = summarize(systems, size_runs, warmups[size.name])
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
                txt += f" ({fmt_ratio(s[field], ref and ref[field])})"
            cells.append(txt)
        rows.append([size.name, f"{by_size[size.name]['params']:,}", *cells])
    return markdown_table(headers, rows)


def speedup(key: str, s: dict[str, Any], one: dict[str, Any] | None) -> str:
    """step(N=1) / step(N) for zero3_offload rows; "-" for plain torch or without N=1."""
    if key == TORCH_KEY or one is None:
        return "-"
    return fmt_ratio(one["median_step_s"], s["median_step_s"])


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
                    fmt_ratio(s["median_step_s"], ref and ref["median_step_s"]),
                    speedup(key, s, one),
                    f"{s['median_cpu_s']:.3f}",
                    fmt_ratio(s["median_cpu_s"], ref and ref["median_cpu_s"]),
                    f"{s['peak_rss_bytes'] / MIB:,.0f}",
                    fmt_ratio(s["peak_rss_bytes"], ref and ref["peak_rss_bytes"]),
                    f"{s['sum_peak_rss_bytes'] / MIB:,.0f}",
                    f"{s['built_rss_bytes'] / MIB:,.0f}",
                    f"{s['model_state_bytes'] / MIB:,.1f}",
                    fmt_ratio(s["model_state_bytes"], ref and ref["model_state_bytes"]),
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
                f"{statistics.median(step_cpu(run, run['warmup'])):.3f}" if ok else "-",
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


def losses_agree(by_size: dict[str, dict[str, Any]]) -> bool:
    """Whether every planned (size, system) ran and passed the loss check."""
    return all(v["agree"] for b in by_size.values() for v in b["losses"].values())


def notes_for(payload: Mapping[str, Any]) -> list[str]:
    """The notes under the tables, from a results payload."""
    cfg, by_size = payload["config"], payload["summary"]
    cores = payload["machine"]["usable_cores"] or 1
    sizes_txt = "; ".join(
        f"{name}: d={s['d']}, {s['heads']} heads, {s['n_layers']} block(s), seq {s['seq']} = "
        f"{by_size[name]['params']:,} params, {s['warmup']} warm-up + "
        f"{s['timed_steps']} timed steps"
        for name, s in cfg["sizes"].items()
    )
    gb = {s["global_batch"] for s in cfg["sizes"].values()}
    threads, mmap_threshold = cfg["threads_per_rank"], cfg["malloc_mmap_threshold"]
    over = [n for n in cfg["worlds"] if n * threads > cores]
    agree = losses_agree(by_size)
    return [
        f"Model: GPT of `benchmarks/_peers_model.py` (byte vocabulary 256), fp32. {sizes_txt}.",
        f"Global batch {'/'.join(map(str, sorted(gb)))} windows per step for every N (each rank "
        "takes its contiguous share), the same batches (windows of the Python stdlib's *.py "
        f"bytes, sha256 {cfg['corpus']['sha256'][:12]}) and seed {cfg['seed']} for every system.",
        f"AdamW lr {cfg['lr']}, betas (0.9, 0.999), eps 1e-8, weight decay {cfg['weight_decay']}. "
        f"Plain torch: 1 process x {cfg['torch_threads']} torch thread(s), "
        "torch.optim.AdamW(fused=True), whole batch. zero3_offload: Zero3CpuOffloadManager, "
        f"default config, gloo, N ranks x {threads} torch thread(s) (compare_peers' "
        "`ours_default`).",
        f"Machine: {cores} usable cores. "
        + (
            f"N={', '.join(map(str, over))} runs more busy threads than cores "
            "(oversubscribed): its ranks share the cores, so its step time shows the cost of "
            "more ranks on the same cores, not of more hardware."
            if over
            else "No configuration is oversubscribed."
        ),
        f"Each run: fresh processes (compare_peers.launch). {cfg['rounds']} round(s); within a "
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
            f"MALLOC_MMAP_THRESHOLD_={mmap_threshold} in every process."
            if mmap_threshold is not None
            else "defaults in every process."
        ),
        f"Whole benchmark {payload['total_wall_s']:.0f} s wall (estimated beforehand: "
        f"{payload['estimated_total_s']:.0f} s).",
    ]


def rebuild(payload: Mapping[str, Any]) -> tuple[list[Size], dict[str, System], dict[str, Any]]:
    """A results payload's sizes, systems and per-size summaries (recomputed from its runs)."""
    cfg = payload["config"]
    sizes = [
        Size(
            name,
            d=s["d"],
            heads=s["heads"],
            n_layers=s["n_layers"],
            seq=s["seq"],
            global_batch=s["global_batch"],
            warmup=s["warmup"],
            repeats=s["timed_steps"],
        )
        for name, s in cfg["sizes"].items()
    ]
    systems = {
        k: (v["label"], v["kind"], v["world"], v["options"]) for k, v in cfg["systems"].items()
    }
    by_size = summarize_sizes(
        sizes,
        systems,
        payload["runs"],
        {s.name: s.warmup for s in sizes},
        {name: s["params"] for name, s in cfg["sizes"].items()},
    )
    return sizes, systems, by_size
