"""Soak: the default `zero3-offload train` job for 2,000 steps; RSS, threads and open fds per rank.

The CLI runs as it is used: a subprocess with its defaults (2 local ranks, the 0.87M GPT) and
--out in a temporary directory, so every rank writes its JSON log. Nothing runs inside the ranks:
the parent finds each rank process (the one holding logs/rank<r>.jsonl open) and samples it from
outside every --sample-s seconds (VmRSS and RssAnon, Threads of /proc/<pid>/status, the entries
of /proc/<pid>/fd), each sample tagged with the rank's last step in its log. Goals after warm-up:
RSS grows <= 1 % (median of the last quarter of the steps vs the median of the first tenth after
warm-up), and the steady thread and fd counts (the medians of the same two windows) are equal.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from harness.launcher import work_directory
from harness.plan import progress
from harness.report import Report, cols, markdown_table, mib
from harness.sampler import proc_counts, proc_status

WORLD = 2  # the default job's ranks (zero3-offload train's --world-size default)
RSS_GOAL_PCT = 1.0
ROWS = 20  # bins of the curve between the first step and the last
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SAMPLE_FIELDS = ["t_s", "step", "rss_bytes", "anon_bytes", "threads", "fds"]

OPTIONS = {
    "--steps": {"type": int, "help": "optimizer steps of the job (2000; quick 60)"},
    "--sample-s": {"type": float, "help": "seconds between samples of each rank (0.5; quick 0.2)"},
    "--timeout": {"type": float, "help": "seconds the job may take (3600; quick 300)"},
    "--keep": {"action": "store_true", "help": "keep the work directory (--out, the job's log)"},
}
DEFAULTS = {"steps": 2000, "warmup": 100, "sample_s": 0.5, "timeout": 3600.0}
DEFAULTS["threads"] = max(1, (os.cpu_count() or 1) // WORLD)  # what the job picks by itself
QUICK = {"steps": 60, "warmup": 10, "sample_s": 0.2, "timeout": 300.0}
EPILOG = (
    "--warmup: steps before the figures that must stay flat (100; quick 10); --threads: torch "
    "threads per rank, passed to the job (cores / 2, its own default); --repeats: not used"
)


def check(args: Any) -> str | None:
    if args.repeats is not None:
        return "--repeats is not used: --steps sets the length of the job"
    if args.warmup < 1 or args.steps < args.warmup + 8:
        return "need --warmup >= 1 and --steps >= --warmup + 8"
    return "--sample-s must be > 0" if args.sample_s <= 0 else None


class LogTail:
    """What a rank's JSON log has said so far: its last step, each step's seconds, work events."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""
        self.step, self.step_seconds, self.work_events = 0, [], 0

    def read(self) -> int:
        """Read the lines written since the last call; the rank's last completed step."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.step
        self.offset += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()  # a line being written
        for line in lines:
            if b'"event": "work"' in line:
                self.work_events += 1
            elif b'"event": "train_step"' in line:
                event = json.loads(line)
                self.step = event["step"]
                self.step_seconds.append(round(event["seconds"], 6))
        return self.step


def find_ranks(parent: int, logs: Path) -> dict[int, int]:
    """rank -> pid of the descendants of ``parent`` that hold ``logs/rank<r>.jsonl`` open."""
    wanted = {os.path.realpath(logs / f"rank{r}.jsonl"): r for r in range(WORLD)}
    found = {}
    try:
        children = psutil.Process(parent).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    for child in children:
        try:
            links = [
                os.readlink(f"/proc/{child.pid}/fd/{fd}")
                for fd in os.listdir(f"/proc/{child.pid}/fd")
            ]
        except OSError:  # gone, or an fd closed between listing and reading
            continue
        found.update({wanted[link]: child.pid for link in links if link in wanted})
    return found


def soak(args: Any, work: Path) -> dict[str, Any]:
    """Run the job, sampling its ranks; the samples, logs' figures and the job's outcome."""
    out_dir, job_log = work / "run", work / "train.log"
    command = [sys.executable, "-m", "zero3_offload", "train", "--steps", str(args.steps)]
    command += ["--out", str(out_dir), "--threads", str(args.threads)]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}  # local ranks
    tails = [LogTail(out_dir / "logs" / f"rank{r}.jsonl") for r in range(WORLD)]
    samples: list[list[list[float]]] = [[] for _ in range(WORLD)]
    pids: dict[int, int] = {}
    error, reported, t0 = None, 0, time.perf_counter()
    with open(job_log, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        while True:
            if len(pids) < WORLD:
                pids.update(find_ranks(proc.pid, out_dir / "logs"))
            now = time.perf_counter() - t0
            for rank, pid in sorted(pids.items()):
                step = tails[rank].read()
                status, counts = proc_status(pid), proc_counts(pid)
                if status and counts:
                    row = [round(now, 3), step, status["VmRSS"], status["RssAnon"]]
                    samples[rank].append([*row, counts["threads"], counts["fds"]])
            if pids and (step := tails[0].step) >= reported + args.steps // 10:
                reported = step
                last = samples[0][-1] if samples[0] else None
                rss = f", rank 0 RSS {mib(last[2])} MiB" if last else ""
                progress(f"step {step}/{args.steps} at {now:.0f} s{rss}")
            try:
                code = proc.wait(timeout=args.sample_s)  # the sampling interval, or the exit
            except subprocess.TimeoutExpired:
                if time.perf_counter() - t0 > args.timeout:
                    error = f"the job did not finish within {args.timeout:g} s"
                    break
                continue
            if code != 0:
                error = f"the job exited with status {code}"
            break
    finally:
        if proc.poll() is None:  # only the process group started here
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.perf_counter() - t0
    for tail in tails:
        tail.read()
    text = job_log.read_text(encoding="utf-8", errors="replace")
    log_bytes = [t.path.stat().st_size if t.path.exists() else 0 for t in tails]
    return {
        "command": ["python", *(a if a != str(out_dir) else "DIR" for a in command[1:])],
        "wall_s": wall,
        "pids": [pids.get(r) for r in range(WORLD)],
        "samples": samples,
        "step_seconds": [t.step_seconds for t in tails],
        "work_events": [t.work_events for t in tails],
        "log_bytes": log_bytes,
        "output_tail": [line for line in text.splitlines() if line.strip()][-12:],
        "error": error,
    }


def run(args: Any) -> dict[str, Any] | None:
    import zero3_offload
    from zero3_offload.stats.timeline import Timeline

    progress(f"zero3-offload train --steps {args.steps}, sampled every {args.sample_s:g} s")
    with work_directory("soak-", args.keep) as work:
        job = soak(args, work)
    done = [len(s) for s in job["step_seconds"]]
    progress(f"job: {job['wall_s']:.0f} s, steps per rank {done}, {job['error'] or 'ok'}")
    if job["error"]:
        progress("\n    ".join(["job output tail:", *job["output_tail"]]))
    if not any(job["samples"]):
        return None
    timeline = Timeline()
    return {
        "config": {
            "world_size": WORLD,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads_per_rank": args.threads,
            "sample_interval_s": args.sample_s,
            "rss_goal_pct": RSS_GOAL_PCT,
            "sample_fields": SAMPLE_FIELDS,
            "timeline_maxlen": timeline.maxlen,
            "timeline_steps_kept": timeline.steps_kept,
            "zero3_offload_version": zero3_offload.__version__,
        },
        **job,
        "failed": [job["error"]] if job["error"] else [],
    }


# ------------------------------------------------------------------------------ the figures


def windows(cfg: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The steps [first, last) of the window just after warm-up (its first tenth of the steps
    after warm-up) and of the last quarter of the steps."""
    steps, warmup = cfg["steps"], cfg["warmup"]
    after = steps - warmup
    return (warmup, warmup + max(1, after // 10)), (steps - max(1, after // 4), steps)


def rank_figures(payload: dict[str, Any], rank: int) -> dict[str, Any]:
    """One rank's soak figures from its samples (the loop's steps only: warm-up <= step < steps,
    so the final evaluation and checkpoint are left out)."""
    cfg, rows = payload["config"], payload["samples"][rank]
    (b0, b1), (e0, e1) = windows(cfg)
    after = [r for r in rows if cfg["warmup"] <= r[1] < cfg["steps"]]
    base = [r for r in rows if b0 <= r[1] < b1]
    end = [r for r in rows if e0 <= r[1] < e1]
    out: dict[str, Any] = {"samples_after_warmup": len(after), "base_n": len(base)}
    out["end_n"] = len(end)
    for key, i in (("rss", 2), ("anon", 3)):
        if base and end:
            b, e = statistics.median(r[i] for r in base), statistics.median(r[i] for r in end)
            out.update({f"{key}_base": b, f"{key}_end": e, f"{key}_growth_pct": 100 * (e / b - 1)})
    for key, i in (("rss", 2), ("threads", 4), ("fds", 5)):
        if after:
            out[f"{key}_min"] = min(r[i] for r in after)
            out[f"{key}_max"] = max(r[i] for r in after)
    for key, i in (("threads", 4), ("fds", 5)):  # the count most samples show, per window
        if base and end:
            out[f"{key}_base"] = statistics.median_low(r[i] for r in base)
            out[f"{key}_end"] = statistics.median_low(r[i] for r in end)
            off = sum(r[i] != out[f"{key}_base"] for r in after)
            out[f"{key}_off_pct"] = 100 * off / len(after)
    secs = payload["step_seconds"][rank][cfg["warmup"] :]
    if secs:
        out["median_step_s"] = statistics.median(secs)
    done = len(payload["step_seconds"][rank])
    if done:
        out["log_bytes_per_step"] = payload["log_bytes"][rank] / done
        out["work_events_per_step"] = payload["work_events"][rank] / done
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


def counts(f: dict[str, Any], key: str) -> str:
    """``steady first -> steady last (min-max after warm-up, % of samples off the steady)``."""
    if f"{key}_base" not in f:
        return "-"
    first, last, off = f[f"{key}_base"], f[f"{key}_end"], f[f"{key}_off_pct"]
    return f"{first} -> {last} ({spread(f[f'{key}_min'], f[f'{key}_max'])}, {off:.1f} %)"


def curve(payload: dict[str, Any]) -> str:
    """Per bin of steps, per rank: the median RSS and the thread and fd counts seen."""
    cfg, world = payload["config"], payload["config"]["world_size"]
    steps = cfg["steps"]
    width = max(1, -(-steps // ROWS))
    bins: list[tuple[str, int, int]] = [("0 (setup, first eval)", 0, 1)]
    bins += [
        (f"{a + 1}-{min(a + width, steps - 1)}", a + 1, a + width + 1)
        for a in range(0, steps - 1, width)
    ]
    bins = [(label, lo, min(hi, steps)) for label, lo, hi in bins]
    bins.append((f"{steps} (last eval, checkpoint)", steps, steps + 1))
    rows = []
    for label, lo, hi in bins:
        cells = [label]
        t = [r[0] for rk in payload["samples"] for r in rk if lo <= r[1] < hi]
        cells.append(f"{min(t):.0f}" if t else "-")
        for rank in range(world):
            got = [r for r in payload["samples"][rank] if lo <= r[1] < hi]
            if not got:
                cells += ["-"] * 3
                continue
            cells.append(mib(statistics.median(r[2] for r in got), 1))
            cells.append(spread(min(r[4] for r in got), max(r[4] for r in got)))
            cells.append(spread(min(r[5] for r in got), max(r[5] for r in got)))
        secs = payload["step_seconds"][0][max(lo - 1, 0) : hi - 1] if lo else []
        cells.append(f"{1000 * statistics.median(secs):.0f}" if secs else "-")
        rows.append(cells)
    headers = ["steps", "from s"]
    for rank in range(world):
        headers += [f"rank {rank} RSS MiB", f"rank {rank} threads", f"rank {rank} fds"]
    return markdown_table([*headers, "rank 0 median step ms"], rows)


def report(payload: dict[str, Any]) -> Report:
    cfg = payload["config"]
    (b0, b1), (e0, e1) = windows(cfg)
    rows = []
    for rank in range(cfg["world_size"]):
        f = rank_figures(payload, rank)

        def fig(key: str, fmt: Any, f: dict = f) -> str:
            return fmt(f[key]) if key in f else "-"

        rows.append(
            [
                str(rank),
                fig("rss_base", lambda v: mib(v, 1)),
                fig("rss_end", lambda v: mib(v, 1)),
                fig("rss_growth_pct", lambda v: f"{v:+.2f} %"),
                fig("anon_growth_pct", lambda v: f"{v:+.2f} %"),
                spread(f["rss_min"], f["rss_max"], lambda v: mib(v, 1)) if "rss_min" in f else "-",
                *(counts(f, key) for key in ("threads", "fds")),
                fig("median_step_s", lambda v: f"{1000 * v:.0f}"),
                fig("log_bytes_per_step", lambda v: f"{v:,.0f}"),
                fig("work_events_per_step", lambda v: f"{v:.1f}"),
                "FAIL: " + ", ".join(f["failed_goals"]) if f["failed_goals"] else "pass",
            ]
        )
    headers = cols(
        f"rank; RSS steps {b0}-{b1 - 1} MiB; RSS steps {e0}-{e1 - 1} MiB; RSS growth; "
        "anon growth; RSS after warm-up MiB; threads: steady first -> last (min-max, % off); "
        "open fds: steady first -> last (min-max, % off); median step ms; log bytes / step; "
        "work events / step; goals"
    )
    tables = "\n\n".join(
        [
            markdown_table(headers, rows),
            "The curve (samples binned by the step they saw):",
            curve(payload),
        ]
    )
    done = [len(s) for s in payload["step_seconds"]]
    tail = next((ln for ln in reversed(payload["output_tail"]) if "step" in ln), "")
    notes = [
        f"`{' '.join(payload['command'])}` with everything else at its default: "
        f"{cfg['world_size']} local gloo ranks of {cfg['threads_per_rank']} torch thread(s), the "
        "0.87M-parameter GPT, evaluation every 100 steps, a line every 10 steps, JSON logs in "
        "DIR/logs, one checkpoint at the end (DIR a temporary directory). Wall time "
        f"{payload['wall_s']:.0f} s; steps completed per rank {done}; "
        f"its last line: `{tail.strip()}`.",
        f"Sampled from outside every {cfg['sample_interval_s']:g} s per rank: VmRSS and RssAnon "
        "(/proc/<pid>/status), Threads (same file), open fds (entries of /proc/<pid>/fd); each "
        "sample carries the rank's last step in its log. Rank processes are the descendants of "
        "the job holding logs/rank<r>.jsonl open. "
        f"{sum(len(s) for s in payload['samples'])} samples.",
        f"RSS growth = median VmRSS of the samples at steps {e0}-{e1 - 1} (the last quarter of the "
        f"run) / median at steps {b0}-{b1 - 1} (the first tenth after the {cfg['warmup']} warm-up "
        "steps) - 1; anon growth the same of RssAnon. After warm-up: min-max over every sample "
        f"at steps {cfg['warmup']}-{cfg['steps'] - 1} (the training loop, periodic evaluations "
        "included, the final evaluation and checkpoint not). Threads and fds: the steady "
        "count (the median of the samples) of the same two windows, then min-max over every "
        "sample after warm-up and the share of them off the first steady count. Goals: RSS "
        f"growth <= {cfg['rss_goal_pct']:g} %, the steady thread and fd counts the same in both "
        "windows; `goals` names the ones missed.",
        "A sample a thread or an fd above the steady count sees work in flight, not a leak: "
        "zero3_offload/comm/collectives.py starts a waiter thread for every gloo reduce-scatter "
        "(gloo gives it no future) that exits once it completes, and psutil opens and closes "
        "/proc files for the memory figures of every step.",
        "Step ms: median of the train_step events' seconds after warm-up (rank 0's per bin in "
        "the curve). Log bytes / step: the size of the rank's JSON log at the end / its steps (the "
        "files grow by design). Work events / step: `work` lines in the log per step (the "
        "intervals the rank's timeline recorded).",
    ]
    if cfg.get("timeline_steps_kept"):
        notes[-1] = notes[-1][:-1] + (
            f"; the timeline keeps those of the last {cfg['timeline_steps_kept']} steps in memory "
            f"(at most {cfg['timeline_maxlen']:,} events)."
        )
    if payload.get("failed"):
        notes.append("FAILED: " + "; ".join(payload["failed"]))
    title = (
        f"Soak: {cfg['steps']:,} steps of the default `zero3-offload train` job, "
        f"{cfg['world_size']} ranks: RSS, threads and open fds per rank"
    )
    return Report(title, tables, notes)
