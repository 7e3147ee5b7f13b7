"""Soak: the default `zero3-offload train` job for 2,000 steps; RSS, threads and open fds per rank.

The CLI runs as it is used, its ranks sampled from outside (VmRSS, RssAnon, Threads, open fds);
each sample gets the rank's step at its time from the `step` events of its log. Goals after
warm-up: RSS grows <= 1 %, the steady thread and fd counts stay the same.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any

from harness import job
from harness.render import Col, mib
from harness.runner import progress, work_directory

RSS_GOAL_PCT, ROWS = 1.0, 20  # ROWS: bins of the curve between the first step and the last
TAKES = ["timeout", "keep"]
OPTIONS = {
    "--steps": {"type": int, "help": "optimizer steps of the job"},
    "--sample-s": {"type": float, "help": "seconds between samples of each rank"},
}
DEFAULTS = {"steps": 2000, "warmup": 100, "sample_s": 0.5, "timeout": 3600.0}
DEFAULTS["threads"] = job.DEFAULT_THREADS  # what the job picks by itself
QUICK = {"steps": 60, "warmup": 10, "sample_s": 0.2, "timeout": 300.0}
TITLE = (
    "Soak: {config[steps]:,} steps of the default `zero3-offload train` job, "
    "{config[world_size]} ranks: RSS, threads and open fds per rank"
)
NOTES = [
    lambda p: (
        f"`{' '.join(p['command'])}` with everything else at its default: "
        f"{p['config']['world_size']} local gloo ranks of {p['config']['threads_per_rank']} torch "
        f"thread(s), the 0.87M-parameter GPT. Wall time {p['wall_s']:.0f} s; steps completed per "
        f"rank {p['done']}; its last line: `{p['last_line']}`."
    ),
    "{samples} samples, every {config[sample_interval_s]:g} s per rank, read from outside; the "
    "windows (after {config[warmup]} warm-up steps), columns and goals (RSS growth <= "
    "{config[rss_goal_pct]:g} %, the steady thread and fd counts the same in both windows) as "
    "docs/benchmarks.md (soak) defines them.",
    lambda p: "FAILED: " + "; ".join(p["failed"]) if p.get("failed") else None,
]


def check(args: Any) -> str | None:
    if args.repeats is not None:
        return "--repeats is not used: --steps sets the length of the job"
    if args.warmup < 1 or args.steps < args.warmup + 8 or args.sample_s <= 0:
        return "need --warmup >= 1, --steps >= --warmup + 8 and --sample-s > 0"
    return None


def windows(cfg: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The steps [first, last) of the first tenth of the steps after warm-up, and of the last
    quarter of the steps."""
    steps, warmup = cfg["steps"], cfg["warmup"]
    after = steps - warmup
    return (warmup, warmup + max(1, after // 10)), (steps - max(1, after // 4), steps)


def figures(rows: list[list], secs: list[float], log_bytes: int, work: int, cfg: dict) -> dict:
    """One rank's figures from its samples ``[t_s, step, rss, anon, threads, fds]`` (the loop's
    steps only: the final evaluation and checkpoint are left out) and its steps' seconds."""
    (b0, b1), (e0, e1) = windows(cfg)
    after = [r for r in rows if cfg["warmup"] <= r[1] < cfg["steps"]]
    base, end = [r for r in rows if b0 <= r[1] < b1], [r for r in rows if e0 <= r[1] < e1]
    out: dict[str, Any] = {}
    for key, i in (("rss", 2), ("anon", 3)) if base and end else ():
        b, e = statistics.median(r[i] for r in base), statistics.median(r[i] for r in end)
        out.update({f"{key}_base": b, f"{key}_end": e, f"{key}_growth_pct": 100 * (e / b - 1)})
    for key, i in (("rss", 2), ("threads", 4), ("fds", 5)) if after else ():
        out[f"{key}_min"], out[f"{key}_max"] = min(r[i] for r in after), max(r[i] for r in after)
    for key, i in (("threads", 4), ("fds", 5)) if base and end else ():  # most samples' count
        out[f"{key}_base"] = statistics.median_low(r[i] for r in base)
        out[f"{key}_end"] = statistics.median_low(r[i] for r in end)
        out[f"{key}_off_pct"] = 100 * sum(r[i] != out[f"{key}_base"] for r in after) / len(after)
    if timed := secs[cfg["warmup"] :]:
        out["median_step_s"] = statistics.median(timed)
    if secs:
        out["log_bytes_per_step"], out["work_events_per_step"] = (
            log_bytes / len(secs),
            work / len(secs),
        )
    checks = {"rss": out.get("rss_growth_pct", float("inf")) <= cfg["rss_goal_pct"]}
    checks.update(
        {k: f"{k}_base" in out and out[f"{k}_base"] == out[f"{k}_end"] for k in ("threads", "fds")}
    )
    return {**out, "failed_goals": [k for k, ok in checks.items() if not ok]}


def spread(lo: float, hi: float, fmt: Any = "{:,}".format) -> str:
    """``lo-hi``, or one value when they are equal."""
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def curve(samples: list[list[list]], secs: list[float], steps: int) -> list[dict[str, Any]]:
    """Per bin of steps, per rank: the median RSS and the thread and fd counts seen; rank 0's
    median step."""
    width = max(1, -(-steps // ROWS))
    bins = [("0 (setup, first eval)", 0, 1)]
    for a in range(0, steps - 1, width):
        bins.append((f"{a + 1}-{min(a + width, steps - 1)}", a + 1, min(a + width + 1, steps)))
    rows = []
    for label, lo, hi in [*bins, (f"{steps} (last eval, checkpoint)", steps, steps + 1)]:
        row: dict[str, Any] = {"steps": label}
        if t := [r[0] for rank in samples for r in rank if lo <= r[1] < hi]:
            row["from_s"] = min(t)
        for rank, rank_rows in enumerate(samples):
            if got := [r for r in rank_rows if lo <= r[1] < hi]:
                row[f"rss{rank}"] = statistics.median(r[2] for r in got)
                row[f"threads{rank}"] = spread(min(r[4] for r in got), max(r[4] for r in got))
                row[f"fds{rank}"] = spread(min(r[5] for r in got), max(r[5] for r in got))
        if lo and (part := secs[max(lo - 1, 0) : hi - 1]):
            row["step_s"] = statistics.median(part)
        rows.append(row)
    return rows


def summarize(raw: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The compact results of a job: every rank's figures, the curve, the job's outcome."""
    secs, samples = raw["step_seconds"], raw["samples"]
    ranks = [
        figures(s, secs[r], raw["log_bytes"][r], raw["work_events"][r], cfg)
        for r, s in enumerate(samples)
    ]
    tail = next((ln for ln in reversed(raw["output_tail"]) if "step" in ln), "")
    out = {
        "config": cfg,
        "command": raw["command"],
        "wall_s": raw["wall_s"],
        "done": [len(s) for s in secs],
    }
    out.update(last_line=tail.strip(), samples=sum(map(len, samples)), ranks=ranks)
    return {
        **out,
        "curve": curve(samples, secs[0], cfg["steps"]),
        "failed": [raw["error"]] * bool(raw["error"]),
    }


def run(args: Any) -> dict[str, Any] | None:
    import zero3_offload

    argv = job.command(args.steps, args.threads, [])
    progress(f"zero3-offload train --steps {args.steps}, sampled every {args.sample_s:g} s")
    with work_directory("soak-", args.keep) as work:
        got = job.run(argv, work / "run", args.timeout, args.sample_s)
    logs = [log or {"steps": [], "train": [], "work": 0, "bytes": 0} for log in got["logs"]]
    progress(f"job: {got['wall_s']:.0f} s, {got['error'] or 'ok'}")
    if not any(got["samples"]):
        return None
    samples = []  # each sample with the rank's steps completed at its time (its step events)
    for log, rows in zip(logs, got["samples"], strict=True):
        ends = sorted(s.end for s in log["steps"])
        samples.append(
            [
                [round(r[0] - got["started"], 3), bisect.bisect_right(ends, r[0]), *r[1:]]
                for r in rows
            ]
        )
    raw = {**got, "command": argv, "samples": samples, "log_bytes": [g["bytes"] for g in logs]}
    raw.update(
        step_seconds=[[t[2] for t in g["train"]] for g in logs],
        work_events=[g["work"] for g in logs],
    )
    cfg = {
        "world_size": job.WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads_per_rank": args.threads,
    }
    cfg.update(
        sample_interval_s=args.sample_s,
        rss_goal_pct=RSS_GOAL_PCT,
        version=zero3_offload.__version__,
    )
    return summarize(raw, cfg)


def layout(p: dict[str, Any]) -> list:
    (b0, b1), (e0, e1) = windows(p["config"])

    def counts(f: dict[str, Any], key: str) -> str:
        """``steady first -> steady last (min-max after warm-up, % of samples off)``."""
        if f"{key}_base" not in f:
            return "-"
        lo_hi = spread(f[f"{key}_min"], f[f"{key}_max"])
        return f"{f[f'{key}_base']} -> {f[f'{key}_end']} ({lo_hi}, {f[f'{key}_off_pct']:.1f} %)"

    rows = []
    for rank, f in enumerate(p["ranks"]):
        rows.append(
            {**f, "rank": str(rank), "threads": counts(f, "threads"), "fds": counts(f, "fds")}
        )
        if "rss_min" in f:
            rows[-1]["after"] = spread(f["rss_min"], f["rss_max"], lambda v: mib(v, 1))
        rows[-1]["goals"] = "FAIL: " + ", ".join(f["failed_goals"]) if f["failed_goals"] else "pass"
    curve = [Col("steps", "steps"), Col("from s", "from_s", ".0f")]
    for r in range(p["config"]["world_size"]):
        curve += [
            Col(f"rank {r} RSS MiB", f"rss{r}", "mib1"),
            Col(f"rank {r} threads", f"threads{r}"),
        ]
        curve.append(Col(f"rank {r} fds", f"fds{r}"))
    # fmt: off
    columns = [
        Col("rank", "rank"), Col(f"RSS steps {b0}-{b1 - 1} MiB", "rss_base", "mib1"),
        Col(f"RSS steps {e0}-{e1 - 1} MiB", "rss_end", "mib1"),
        Col("RSS growth", "{rss_growth_pct:+.2f} %"),
        Col("anon growth", "{anon_growth_pct:+.2f} %"), Col("RSS after warm-up MiB", "after"),
        Col("threads: steady first -> last (min-max, % off)", "threads"),
        Col("open fds: steady first -> last (min-max, % off)", "fds"),
        Col("median step ms", "median_step_s", "ms"),
        Col("log bytes / step", "log_bytes_per_step", ",.0f"),
        Col("work events / step", "work_events_per_step", ".1f"), Col("goals", "goals"),
    ]
    # fmt: on
    curve.append(Col("rank 0 median step ms", "step_s", "ms"))
    return [
        (columns, rows),
        "The curve (samples binned by the step they saw):",
        (curve, p["curve"]),
    ]
