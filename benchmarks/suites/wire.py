"""Wire: the default `zero3-offload train` job with each compressed-collective option.

One run of the job (2 local gloo ranks, the 0.87M GPT, its default 300 steps) per option and seed
(--seed 0 .. N-1 for --seeds N): exact, --gather-compression bf16, --gather-compression int8,
--reduce-dtype bf16, and int8 gathers with bf16 reduce-scatters. Each rank's JSON log gives, per
optimizer step, the bytes handed to the all-gathers and reduce-scatters and their
launch-to-completion seconds (the `collectives` field of the `step` event), each step's seconds
(`train_step`) and the final evaluation loss (`train_done`). Bytes and times: seed 0's runs.
Goal: every option's final evaluation loss, its mean over the seeds, within 1 % of the exact runs'
mean (one seed is too noisy: the exact runs of two seeds differ by ~5 %).

The noise floor of that comparison is measured in the same run: a reference case, the exact job
with 2 torch threads per rank, whose kernels sum in another order, so it differs from exact only
by rounding. Its ratio to exact is what rounding alone does to 300 steps of training; the goal
does not apply to it. Each option also gets the mean of its per-seed ratios (the same seed's
exact run as the baseline) with the standard error of that mean.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.launcher import work_directory
from harness.plan import progress
from harness.report import Report, cols, markdown_table

WORLD = 2  # the default job's ranks
LOSS_GOAL_PCT = 1.0
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
CASES = {
    "exact": [],
    "gather bf16": ["--gather-compression", "bf16"],
    "gather int8": ["--gather-compression", "int8"],
    "reduce bf16": ["--reduce-dtype", "bf16"],
    "gather int8 + reduce bf16": ["--gather-compression", "int8", "--reduce-dtype", "bf16"],
    # exact again, its kernels summing in another order (the last --threads wins)
    "exact, 2 torch threads (noise floor)": ["--threads", "2"],
}
REFERENCE = "exact, 2 torch threads (noise floor)"  # the goal does not apply to it
OPS = ("all_gather", "reduce_scatter")

OPTIONS = {
    "--steps": {
        "type": int,
        "help": "optimizer steps of each job (the job's default 300; quick 30)",
    },
    "--seeds": {
        "type": int,
        "help": "runs per option, with --seed 0 .. N-1 (3; quick 1)",
    },
    "--timeout": {"type": float, "help": "seconds each job may take (900; quick 300)"},
    "--keep": {"action": "store_true", "help": "keep the work directory (the jobs' logs)"},
}
DEFAULTS = {"steps": 300, "seeds": 3, "timeout": 900.0}
DEFAULTS["threads"] = max(1, (os.cpu_count() or 1) // WORLD)  # what the job picks by itself
QUICK = {"steps": 30, "seeds": 1, "timeout": 300.0}
EPILOG = (
    "--threads: torch threads per rank, passed to the jobs (cores / 2, their own default); "
    "--repeats and --warmup: not used (every step after the first is counted)"
)


def check(args: Any) -> str | None:
    if args.repeats is not None or args.warmup is not None:
        return "--repeats and --warmup are not used: --steps sets the length of each job"
    if args.seeds < 1:
        return "--seeds must be >= 1"
    return "--steps must be >= 2" if args.steps < 2 else None


def read_log(path: Path) -> dict[str, Any]:
    """One rank's per-step figures and final evaluation loss, from its JSON log."""
    out: dict[str, Any] = {f"{op}_{k}": [] for op in OPS for k in ("bytes", "seconds")}
    out.update(step_seconds=[], train_losses=[], eval_loss=None, initial_eval_loss=None)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if '"event": "step"' not in line and '"event": "train_' not in line:
                continue
            event = json.loads(line)
            if event["event"] == "step":
                for op in OPS:
                    got = event["collectives"].get(op, {"bytes": 0, "seconds": 0.0})
                    out[f"{op}_bytes"].append(got["bytes"])
                    out[f"{op}_seconds"].append(round(got["seconds"], 6))
            elif event["event"] == "train_step":
                out["step_seconds"].append(round(event["seconds"], 6))
                out["train_losses"].append(event["loss"])
            elif event["event"] == "train_done":
                out["eval_loss"] = event["eval_loss"]
                out["initial_eval_loss"] = event["initial_eval_loss"]
    return out


