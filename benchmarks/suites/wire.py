"""Wire: the default `zero3-offload train` job with each compressed-collective option.

One job (2 local gloo ranks, the 0.87M GPT, 300 steps) per option and seed: exact, bf16 and int8
gathers, bf16 reduce-scatters, int8 + bf16, and exact with 2 torch threads (the noise floor:
rounding alone). From the ranks' logs (zero3_offload.analyze): wire bytes and collective seconds
per step, step time, final eval loss. Goal: each option's mean final loss over the seeds within
1 % of exact's."""

from __future__ import annotations

import statistics
from typing import Any

from harness import job
from harness.render import Col
from harness.runner import progress, work_directory

LOSS_GOAL_PCT = 1.0
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
TAKES = ["timeout", "keep"]
OPTIONS = {
    "--steps": {"type": int, "help": "optimizer steps of each job"},
    "--seeds": {"type": int, "help": "runs per option, with --seed 0 .. N-1"},
}
DEFAULTS = {"steps": 300, "seeds": 3, "timeout": 900.0, "threads": job.DEFAULT_THREADS}
QUICK = {"steps": 30, "seeds": 1, "timeout": 300.0}
TITLE = "Wire: compressed collectives on the default training job, {config[steps]} steps"


def check(args: Any) -> str | None:
    if args.repeats is not None or args.warmup is not None:
        return "--repeats and --warmup are not used: --steps sets the length of each job"
    if args.seeds < 1:
        return "--seeds must be >= 1"
    return "--steps must be >= 2" if args.steps < 2 else None


def rank_log(log: dict[str, Any]) -> dict[str, Any]:
    """One rank's per-step figures and final evaluation loss, from its log (:mod:`harness.job`)."""
    out: dict[str, Any] = {}
    for op in OPS:
        got = [c.get(op, {"bytes": 0, "seconds": 0.0}) for c in log["collectives"]]
        out[f"{op}_bytes"], out[f"{op}_seconds"] = (
            [g["bytes"] for g in got],
            [g["seconds"] for g in got],
        )
    out["step_seconds"], out["train_losses"] = (
        [t[2] for t in log["train"]],
        [t[1] for t in log["train"]],
    )
    out["eval_loss"] = (log["done"] or {}).get("eval_loss")
    return out


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
    out["collective_seconds"] = statistics.median([a + b for a, b in pairs][1:])
    out["step_seconds"] = statistics.median(rank0["step_seconds"][1:])
    out["eval_loss"], out["train_losses"] = rank0["eval_loss"], rank0.get("train_losses", [])
    return out


