"""Declarative runs: a plan of (round, size, case) in a balanced order, and the loop running it;
and in-process cases timed round-robin.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MIN_REPEATS = 5


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def plan(keys: Sequence[str], rounds: int, sizes: Sequence = ("",), rotate: bool = True) -> list:
    """Every run in order: ``{"index", "round", "key"}`` and ``"size"`` when sizes are given."""
    out: list[dict[str, Any]] = []
    for r in range(rounds):
        for i, size in enumerate(sizes):
            k = (i + r) % len(keys) if rotate else 0
            for key in [*keys[k:], *keys[:k]]:
                entry = {"index": len(out), "round": r, "key": key}
                out.append({**entry, "size": size} if size else entry)
    return out


def run_plan(entries: list[dict], run_one: Callable, describe: Callable) -> list[dict]:
    """Run every entry (``run_one`` returns the run: ``ok``, ``wall_s``, or an ``error``); a case
    that failed is not run again. Progress, and the time elapsed, go to stderr."""
    runs, failed, started = [], set(), time.perf_counter()
    for e in entries:
        case = (e.get("size", ""), e["key"])
        tag = f"[{e['index'] + 1}/{len(entries)}] round {e['round']} {' '.join(filter(None, case))}"
        if case in failed:
            progress(f"{tag}: skipped (failed before)")
            continue
        progress(f"{tag}: running ...")
        runs.append(run := {**run_one(e), **e})
        took = f"(run {run['wall_s']:.1f} s, {time.perf_counter() - started:.0f} s in all)"
        if run["ok"]:
            progress(f"{tag}: {describe(run)} {took}")
            continue
        failed.add(case)
        progress(f"{tag}: FAILED: {run['error']} {took}")
        for rank, tail in run.get("log_tails", {}).items():
            progress("\n    ".join([f"  rank {rank} log tail:", *tail]))
    return runs


def check_timing(args: Any) -> str | None:
    """The timing rules of in-process suites."""
    if args.repeats < MIN_REPEATS or args.warmup < 1:
        return f"need --repeats >= {MIN_REPEATS} (the median of at least 5) and --warmup >= 1"
    return None


def time_interleaved(cases: Mapping[str, Callable], *, warmup: int, repeats: int) -> dict:
    """Each case's ``{"median_s", "min_s", "max_s", "repeats", "samples_s"}``: ``repeats`` timed
    runs round-robin after ``warmup`` untimed runs of each."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    out = {}
    for name, s in samples.items():
        out[name] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
        out[name].update(repeats=len(s), samples_s=s)
    return out