def run_job(args: Any, work: Path, name: str, flags: list[str], seed: int) -> dict[str, Any]:
    """Run the job with ``flags`` and ``--seed seed``; each rank's figures and the outcome."""
    out_dir = work / f"{name.replace(' ', '_').replace('+', 'and')}_seed{seed}"
    command = [sys.executable, "-m", "zero3_offload", "train", "--steps", str(args.steps)]
    command += ["--seed", str(seed)]
    command += ["--out", str(out_dir), "--threads", str(args.threads), *flags]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}  # local ranks
    t0, error = time.perf_counter(), None
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=args.timeout
        )
        if proc.returncode != 0:
            error = f"the job exited with status {proc.returncode}: {proc.stderr[-500:]}"
    except subprocess.TimeoutExpired:
        error = f"the job did not finish within {args.timeout:g} s"
    ranks = []
    for rank in range(WORLD):
        log = out_dir / "logs" / f"rank{rank}.jsonl"
        ranks.append(read_log(log) if log.exists() else None)
    return {
        "name": name,
        "seed": seed,
        "flags": flags,
        "command": ["python", *(a if a != str(out_dir) else "DIR" for a in command[1:])],
        "wall_s": time.perf_counter() - t0,
        "ranks": ranks,
        "error": error,
    }


def run(args: Any) -> dict[str, Any] | None:
    import zero3_offload

    results = []
    with work_directory("wire-", args.keep) as work:
        # seed by seed, so that each seed's options run close together in time
        for seed in range(args.seeds):
            for name, flags in CASES.items():
                label = f"{name}, seed {seed}"
                cmd = f"--steps {args.steps} --seed {seed} {' '.join(flags)}".rstrip()
                progress(f"{label}: zero3-offload train {cmd}")
                job = run_job(args, work, name, flags, seed)
                progress(f"{label}: {job['wall_s']:.0f} s, {job['error'] or 'ok'}")
                results.append(job)
    payload = {
        "config": {
            "world_size": WORLD,
            "steps": args.steps,
            "seeds": list(range(args.seeds)),
            "threads_per_rank": args.threads,
            "loss_goal_pct": LOSS_GOAL_PCT,
            "zero3_offload_version": zero3_offload.__version__,
        },
        "cases": results,
        "failed": [f"{c['name']}, seed {c['seed']}: {c['error']}" for c in results if c["error"]],
    }
    summary = summarize(payload)
    if summary and all(s is not None for s in summary.values()):
        payload["losses_agree"] = all(
            abs(s["loss_ratio"] - 1) * 100 <= LOSS_GOAL_PCT
            for name, s in summary.items()
            if s is not None and name != REFERENCE
        )
    return payload


# ------------------------------------------------------------------------------ the figures


def figures(case: dict[str, Any]) -> dict[str, Any] | None:
    """Medians over rank 0's steps after the first (which also holds the setup's collectives
    and the first evaluation); the wire bytes must agree between ranks."""
    rank0 = case["ranks"][0]
    if rank0 is None or not rank0["step_seconds"] or rank0["eval_loss"] is None:
        return None
    out: dict[str, Any] = {}
    for op in OPS:
        out[f"{op}_bytes"] = statistics.median(rank0[f"{op}_bytes"][1:])
        out[f"{op}_seconds"] = statistics.median(rank0[f"{op}_seconds"][1:])
        others = [r for r in case["ranks"][1:] if r is not None]
        out[f"{op}_bytes_agree"] = all(
            statistics.median(r[f"{op}_bytes"][1:]) == out[f"{op}_bytes"] for r in others
        )
    pairs = zip(rank0["all_gather_seconds"], rank0["reduce_scatter_seconds"], strict=True)
    seconds = [a + b for a, b in pairs][1:]
    out["collective_seconds"] = statistics.median(seconds)
    out["step_seconds"] = statistics.median(rank0["step_seconds"][1:])
    out["eval_loss"] = rank0["eval_loss"]
    out["train_losses"] = rank0.get("train_losses", [])
    return out


def seeds_of(payload: dict[str, Any]) -> list[int]:
    """The seeds the payload's runs used (results from before --seeds: seed 0 alone)."""
    return payload["config"].get("seeds", [0])