def summarize(cases: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per option (in run order): seed 0's figures, the final evaluation loss of each seed, their
    mean and its ratio to the exact runs' mean, each seed's ratio to the exact run of that seed
    and their mean with its standard error, and the training loss against exact's; the seeds
    without a result instead (and none when exact has none)."""
    figs: dict[str, dict[int, dict[str, Any] | None]] = {}
    flags: dict[str, list[str]] = {}
    for case in cases:
        figs.setdefault(case["name"], {})[case.get("seed", 0)] = figures(case)
        flags.setdefault(case["name"], case["flags"])
    exact = figs.get("exact", {})
    complete = all(exact.get(s) is not None for s in seeds)
    out: dict[str, Any] = {}
    for name, by_seed in figs.items():
        missing = [s for s in seeds if by_seed.get(s) is None]
        out[name] = {"flags": flags[name], "missing": missing}
        if missing or not complete:
            continue
        runs = [by_seed[s] for s in seeds]
        losses, exact_losses = (
            [f["eval_loss"] for f in runs],
            [exact[s]["eval_loss"] for s in seeds],
        )
        ratios = [a / b for a, b in zip(losses, exact_losses, strict=True)]
        out[name].update({k: v for k, v in runs[0].items() if k != "train_losses"})  # seed 0's
        out[name].update(
            bytes_agree=all(
                f["all_gather_bytes_agree"] and f["reduce_scatter_bytes_agree"] for f in runs
            ),
            eval_losses=losses,
            eval_loss_mean=statistics.fmean(losses),
            loss_ratio=statistics.fmean(losses) / statistics.fmean(exact_losses),
            seed_ratios=ratios,
            paired_mean=statistics.fmean(ratios),
            paired_se=statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0,
            seed_min=min(ratios),
            seed_max=max(ratios),
        )
        out[name]["goal"] = (
            "reference"
            if name == REFERENCE
            else "pass"
            if abs(out[name]["loss_ratio"] - 1) * 100 <= LOSS_GOAL_PCT
            else "FAIL"
        )
        mine = {s: by_seed[s]["train_losses"] for s in seeds if by_seed[s]["train_losses"]}
        if name != "exact" and (both := [s for s in mine if exact[s]["train_losses"]]):
            ex = {s: exact[s]["train_losses"] for s in both}  # the first 50 steps; the last 50
            out[name]["train_early"] = max(
                abs(a / b - 1) for s in both for a, b in zip(mine[s][:50], ex[s][:50], strict=True)
            )
            out[name]["train_tail"] = statistics.fmean(
                statistics.fmean(mine[s][-50:]) / statistics.fmean(ex[s][-50:]) for s in both
            )
    return out


def run(args: Any) -> dict[str, Any] | None:
    import zero3_offload

    cases = []
    with work_directory("wire-", args.keep) as work:
        for seed in range(args.seeds):  # seed by seed: each seed's options close together in time
            for name, flags in CASES.items():
                argv = job.command(args.steps, args.threads, ["--seed", str(seed), *flags])
                progress(f"{name}, seed {seed}: {' '.join(argv[3:])}")
                out = work / f"{name.replace(' ', '_').replace('+', 'and')}_seed{seed}"
                got = job.run(argv, out, args.timeout)
                ranks = [rank_log(log) if log else None for log in got["logs"]]
                progress(f"{name}, seed {seed}: {got['wall_s']:.0f} s, {got['error'] or 'ok'}")
                cases.append(
                    {
                        "name": name,
                        "seed": seed,
                        "flags": flags,
                        "ranks": ranks,
                        "error": got["error"],
                    }
                )
    config = {"world_size": job.WORLD, "steps": args.steps, "seeds": list(range(args.seeds))}
    config.update(threads_per_rank=args.threads, loss_goal_pct=LOSS_GOAL_PCT)
    config["zero3_offload_version"] = zero3_offload.__version__
    summary = summarize(cases, config["seeds"])
    agree = all(s.get("goal", "FAIL") != "FAIL" for s in summary.values())
    failed = [f"{c['name']}, seed {c['seed']}: {c['error']}" for c in cases if c["error"]]
    return {"config": config, "options": summary, "failed": failed, "losses_agree": agree}


def layout(p: dict[str, Any]) -> list:
    n, exact = len(p["config"]["seeds"]), p["options"].get("exact", {})
    rows = {}
    for name, f in p["options"].items():
        rows[name] = {**f, "name": name}
        if "loss_ratio" not in f:
            why = (
                f"no result for seed {', '.join(map(str, f['missing']))}"
                if f["missing"]
                else "no exact result"
            )
            rows[name]["goal"] = f"FAIL: {why}"
    columns = [
        Col("option", "name"),
        Col("all-gather bytes / step", "all_gather_bytes", ",.0f"),
        Col("vs exact", "{all_gather_ratio:.3f}"),
        Col("reduce-scatter bytes / step", "reduce_scatter_bytes", ",.0f"),
        Col("vs exact", "{reduce_scatter_ratio:.3f}"),
        Col("collective ms / step (all-gather + reduce-scatter)", "collective_seconds", "ms1"),
        Col("median step ms", "step_seconds", "ms"),
        Col(f"final eval loss (mean of {n} seed{'s' if n > 1 else ''})", "eval_loss_mean", ".4f"),
        Col("mean vs exact's mean", "loss_ratio", ".4f"),
        Col("per-seed vs exact (min-max)", "{seed_min:.4f}-{seed_max:.4f}"),
        Col("per-seed ratios' mean ± s.e.", "{paired_mean:.4f} ± {paired_se:.4f}"),
        Col("ranks' bytes agree", "bytes_agree", "yes"),
        Col("loss goal", "goal"),
    ]
    for row in rows.values():
        for op in OPS:
            if exact.get(f"{op}_bytes") and f"{op}_bytes" in row:
                row[f"{op}_ratio"] = row[f"{op}_bytes"] / exact[f"{op}_bytes"]
    return [(columns, rows)]


def notes(p: dict[str, Any]) -> list[str]:
    cfg, summary = p["config"], p["options"]
    seeds, exact, ref = cfg["seeds"], summary.get("exact", {}), summary.get(REFERENCE, {})
    n = len(seeds)
    parts = [
        f"{name}: {100 * f['train_early']:.2f} % / {f['train_tail']:.4f}"
        for name, f in summary.items()
        if "train_early" in f
    ]
    flags = "; ".join(f"{k}: `{' '.join(v['flags']) or '(defaults)'}`" for k, v in summary.items())
    seed_text = f"`--seed {seeds[0]}`" if n == 1 else f"`--seed S` for S in 0 .. {n - 1}"
    if "eval_losses" in exact and n > 1:
        losses = exact["eval_losses"]
        spread = (
            f"The exact runs' own spread across the seeds (the noise to read the ratios against): "
            f"{(max(losses) / min(losses) - 1) * 100:.1f} % (max / min - 1; final eval losses "
            f"{', '.join(f'{x:.4f}' for x in losses)} for seeds {', '.join(map(str, seeds))})."
        )
    elif "eval_losses" in exact:
        spread = (
            f"One seed only (final eval loss of exact: {exact['eval_losses'][0]:.4f}): no spread "
            "across seeds to read the ratios against; run with --seeds N for that."
        )
    else:
        spread = "No spread across seeds: the exact runs gave no complete result."
    out = [
        "Training loss (the global-batch mean each step logs) against exact's of the same "
        "seed: the largest relative difference over the first 50 steps / the ratio of the "
        "last 50 steps' mean losses, averaged over the seeds: " + "; ".join(parts) + "."
    ] * bool(parts)
    out += [
        f"`python -m zero3_offload train --steps {cfg['steps']} --out DIR --threads "
        f"{cfg['threads_per_rank']}` with {seed_text} plus, per option, {flags}; "
        f"{cfg['world_size']} local gloo ranks, every other option at its default; one run "
        "after another, seed by seed (every option with seed 0, then with seed 1, ...). Columns "
        f"as docs/benchmarks.md (wire) defines them; the goal: within {cfg['loss_goal_pct']:g} %.",
        spread,
    ]
    if "loss_ratio" in ref:
        out.append(
            f"Noise floor ({REFERENCE}: exact once more, its kernels summing in another order): "
            f"mean vs exact's mean {ref['loss_ratio']:.4f}, per-seed {ref['seed_min']:.4f}-"
            f"{ref['seed_max']:.4f}, per-seed ratios' mean {ref['paired_mean']:.4f} ± "
            f"{ref['paired_se']:.4f}. A ratio inside this band is not told apart from exact by "
            "these runs."
        )
    return out


NOTES = [notes]
