"""Soak: the default `zero3-offload train` job for 2,000 steps; RSS, threads and open fds per rank.

Ranks sampled from outside; goals: RSS grows <= 1 % after warm-up, threads and fds stay flat."""

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
    lambda p: "FAILED: " + "; ".join(p["failed"]) if p["failed"] else None,
]
SAMPLE = {"rss": 2, "anon": 3, "threads": 4, "fds": 5}  # a sample: [t_s, step, rss, anon, ...]


def check(args: Any) -> str | None:
    if args.repeats is not None:
        return "--repeats is not used: --steps sets the length of the job"
    if args.warmup < 1 or args.steps < args.warmup + 8 or args.sample_s <= 0:
        return "need --warmup >= 1, --steps >= --warmup + 8 and --sample-s > 0"
    return None


def windows(cfg: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The steps of the first tenth after warm-up and of the last quarter, as ranges."""
    steps, warmup = cfg["steps"], cfg["warmup"]
    tenth, quarter = max(1, (steps - warmup) // 10), max(1, (steps - warmup) // 4)
    return (warmup, warmup + tenth), (steps - quarter, steps)


def spread(lo: float, hi: float, fmt: Any = "{:,}".format) -> str:
    """``lo-hi``, or one value when they are equal."""
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def figures(rows: list[list], secs: list[float], log: dict[str, Any], cfg: dict) -> dict:
    """One rank's figures from its samples (the loop's steps only), step seconds and log."""
    (b0, b1), (e0, e1) = windows(cfg)
    after = [r for r in rows if cfg["warmup"] <= r[1] < cfg["steps"]]
    base, end, out = [r for r in rows if b0 <= r[1] < b1], [r for r in rows if e0 <= r[1] < e1], {}
    for key, i in SAMPLE.items() if base and end else ():
        steady = statistics.median if key in ("rss", "anon") else statistics.median_low
        out[f"{key}_base"] = steady(r[i] for r in base)
        out[f"{key}_end"] = steady(r[i] for r in end)
    for key in ("rss", "anon") if base and end else ():
        out[f"{key}_growth_pct"] = 100 * (out[f"{key}_end"] / out[f"{key}_base"] - 1)
    for key in ("rss", "threads", "fds") if after else ():
        i = SAMPLE[key]
        out[f"{key}_min"], out[f"{key}_max"] = min(r[i] for r in after), max(r[i] for r in after)
    for key in ("threads", "fds") if base and end else ():  # the share of samples off the count
        off = sum(r[SAMPLE[key]] != out[f"{key}_base"] for r in after)
        out[f"{key}_off_pct"] = 100 * off / len(after)
    if timed := secs[cfg["warmup"] :]:
        out["median_step_s"] = statistics.median(timed)
    if secs:
        out["log_bytes_per_step"] = log["bytes"] / len(secs)
        out["work_events_per_step"] = log["work"] / len(secs)
    checks = {"rss": out.get("rss_growth_pct", float("inf")) <= cfg["rss_goal_pct"]}
    for k in ("threads", "fds"):
        checks[k] = f"{k}_base" in out and out[f"{k}_base"] == out[f"{k}_end"]
    return {**out, "failed_goals": [k for k, ok in checks.items() if not ok]}


def curve(samples: list[list[list]], secs: list[float], steps: int) -> list[dict[str, Any]]:
    """Per bin of steps: each rank's median RSS and thread and fd counts; rank 0's median step."""
    width, out = max(1, -(-steps // ROWS)), []
    bins = [("0 (setup, first eval)", 0, 1)]
    for a in range(0, steps - 1, width):
        bins.append((f"{a + 1}-{min(a + width, steps - 1)}", a + 1, min(a + width + 1, steps)))
    for label, lo, hi in [*bins, (f"{steps} (last eval, checkpoint)", steps, steps + 1)]:
        out.append(row := {"steps": label})
        if t := [r[0] for rank in samples for r in rank if lo <= r[1] < hi]:
            row["from_s"] = min(t)
        for rank, got in enumerate([r for r in rows if lo <= r[1] < hi] for rows in samples):
            if got:
                row[f"rss{rank}"] = statistics.median(r[2] for r in got)
                row[f"threads{rank}"] = spread(min(r[4] for r in got), max(r[4] for r in got))
                row[f"fds{rank}"] = spread(min(r[5] for r in got), max(r[5] for r in got))
        if lo and (part := secs[max(lo - 1, 0) : hi - 1]):
            row["step_s"] = statistics.median(part)
    return out


def run(args: Any) -> dict[str, Any] | None:
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
        at = [(round(r[0] - got["started"], 3), bisect.bisect_right(ends, r[0])) for r in rows]
        samples.append([[*a, *r[1:]] for a, r in zip(at, rows, strict=True)])
    secs = [[t[2] for t in g["train"]] for g in logs]
    cfg = {"world_size": job.WORLD, "steps": args.steps, "warmup": args.warmup}
    cfg.update(threads_per_rank=args.threads, sample_interval_s=args.sample_s)
    cfg["rss_goal_pct"] = RSS_GOAL_PCT
    tail = next((ln for ln in reversed(got["output_tail"]) if "step" in ln), "")
    out = {"config": cfg, "command": argv, "wall_s": got["wall_s"], "done": [len(s) for s in secs]}
    out.update(last_line=tail.strip(), samples=sum(map(len, samples)))
    out["ranks"] = [figures(s, secs[r], logs[r], cfg) for r, s in enumerate(samples)]
    out["curve"] = curve(samples, secs[0], args.steps)
    return {**out, "failed": [got["error"]] * bool(got["error"])}


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
        rows.append({**f, "rank": str(rank), "threads": counts(f, "threads")})
        rows[-1]["fds"] = counts(f, "fds")
        if "rss_min" in f:
            rows[-1]["after"] = spread(f["rss_min"], f["rss_max"], lambda v: mib(v, 1))
        rows[-1]["goals"] = "FAIL: " + ", ".join(f["failed_goals"]) if f["failed_goals"] else "pass"
    curve = [Col("steps", "steps"), Col("from s", "from_s", ".0f")]
    for r in range(p["config"]["world_size"]):
        curve.append(Col(f"rank {r} RSS MiB", f"rss{r}", "mib1"))
        curve += [Col(f"rank {r} threads", f"threads{r}"), Col(f"rank {r} fds", f"fds{r}")]
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
    title = "The curve (samples binned by the step they saw):"
    return [(columns, rows), title, (curve, p["curve"])]
