"""Wire: the default `zero3-offload train` job with each compressed-collective option.

Per option and seed: wire bytes, collective and step time, final eval loss (goal: within 1 %)."""

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
# fmt: off
COLUMNS = [
    Col("option", "name"), Col("all-gather bytes / step", "all_gather_bytes", ",.0f"),
    Col("vs exact", "{all_gather_ratio:.3f}"),
    Col("reduce-scatter bytes / step", "reduce_scatter_bytes", ",.0f"),
    Col("vs exact", "{reduce_scatter_ratio:.3f}"),
    Col("collective ms / step (all-gather + reduce-scatter)", "collective_seconds", "ms1"),
    Col("median step ms", "step_seconds", "ms"), None,
    Col("mean vs exact's mean", "loss_ratio", ".4f"),
    Col("per-seed vs exact (min-max)", "{seed_min:.4f}-{seed_max:.4f}"),
    Col("per-seed ratios' mean ± s.e.", "{paired_mean:.4f} ± {paired_se:.4f}"),
    Col("ranks' bytes agree", "bytes_agree", "yes"), Col("loss goal", "goal"),
]
# fmt: on


def check(args: Any) -> str | None:
    if args.repeats is not None or args.warmup is not None:
        return "--repeats and --warmup are not used: --steps sets the length of each job"
    return "--seeds must be >= 1 and --steps >= 2" if args.seeds < 1 or args.steps < 2 else None


def figures(logs: list[dict | None]) -> dict[str, Any] | None:
    """Rank 0's medians over the steps after the first, from the ranks' logs; ranks' bytes agree."""

    def per_step(log: dict, op: str, field: str) -> list[float]:
        return [c.get(op, {}).get(field, 0) for c in log["collectives"]][1:]

    if not (log := logs[0]) or not log["train"] or not (log["done"] or {}).get("eval_loss"):
        return None
    out: dict[str, Any] = {}
    for op in OPS:
        out[f"{op}_bytes"] = statistics.median(per_step(log, op, "bytes"))
        out[f"{op}_seconds"] = statistics.median(per_step(log, op, "seconds"))
        others = [statistics.median(per_step(g, op, "bytes")) for g in logs[1:] if g]
        out[f"{op}_bytes_agree"] = all(b == out[f"{op}_bytes"] for b in others)
    both = zip(*(per_step(log, op, "seconds") for op in OPS), strict=True)
    out["collective_seconds"] = statistics.median(a + b for a, b in both)
    out["step_seconds"] = statistics.median(t[2] for t in log["train"][1:])
    out["eval_loss"], out["train_losses"] = log["done"]["eval_loss"], [t[1] for t in log["train"]]
    return out


