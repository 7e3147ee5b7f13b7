"""``compare_peers.py``'s report: per-system summaries, ratios, markdown tables and notes.

Everything here works on what a run recorded (the per-rank results of
``_peers_run.launch()`` and the results JSON), so ``--render`` can rebuild
the markdown from a results file without running anything.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from _common import markdown_report, markdown_table
from _peers_run import System

LOSS_CHECK_STEPS = 5
LOSS_TOLERANCE = 1e-3
MIB = 2**20


def global_losses(run: dict[str, Any]) -> list[float]:
    """Per step, the mean of the ranks' local mean losses (= the global-batch mean)."""
    per_rank = [[s["loss"] for s in rk["steps"]] for rk in run["ranks"]]
    return [statistics.fmean(v) for v in zip(*per_rank, strict=True)]


def step_cpu(run: dict[str, Any], warmup: int) -> list[float]:
    """Per timed step, the CPU seconds of all ranks' processes together."""
    per_rank = [[s["cpu_s"] for s in rk["steps"][warmup:]] for rk in run["ranks"]]
    return [sum(v) for v in zip(*per_rank, strict=True)]


def summarize(
    systems: Mapping[str, System],
    runs: list[dict[str, Any]],
    warmup: int,
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, (label, kind, world, options) in systems.items():
        ok = [r for r in runs if r["key"] == key and r["ok"]]
        if not ok:
            continue
        timed = [s for r in ok for rk in r["ranks"] for s in rk["steps"][warmup:]]
        losses = [global_losses(r) for r in ok]
        s: dict[str, Any] = {
            "label": label,
            "kind": kind,
            "world_size": world,
            "threads_per_rank": ok[0]["ranks"][0]["torch_threads"],
            "options": options,
            "runs": len(ok),
            "samples": len(timed),
            "median_step_s": statistics.median(x["step_s"] for x in timed),
            "min_step_s": min(x["step_s"] for x in timed),
            "max_step_s": max(x["step_s"] for x in timed),
            "run_median_step_s": [
                statistics.median(x["step_s"] for rk in r["ranks"] for x in rk["steps"][warmup:])
                for r in ok
            ],
            "peak_rss_bytes": statistics.median(
                max(rk["peak_rss_bytes"] for rk in r["ranks"]) for r in ok
            ),
            "peak_rss_per_rank_bytes": [[rk["peak_rss_bytes"] for rk in r["ranks"]] for r in ok],
            "import_rss_bytes": statistics.median(
                max(rk["marks"]["imported"]["rss_bytes"] for rk in r["ranks"]) for r in ok
            ),
            "model_state_bytes": max(rk["model_state"]["total"] for rk in ok[0]["ranks"]),
            "model_state": ok[0]["ranks"][0]["model_state"],
            "losses": losses[0],
            "losses_max_run_spread": max(
                abs(a - b) for ls in losses[1:] for a, b in zip(ls, losses[0], strict=True)
            )
            if len(losses) > 1
            else 0.0,
        }
        s["median_cpu_s"] = statistics.median(c for r in ok for c in step_cpu(r, warmup))
        s["run_median_cpu_s"] = [statistics.median(step_cpu(r, warmup)) for r in ok]
        for phase in ("forward_s", "backward_s", "optimizer_s"):
            s[f"median_{phase}"] = statistics.median(x[phase] for x in timed)
        for extra in ("optimizer", "deepspeed_version", "persistent_params"):
            if extra in ok[0]["ranks"][0]:
                s[extra] = ok[0]["ranks"][0][extra]
        out[key] = s
    return out


def fmt_ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render(
    summary: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    rounds: int,
    loss_steps: int,
) -> tuple[str, dict[str, Any]]:
    """The markdown tables and the loss-agreement verdict."""
    fsdp = summary.get("fsdp2")
    ref = summary.get("torch")
    headers = [
        "system",
        "ranks x threads",
        "median step s",
        "vs FSDP2",
        "vs torch",
        "best run step s",
        "CPU s / step",
        "vs FSDP2",
        "fwd+loss s",
        "backward s",
        "optimizer s",
        "peak RSS / rank MiB",
        "vs FSDP2",
        "vs torch",
        "RSS after import MiB",
        "model state / rank MiB",
    ]
    rows = []
    for s in summary.values():
        rows.append(
            [
                s["label"],
                f"{s['world_size']} x {s['threads_per_rank']}",
                f"{s['median_step_s']:.3f}",
                fmt_ratio(s["median_step_s"], fsdp and fsdp["median_step_s"]),
                fmt_ratio(s["median_step_s"], ref and ref["median_step_s"]),
                f"{min(s['run_median_step_s']):.3f}",
                f"{s['median_cpu_s']:.3f}",
                fmt_ratio(s["median_cpu_s"], fsdp and fsdp["median_cpu_s"]),
                f"{s['median_forward_s']:.3f}",
                f"{s['median_backward_s']:.3f}",
                f"{s['median_optimizer_s']:.3f}",
                f"{s['peak_rss_bytes'] / MIB:,.0f}",
                fmt_ratio(s["peak_rss_bytes"], fsdp and fsdp["peak_rss_bytes"]),
                fmt_ratio(s["peak_rss_bytes"], ref and ref["peak_rss_bytes"]),
                f"{s['import_rss_bytes'] / MIB:,.0f}",
                f"{s['model_state_bytes'] / MIB:,.1f}",
            ]
        )
    main_table = markdown_table(headers, rows)

    # Loss agreement: every system against plain torch (or the first system).
    base = ref or next(iter(summary.values()))
    k = min(loss_steps, len(base["losses"]))
    l_headers = [
        "system",
        *[f"step {i}" for i in range(k)],
        f"max |diff| vs {base['label']} (first {LOSS_CHECK_STEPS})",
        "max spread between runs",
    ]
    l_rows = []
    agreement: dict[str, Any] = {"reference": base["label"], "tolerance": LOSS_TOLERANCE}
    worst = 0.0
    for key, s in summary.items():
        n = min(LOSS_CHECK_STEPS, len(s["losses"]), len(base["losses"]))
        diff = max(abs(a - b) for a, b in zip(s["losses"][:n], base["losses"][:n], strict=True))
        worst = max(worst, diff)
        agreement[key] = diff
        l_rows.append(
            [
                s["label"],
                *[f"{v:.5f}" for v in s["losses"][:k]],
                f"{diff:.2e}",
                f"{s['losses_max_run_spread']:.1e}",
            ]
        )
    agreement["max_diff"] = worst
    agreement["agree"] = worst <= LOSS_TOLERANCE
    loss_table = markdown_table(l_headers, l_rows)

    # Per round: each run's median step (machine drift shows here).
    keys = list(summary)
    r_rows = []
    for r in range(rounds):
        in_round = [run for run in runs if run["round"] == r]
        by = {run["key"]: run for run in in_round if run["ok"]}
        order = " > ".join(run["key"] for run in in_round)
        cells = []
        for key in keys:
            run = by.get(key)
            if run is None:
                cells.append("-")
                continue
            w = run["warmup"]
            wall = statistics.median(x["step_s"] for rk in run["ranks"] for x in rk["steps"][w:])
            cells.append(f"{wall:.3f} ({statistics.median(step_cpu(run, w)):.2f})")
        loads = [
            f"{run['load_average_at_start'][0]:.1f}"
            for run in in_round
            if run.get("load_average_at_start")
        ]
        r_rows.append([str(r), order, f"{min(loads)}-{max(loads)}" if loads else "-", *cells])
    rounds_table = markdown_table(
        ["round", "order", "load avg", *[summary[k]["label"] for k in keys]], r_rows
    )
    md = "\n\n".join(
        [
            main_table,
            f"Loss per step (global-batch mean; the first {k} steps of the first run; "
            "same initial weights and data for every system):",
            loss_table,
            "Per round: median step s of each run (CPU s / step of all ranks in parentheses) "
            "and the 1-minute load average at the runs' starts; drift of the machine shows here:",
            rounds_table,
        ]
    )
    return md, agreement


def title_for(size: str) -> str:
    """The markdown title of a run at model size ``size`` (quick, small, large)."""
    return f"zero3_offload vs peers ({size} model, same model, data and seed)"


def notes_for(payload: Mapping[str, Any], labels: Mapping[str, str]) -> list[str]:
    """The notes under the tables, from a results payload (``labels``: key -> system label)."""
    cfg = payload["config"]
    dims, per_layer = cfg["dims"], cfg["layer_params"]
    agreement = payload["loss_agreement"]
    mmap_threshold = cfg.get("malloc_mmap_threshold")
    return [
        f"Model: GPT (`benchmarks/_peers_model.py`) d={dims['d']}, {dims['heads']} heads, "
        f"{dims['n_layers']} blocks, seq {dims['seq']}, byte vocabulary 256: {cfg['params']:,} "
        f"fp32 params in {len(per_layer)} layers (largest {max(per_layer.values()):,}); global "
        f"batch {dims['global_batch']}, split evenly over the ranks; seed {cfg['seed']} for "
        "every system.",
        "Data: windows of the Python stdlib's top-level *.py bytes (sha256 "
        f"{cfg['corpus']['sha256'][:12]}), the same batches for every system.",
        f"AdamW lr {cfg['lr']}, betas (0.9, 0.999), eps 1e-8, weight decay "
        f"{cfg['weight_decay']}, fp32. torch and FSDP2: torch.optim.AdamW(fused=True); "
        "DeepSpeed: its DeepSpeedCPUAdam (gradient_clipping set to 0: DeepSpeed's default is "
        "1.0); zero3_offload: torch's fused AdamW kernel per layer shard.",
        f"Each run: fresh processes, {cfg['warmup']} warm-up + {cfg['steps']} timed steps; "
        f"{cfg['rounds']} rounds, the order rotated each round. Median step = median over every "
        "timed step of every rank and run; phases: forward + loss, backward (ours with the lr "
        "passed includes the overlapped updates), optimizer step.",
        "vs FSDP2 / vs torch = this system's figure / that system's (<1: faster or smaller).",
        "best run step s: the smallest per-run median step (the least disturbed run).",
        "CPU s / step: CPU time (time.process_time, all threads) of every rank's process during "
        "a step, summed over the ranks; median over timed steps and runs. Other work on the "
        "machine inflates wall time much more than this.",
        "Peak RSS / rank: VmHWM of /proc/self/status at the end of a run, max over ranks, median "
        "over runs (file-backed and shared pages count). RSS after import: VmRSS once torch and "
        "the system's package are imported, before the model is built.",
        "Model state / rank: bytes of the distinct storages behind parameters (compute copies "
        "and fp32 masters), gradients and optimizer state after the last step, as each system "
        "exposes them (zero3_offload: get_memory_stats().model_state_bytes()).",
        f"Losses agree with {agreement['reference']} within {LOSS_TOLERANCE:g} for the first "
        f"{LOSS_CHECK_STEPS} steps: {agreement['agree']} (max |diff| {agreement['max_diff']:.2e}).",
        "glibc malloc: "
        + (
            f"MALLOC_MMAP_THRESHOLD_={mmap_threshold} in every rank of every system."
            if mmap_threshold is not None
            else "defaults (dynamic mmap threshold, up to 32 MiB) in every process."
        ),
        *[f"SKIPPED {labels.get(k, k)}: {msg}" for k, msg in payload["skipped"].items()],
        f"whole benchmark {payload['total_wall_s']:.0f} s wall.",
    ]


def rerender(payload: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """The ``.md`` file of a results payload, its summaries recomputed from its runs."""
    cfg = payload["config"]
    systems = {
        k: (v["label"], v["kind"], v["world"], v["options"]) for k, v in cfg["systems"].items()
    }
    runs = payload["runs"]
    summary = summarize(systems, runs, cfg["warmup"])
    tables_md, agreement = render(summary, runs, cfg["rounds"], cfg["warmup"] + cfg["steps"])
    notes = notes_for({**payload, "loss_agreement": agreement}, labels)
    return markdown_report(
        payload["machine"], tables_md, title=title_for(payload["size"]), notes=notes
    )