def summarize(payload: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    """Per option (in run order): seed 0's figures, the final evaluation loss of each seed, their
    mean and its ratio to the exact runs' mean, and each seed's ratio to the exact run of that
    seed; None for an option with a seed that gave no result (or when exact has none)."""
    seeds = seeds_of(payload)
    figs: dict[str, dict[int, dict[str, Any] | None]] = {}
    for case in payload["cases"]:
        figs.setdefault(case["name"], {})[case.get("seed", 0)] = figures(case)
    complete = {
        name: [by_seed.get(s) for s in seeds]
        for name, by_seed in figs.items()
        if all(by_seed.get(s) is not None for s in seeds)
    }
    exact = complete.get("exact")
    out: dict[str, dict[str, Any] | None] = {}
    for name in figs:
        runs = complete.get(name)
        if runs is None or exact is None:
            out[name] = None
            continue
        losses = [f["eval_loss"] for f in runs]
        exact_losses = [f["eval_loss"] for f in exact]
        mean = statistics.fmean(losses)
        out[name] = {
            **runs[0],  # bytes and times: seed 0's run
            "bytes_agree": all(
                f["all_gather_bytes_agree"] and f["reduce_scatter_bytes_agree"] for f in runs
            ),
            "eval_losses": losses,
            "eval_loss_mean": mean,
            "loss_ratio": mean / statistics.fmean(exact_losses),
            "seed_ratios": [a / b for a, b in zip(losses, exact_losses, strict=True)],
        }
        ratios = out[name]["seed_ratios"]
        out[name]["paired_mean"] = statistics.fmean(ratios)
        out[name]["paired_se"] = (
            statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
        )
    return out


def report(payload: dict[str, Any]) -> Report:
    cfg, cases = payload["config"], payload["cases"]
    seeds = seeds_of(payload)
    summary = summarize(payload)
    exact = summary.get("exact")
    rows = []
    for name, f in summary.items():
        if f is None:
            missing = [
                str(c.get("seed", 0)) for c in cases if c["name"] == name and figures(c) is None
            ]
            why = f"no result for seed {', '.join(missing)}" if missing else "no exact result"
            rows.append([name, *["-"] * 11, f"FAIL: {why}"])
            continue

        def vs(key: str, f: dict = f) -> str:
            return f"{f[key] / exact[key]:.3f}" if exact and exact[key] else "-"

        ok = abs(f["loss_ratio"] - 1) * 100 <= cfg["loss_goal_pct"]
        goal = "reference" if name == REFERENCE else "pass" if ok else "FAIL"
        rows.append(
            [
                name,
                f"{f['all_gather_bytes']:,.0f}",
                vs("all_gather_bytes"),
                f"{f['reduce_scatter_bytes']:,.0f}",
                vs("reduce_scatter_bytes"),
                f"{1000 * f['collective_seconds']:.1f}",
                f"{1000 * f['step_seconds']:.0f}",
                f"{f['eval_loss_mean']:.4f}",
                f"{f['loss_ratio']:.4f}",
                f"{min(f['seed_ratios']):.4f}-{max(f['seed_ratios']):.4f}",
                f"{f['paired_mean']:.4f} ± {f['paired_se']:.4f}",
                "yes" if f["bytes_agree"] else "NO",
                goal,
            ]
        )
    n = len(seeds)
    headers = cols(
        "option; all-gather bytes / step; vs exact; reduce-scatter bytes / step; vs exact; "
        "collective ms / step (all-gather + reduce-scatter); median step ms; "
        f"final eval loss (mean of {n} seed{'s' if n > 1 else ''}); mean vs exact's mean; "
        "per-seed vs exact (min-max); per-seed ratios' mean ± s.e.; ranks' bytes agree; "
        "loss goal"
    )
    option_flags: dict[str, list[str]] = {}
    for case in cases:
        option_flags.setdefault(case["name"], case["flags"])
    flags = "; ".join(f"{k}: `{' '.join(v) or '(defaults)'}`" for k, v in option_flags.items())
    seed_text = f"`--seed {seeds[0]}`" if n == 1 else f"`--seed S` for S in 0 .. {n - 1}"
    if exact is not None and n > 1:
        losses = exact["eval_losses"]
        spread = (
            f"The exact runs' own spread across the seeds (the noise to read the ratios "
            f"against): {(max(losses) / min(losses) - 1) * 100:.1f} % (max / min - 1; final "
            f"eval losses {', '.join(f'{x:.4f}' for x in losses)} for seeds "
            f"{', '.join(map(str, seeds))})."
        )
    elif exact is not None:
        spread = (
            f"One seed only (final eval loss of exact: {exact['eval_losses'][0]:.4f}): no spread "
            "across seeds to read the ratios against; run with --seeds N for that."
        )
    else:
        spread = "No spread across seeds: the exact runs gave no complete result."
    notes = [
        *training_loss_notes(payload),
        f"`python -m zero3_offload train --steps {cfg['steps']} --out DIR --threads "
        f"{cfg['threads_per_rank']}` with {seed_text} plus, per option, {flags}; "
        f"{cfg['world_size']} local gloo ranks, every other option at its default; one run "
        "after another, seed by seed (every option with seed 0, then with seed 1, ...).",
        "Bytes: what the collectives were handed (an all-gather's output buffer, a "
        "reduce-scatter's input), summed over one optimizer step: the median over rank 0's "
        "steps after the first (steps with an evaluation gather more). Collective ms: "
        "launch-to-completion seconds of the step's all-gathers and reduce-scatters, summed "
        "(they overlap each other and compute; the median over the same steps). Step ms: the "
        "median of the `train_step` seconds after the first. Bytes, collective ms and step ms "
        "are those of seed 0's run of each option; ranks' bytes agree: in every seed's run.",
        f"Final eval loss: the mean over the seeds of rank 0's final evaluation loss; mean vs "
        f"exact's mean: its ratio to the exact runs' mean, which the goal applies to (within "
        f"{cfg['loss_goal_pct']:g} %). Per-seed vs exact: each seed's final loss over the exact "
        "run's of the same seed (the same data and steps), the lowest and the highest; their "
        "mean and its standard error (sample standard deviation / sqrt(seeds)).",
        spread,
        *noise_floor_notes(summary),
    ]
    return Report(
        f"Wire: compressed collectives on the default training job, {cfg['steps']} steps",
        markdown_table(headers, rows),
        notes,
    )


def noise_floor_notes(summary: dict[str, dict[str, Any] | None]) -> list[str]:
    """What rounding alone does: the reference case's ratios, to read the options' against."""
    ref = summary.get(REFERENCE)
    if ref is None:
        return []
    return [
        f"Noise floor ({REFERENCE}: exact once more, its kernels summing in another order): "
        f"mean vs exact's mean {ref['loss_ratio']:.4f}, per-seed "
        f"{min(ref['seed_ratios']):.4f}-{max(ref['seed_ratios']):.4f}, per-seed ratios' mean "
        f"{ref['paired_mean']:.4f} ± {ref['paired_se']:.4f}. A ratio inside this band is not "
        "told apart from exact by these runs."
    ]


def training_loss_notes(payload: dict[str, Any]) -> list[str]:
    """Each option's training loss against exact's of the same seed, step by step: the
    largest relative difference over the first 50 steps (before the trajectories part), and
    the mean over the seeds of the ratio of the last 50 steps' mean losses."""
    runs: dict[str, dict[int, list[float]]] = {}
    for case in payload["cases"]:
        f = figures(case)
        if f is not None and f.get("train_losses"):
            runs.setdefault(case["name"], {})[case.get("seed", 0)] = f["train_losses"]
    exact = runs.get("exact", {})
    parts = []
    for name, by_seed in runs.items():
        seeds = [s for s in by_seed if s in exact]
        if name == "exact" or not seeds:
            continue
        early = max(
            abs(a / b - 1)
            for s in seeds
            for a, b in zip(by_seed[s][:50], exact[s][:50], strict=True)
        )
        tail = statistics.fmean(
            statistics.fmean(by_seed[s][-50:]) / statistics.fmean(exact[s][-50:]) for s in seeds
        )
        parts.append(f"{name}: {100 * early:.2f} % / {tail:.4f}")
    if not parts:
        return []
    return [
        "Training loss (the global-batch mean each step logs) against exact's of the same "
        "seed: the largest relative difference over the first 50 steps / the ratio of the "
        "last 50 steps' mean losses, averaged over the seeds: " + "; ".join(parts) + "."
    ]