def summarize(cases: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per option: seed 0's figures, the final losses over the seeds against exact's."""
    figs: dict[str, dict[int, dict[str, Any] | None]] = {}
    for case in cases:
        figs.setdefault(case["name"], {})[case["seed"]] = case["figures"]
    exact, fmean, out = figs["exact"], statistics.fmean, {}
    for name, by_seed in figs.items():
        out[name] = {"flags": CASES[name], "missing": [s for s in seeds if by_seed[s] is None]}
        if out[name]["missing"] or any(exact[s] is None for s in seeds):
            continue
        runs, exact_losses = [by_seed[s] for s in seeds], [exact[s]["eval_loss"] for s in seeds]
        losses = [f["eval_loss"] for f in runs]
        ratios = [a / b for a, b in zip(losses, exact_losses, strict=True)]
        row = out[name] | {k: v for k, v in runs[0].items() if k != "train_losses"}  # seed 0's
        row["bytes_agree"] = all(f[f"{op}_bytes_agree"] for f in runs for op in OPS)
        row.update(eval_losses=losses, eval_loss_mean=fmean(losses))
        row.update(loss_ratio=fmean(losses) / fmean(exact_losses), seed_ratios=ratios)
        row["paired_mean"] = fmean(ratios)
        row["paired_se"] = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
        row.update(seed_min=min(ratios), seed_max=max(ratios))
        row["goal"] = "pass" if abs(row["loss_ratio"] - 1) * 100 <= LOSS_GOAL_PCT else "FAIL"
        row["goal"] = "reference" if name == REFERENCE else row["goal"]
        if name != "exact":  # the training losses: the first 50 steps; the last 50
            pairs = [(by_seed[s]["train_losses"], exact[s]["train_losses"]) for s in seeds]
            early = [a / b - 1 for m, e in pairs for a, b in zip(m[:50], e[:50], strict=True)]
            row["train_early"] = max(map(abs, early))
            row["train_tail"] = fmean(fmean(m[-50:]) / fmean(e[-50:]) for m, e in pairs)
        out[name] = row
    return out


def run(args: Any) -> dict[str, Any] | None:
    cases = []
    with work_directory("wire-", args.keep) as work:
        for seed in range(args.seeds):  # seed by seed: each seed's options close together in time
            for i, (name, flags) in enumerate(CASES.items()):
                argv = job.command(args.steps, args.threads, ["--seed", str(seed), *flags])
                progress(f"{name}, seed {seed}: {' '.join(argv[3:])}")
                got = job.run(argv, work / f"seed{seed}-option{i}", args.timeout)
                progress(f"{name}, seed {seed}: {got['wall_s']:.0f} s, {got['error'] or 'ok'}")
                case = {"name": name, "seed": seed, "figures": figures(got["logs"])}
                cases.append({**case, "error": got["error"]})
    config = {"world_size": job.WORLD, "steps": args.steps, "seeds": list(range(args.seeds))}
    config.update(threads_per_rank=args.threads, loss_goal_pct=LOSS_GOAL_PCT)
    summary = summarize(cases, config["seeds"])
    agree = all(s.get("goal", "FAIL") != "FAIL" for s in summary.values())
    failed = [f"{c['name']}, seed {c['seed']}: {c['error']}" for c in cases if c["error"]]
    return {"config": config, "options": summary, "failed": failed, "losses_agree": agree}


def layout(p: dict[str, Any]) -> list:
    n, exact, rows = len(p["config"]["seeds"]), p["options"]["exact"], {}
    for name, f in p["options"].items():
        rows[name] = {**f, "name": name}
        for op in [op for op in OPS if exact.get(f"{op}_bytes") and f"{op}_bytes" in f]:
            rows[name][f"{op}_ratio"] = f[f"{op}_bytes"] / exact[f"{op}_bytes"]
        if "loss_ratio" not in f:
            why = f"no result for seed {', '.join(map(str, f['missing']))}" * bool(f["missing"])
            rows[name]["goal"] = f"FAIL: {why or 'no exact result'}"
    loss = Col(f"final eval loss (mean of {n} seed{'s' * (n > 1)})", "eval_loss_mean", ".4f")
    return [([c or loss for c in COLUMNS], rows)]


def notes(p: dict[str, Any]) -> list[str]:
    cfg, summary, n = p["config"], p["options"], len(p["config"]["seeds"])
    trained = [(k, f) for k, f in summary.items() if "train_early" in f]
    trained = [f"{k}: {100 * f['train_early']:.2f} % / {f['train_tail']:.4f}" for k, f in trained]
    flags = "; ".join(f"{k}: `{' '.join(v['flags']) or '(defaults)'}`" for k, v in summary.items())
    seed_text = "`--seed 0`" if n == 1 else f"`--seed S` for S in 0 .. {n - 1}"
    out = [
        "Training loss (the global-batch mean each step logs) against exact's of the same "
        "seed: the largest relative difference over the first 50 steps / the ratio of the "
        "last 50 steps' mean losses, averaged over the seeds: " + "; ".join(trained) + "."
    ] * bool(trained)
    out.append(
        f"`python -m zero3_offload train --steps {cfg['steps']} --out DIR --threads "
        f"{cfg['threads_per_rank']}` with {seed_text} plus, per option, {flags}; "
        f"{cfg['world_size']} local gloo ranks, every other option at its default; one run "
        "after another, seed by seed (every option with seed 0, then with seed 1, ...). Columns "
        f"as docs/benchmarks.md (wire) defines them; the goal: within {cfg['loss_goal_pct']:g} %."
    )
    if len(losses := summary["exact"].get("eval_losses", [])) < 2:
        return [*out, "No spread across seeds to read the ratios against (one seed, or none)."]
    return [
        *out,
        f"The exact runs' own spread across the seeds (the noise to read the ratios against): "
        f"{(max(losses) / min(losses) - 1) * 100:.1f} % (max / min - 1; final eval losses "
        f"{', '.join(f'{x:.4f}' for x in losses)} for seeds {', '.join(map(str, cfg['seeds']))}).",
    ]


NOTES = [notes]
