"""Soak: the default `zero3-offload train` job for 2,000 steps; RSS, threads and open fds per rank.

The CLI runs as it is used (its defaults: 2 local ranks, the 0.87M GPT), with --out in a
temporary directory, so every rank writes its JSON log. Nothing runs inside the ranks: the job
runner samples each rank process from outside every --sample-s seconds (VmRSS, RssAnon and
Threads of /proc/<pid>/status, the entries of /proc/<pid>/fd); each sample gets the rank's step
at its time from the `step` events of its log (read with zero3_offload.analyze). Goals after
warm-up: RSS grows <= 1 % (median of the last quarter of the steps vs the median of the first
tenth after warm-up), and the steady thread and fd counts (the medians of the same two windows)
are equal.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any

from harness import job
from harness.render import Col, fill, mib
from harness.runner import progress, work_directory

RSS_GOAL_PCT = 1.0
ROWS = 20  # bins of the curve between the first step and the last
OPTIONS = {
    "--steps": {"type": int, "help": "optimizer steps of the job (2000; quick 60)"},
    "--sample-s": {"type": float, "help": "seconds between samples of each rank (0.5; quick 0.2)"},
    "--timeout": {"type": float, "help": "seconds the job may take (3600; quick 300)"},
    "--keep": {"action": "store_true", "help": "keep the work directory (--out, the job's log)"},
}
DEFAULTS = {"steps": 2000, "warmup": 100, "sample_s": 0.5, "timeout": 3600.0}
DEFAULTS["threads"] = job.DEFAULT_THREADS
QUICK = {"steps": 60, "warmup": 10, "sample_s": 0.2, "timeout": 300.0}
EPILOG = (
    "--warmup: steps before the figures that must stay flat (100; quick 10); --threads: torch "
    "threads per rank, passed to the job (cores / 2, its own default); --repeats: not used"
)
TITLE = (
    "Soak: {config[steps]:,} steps of the default `zero3-offload train` job, "
    "{config[world_size]} ranks: RSS, threads and open fds per rank"
)


def check(args: Any) -> str | None:
    if args.repeats is not None:
        return "--repeats is not used: --steps sets the length of the job"
    if args.warmup < 1 or args.steps < args.warmup + 8:
        return "need --warmup >= 1 and --steps >= --warmup + 8"
    return "--sample-s must be > 0" if args.sample_s <= 0 else None


def windows(cfg: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The steps [first, last) of the window just after warm-up (its first tenth of the steps
    after warm-up) and of the last quarter of the steps."""
    steps, warmup = cfg["steps"], cfg["warmup"]
    after = steps - warmup
    return (warmup, warmup + max(1, after // 10)), (steps - max(1, after // 4), steps)


def figures(rows: list[list], secs: list[float], log_bytes: int, work: int, cfg: dict) -> dict:
    """One rank's figures from its samples ``[t_s, step, rss, anon, threads, fds]`` (the loop's
    steps only: warm-up <= step < steps, so the final evaluation and checkpoint are left out)
    and its steps' seconds."""
    (b0, b1), (e0, e1) = windows(cfg)
    after = [r for r in rows if cfg["warmup"] <= r[1] < cfg["steps"]]
    base, end = [r for r in rows if b0 <= r[1] < b1], [r for r in rows if e0 <= r[1] < e1]
    out: dict[str, Any] = {}
    for key, i in (("rss", 2), ("anon", 3)):
        if base and end:
            b, e = statistics.median(r[i] for r in base), statistics.median(r[i] for r in end)
            out.update({f"{key}_base": b, f"{key}_end": e, f"{key}_growth_pct": 100 * (e / b - 1)})
    for key, i in (("rss", 2), ("threads", 4), ("fds", 5)):
        if after:
            out[f"{key}_min"], out[f"{key}_max"] = (
                min(r[i] for r in after),
                max(r[i] for r in after),
            )
    for key, i in (("threads", 4), ("fds", 5)):  # the count most samples show, per window
        if base and end:
            out[f"{key}_base"] = statistics.median_low(r[i] for r in base)
            out[f"{key}_end"] = statistics.median_low(r[i] for r in end)
            off = sum(r[i] != out[f"{key}_base"] for r in after)
            out[f"{key}_off_pct"] = 100 * off / len(after)
    if timed := secs[cfg["warmup"] :]:
        out["median_step_s"] = statistics.median(timed)
    if secs:
        out["log_bytes_per_step"], out["work_events_per_step"] = (
            log_bytes / len(secs),
            work / len(secs),
        )
    checks = {
        "rss": out.get("rss_growth_pct", float("inf")) <= cfg["rss_goal_pct"],
        "threads": "threads_base" in out and out["threads_base"] == out["threads_end"],
        "fds": "fds_base" in out and out["fds_base"] == out["fds_end"],
    }
    out["failed_goals"] = [k for k, ok in checks.items() if not ok]
    return out


def spread(lo: float, hi: float, fmt: Any = "{:,}".format) -> str:
    """``lo-hi``, or one value when they are equal."""
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def curve(samples: list[list[list]], secs: list[float], steps: int) -> list[dict[str, Any]]:
    """Per bin of steps, per rank: the median RSS and the thread and fd counts seen; rank 0's
    median step."""
    width = max(1, -(-steps // ROWS))
    bins = [("0 (setup, first eval)", 0, 1)]
    bins += [
        (f"{a + 1}-{min(a + width, steps - 1)}", a + 1, min(a + width + 1, steps))
        for a in range(0, steps - 1, width)
    ]
    bins.append((f"{steps} (last eval, checkpoint)", steps, steps + 1))
    rows = []
    for label, lo, hi in bins:
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
    secs = raw["step_seconds"]
    ranks = [
        figures(rows, secs[r], raw["log_bytes"][r], raw["work_events"][r], cfg)
        for r, rows in enumerate(raw["samples"])
    ]
    tail = next((ln for ln in reversed(raw["output_tail"]) if "step" in ln), "")
    return {
        "config": cfg,
        "command": raw["command"],
        "wall_s": raw["wall_s"],
        "done": [len(s) for s in secs],
        "last_line": tail.strip(),
        "samples": sum(len(s) for s in raw["samples"]),
        "ranks": ranks,
        "curve": curve(raw["samples"], secs[0], cfg["steps"]),
        "failed": [raw["error"]] if raw["error"] else [],
    }


def run(args: Any) -> dict[str, Any] | None:
    import zero3_offload

    argv = job.command(args.steps, args.threads, [])
    progress(f"zero3-offload train --steps {args.steps}, sampled every {args.sample_s:g} s")
    with work_directory("soak-", args.keep) as work:
        got = job.run(argv, work / "run", args.timeout, args.sample_s)
    logs = [log or {"steps": [], "train": [], "work": 0, "bytes": 0} for log in got["logs"]]
    progress(f"job: {got['wall_s']:.0f} s, steps per rank {[len(g['train']) for g in logs]}")
    if got["error"]:
        progress("\n    ".join([f"job: {got['error']}; output tail:", *got["output_tail"]]))
    if not any(got["samples"]):
        return None
    samples = []  # each sample with the rank's steps completed at its time (the step events)
    for rank, log in enumerate(logs):
        ends = sorted(s.end for s in log["steps"])
        rows = got["samples"][rank]
        samples.append(
            [
                [round(r[0] - got["started"], 3), bisect.bisect_right(ends, r[0]), *r[1:]]
                for r in rows
            ]
        )
    raw = {
        **got,
        "command": argv,
        "samples": samples,
        "step_seconds": [[t[2] for t in log["train"]] for log in logs],
        "log_bytes": [log["bytes"] for log in logs],
        "work_events": [log["work"] for log in logs],
    }
    cfg = {"world_size": job.WORLD, "steps": args.steps, "warmup": args.warmup}
    cfg.update(threads_per_rank=args.threads, sample_interval_s=args.sample_s)
    cfg.update(rss_goal_pct=RSS_GOAL_PCT, zero3_offload_version=zero3_offload.__version__)
    return summarize(raw, cfg)


def layout(p: dict[str, Any]) -> list:
    (b0, b1), (e0, e1) = windows(p["config"])

    def counts(f: dict[str, Any], key: str) -> str:
        """``steady first -> steady last (min-max after warm-up, % of samples off)``."""
        if f"{key}_base" not in f:
            return "-"
        first, last, off = f[f"{key}_base"], f[f"{key}_end"], f[f"{key}_off_pct"]
        return f"{first} -> {last} ({spread(f[f'{key}_min'], f[f'{key}_max'])}, {off:.1f} %)"

    rows = []
    for rank, f in enumerate(p["ranks"]):
        row = {**f, "rank": str(rank), "threads": counts(f, "threads"), "fds": counts(f, "fds")}
        if "rss_min" in f:
            row["after"] = spread(f["rss_min"], f["rss_max"], lambda v: mib(v, 1))
        row["goals"] = "FAIL: " + ", ".join(f["failed_goals"]) if f["failed_goals"] else "pass"
        rows.append(row)
    columns = [
        Col("rank", "rank"),
        Col(f"RSS steps {b0}-{b1 - 1} MiB", "rss_base", "mib1"),
        Col(f"RSS steps {e0}-{e1 - 1} MiB", "rss_end", "mib1"),
        Col("RSS growth", "{rss_growth_pct:+.2f} %"),
        Col("anon growth", "{anon_growth_pct:+.2f} %"),
        Col("RSS after warm-up MiB", "after"),
        Col("threads: steady first -> last (min-max, % off)", "threads"),
        Col("open fds: steady first -> last (min-max, % off)", "fds"),
        Col("median step ms", "median_step_s", "ms"),
        Col("log bytes / step", "log_bytes_per_step", ",.0f"),
        Col("work events / step", "work_events_per_step", ".1f"),
        Col("goals", "goals"),
    ]
    curve = [Col("steps", "steps"), Col("from s", "from_s", ".0f")]
    for rank in range(p["config"]["world_size"]):
        curve += [
            Col(f"rank {rank} RSS MiB", f"rss{rank}", "mib1"),
            Col(f"rank {rank} threads", f"threads{rank}"),
            Col(f"rank {rank} fds", f"fds{rank}"),
        ]
    curve.append(Col("rank 0 median step ms", "step_s", "ms"))
    return [
        (columns, rows),
        "The curve (samples binned by the step they saw):",
        (curve, p["curve"]),
    ]


def windows_note(p: dict[str, Any]) -> str:
    cfg = p["config"]
    (b0, b1), (e0, e1) = windows(cfg)
    return (
        f"RSS growth = median VmRSS of the samples at steps {e0}-{e1 - 1} (the last quarter of the "
        f"run) / median at steps {b0}-{b1 - 1} (the first tenth after the {cfg['warmup']} warm-up "
        "steps) - 1; anon growth the same of RssAnon. After warm-up: min-max over every sample "
        f"at steps {cfg['warmup']}-{cfg['steps'] - 1} (the training loop, periodic evaluations "
        "included, the final evaluation and checkpoint not). Threads and fds: the steady "
        "count (the median of the samples) of the same two windows, then min-max over every "
        "sample after warm-up and the share of them off the first steady count. Goals: RSS "
        f"growth <= {cfg['rss_goal_pct']:g} %, the steady thread and fd counts the same in both "
        "windows; `goals` names the ones missed."
    )


def log_note(p: dict[str, Any]) -> str:
    kept = fill(
        "; the timeline keeps those of the last {timeline_steps_kept} steps in memory (at most "
        "{timeline_maxlen:,} events)",
        p["config"],
    )
    return (
        "Step ms: median of the train_step events' seconds after warm-up (rank 0's per bin in the "
        "curve). Log bytes / step: the size of the rank's JSON log at the end / its steps (the "
        "files grow by design). Work events / step: `work` lines in the log per step (the "
        f"intervals the rank's timeline recorded){kept or ''}."
    )


NOTES = [
    lambda p: (
        f"`{' '.join(p['command'])}` with everything else at its default: "
        f"{p['config']['world_size']} local gloo ranks of {p['config']['threads_per_rank']} torch "
        "thread(s), the 0.87M-parameter GPT, evaluation every 100 steps, a line every 10 steps, "
        "JSON logs in DIR/logs, one checkpoint at the end (DIR a temporary directory). Wall time "
        f"{p['wall_s']:.0f} s; steps completed per rank {p['done']}; its last line: "
        f"`{p['last_line']}`."
    ),
    "Sampled from outside every {config[sample_interval_s]:g} s per rank: VmRSS and RssAnon "
    "(/proc/<pid>/status), Threads (same file), open fds (entries of /proc/<pid>/fd); each "
    "sample carries the rank's last step in its log. Rank processes are the descendants of "
    "the job holding logs/rank<r>.jsonl open. {samples} samples.",
    windows_note,
    "A sample a thread or an fd above the steady count sees work in flight, not a leak: "
    "zero3_offload/comm/collectives.py starts a waiter thread for every gloo reduce-scatter "
    "(gloo gives it no future) that exits once it completes, and psutil opens and closes "
    "/proc files for the memory figures of every step.",
    log_note,
    lambda p: "FAILED: " + "; ".join(p["failed"]) if p.get("failed") else None,
]
