"""The ``zero3-offload train`` job as a user runs it (soak): its command, run by the job
runner, its ranks (the descendants holding ``logs/rank<r>.jsonl`` open) sampled from outside,
and their JSON logs read with ``zero3_offload.analyze`` (and the lines it does not parse)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from harness.runner import Processes, tail
from harness.sampler import Sampler
from zero3_offload.analyze import StepRecord, WorkRecord, parse_record

WORLD = 2  # the default job's ranks (zero3-offload train's --world-size default)
DEFAULT_THREADS = max(1, (os.cpu_count() or 1) // WORLD)  # what the job picks by itself
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def command(steps: int, threads: int, flags: list[str]) -> list[str]:
    """``python -m zero3_offload train`` with every option at its default but these."""
    job = f"python -m zero3_offload train --steps {steps} --out DIR --threads {threads}"
    return [*job.split(), *flags]


def find_ranks(parent: int, logs: Path) -> dict[int, int]:
    """rank -> pid of the descendants of ``parent`` that hold ``logs/rank<r>.jsonl`` open."""
    wanted, found = {os.path.realpath(logs / f"rank{r}.jsonl"): r for r in range(WORLD)}, {}
    with contextlib.suppress(psutil.Error):  # gone (the job, or a child) while looked at
        for child in psutil.Process(parent).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                paths = [f.path for f in child.open_files()]
                found.update({wanted[path]: child.pid for path in paths if path in wanted})
    return found


def run(argv: list[str], out: Path, timeout_s: float, sample_s: float | None = None) -> dict:
    """Run the job (``argv`` of :func:`command`) into ``out``, ranks sampled every ``sample_s``."""
    argv = [sys.executable, *(str(out) if a == "DIR" else a for a in argv[1:])]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}  # local ranks
    sampler = Sampler(sample_s, keep=True) if sample_s else None
    t0, started = time.perf_counter(), time.time()

    def poll() -> None:
        if sampler and len(sampler.pids) < WORLD:
            for rank, pid in find_ranks(procs.procs[0].pid, out / "logs").items():
                sampler.watch(rank, pid)

    try:
        with Processes([(argv, env)], [out.with_suffix(".log")]) as procs:
            error = procs.wait(timeout_s, poll)
    finally:
        if sampler:
            sampler.stop()
    logs = [out / "logs" / f"rank{r}.jsonl" for r in range(WORLD)]
    error = error and error.replace("process 0", "the job")
    got = {"started": started, "wall_s": time.perf_counter() - t0, "error": error}
    got["output_tail"] = tail(out.with_suffix(".log"), 12)
    got["samples"] = [sampler.samples.get(r, []) for r in range(WORLD)] if sampler else None
    return {**got, "logs": [read_log(path) if path.exists() else None for path in logs]}


def read_log(path: Path) -> dict[str, Any]:
    """One rank's log: steps, their collectives, work count, train steps, train_done, size."""
    out: dict[str, Any] = {"steps": [], "collectives": [], "work": 0, "train": [], "done": None}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = parse_record(line)
            except ValueError:  # a line cut short, or not an event
                continue
            if isinstance(record, WorkRecord):
                out["work"] += 1
            elif isinstance(record, StepRecord):
                out["steps"].append(record)
                out["collectives"].append(json.loads(line).get("collectives", {}))
            elif record == "train_step":
                event = json.loads(line)
                out["train"].append((event["step"], event["loss"], event["seconds"]))
            elif record == "train_done":
                out["done"] = json.loads(line)
    return {**out, "bytes": path.stat().st_size}
