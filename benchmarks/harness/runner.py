"""The one job runner: every measured job in fresh processes, watched, bounded in time and
cleaned up; :func:`launch` runs a suite's ``module:function`` on rank processes, which write what
it returns, with their marks, to ``result-rank<r>.json``; and the plan of a suite's runs."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from harness.sampler import Sampler, proc_status

BENCHMARKS = Path(__file__).resolve().parent.parent


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def work_directory(prefix: str, keep: bool, parent: Path | None = None) -> Iterator[Path]:
    """A fresh temporary directory for a suite's runs, removed afterwards unless ``keep``."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        if keep:
            progress(f"work directory kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


class Processes(contextlib.AbstractContextManager):
    """``(command, env)`` pairs started in their own sessions, output to ``logs``."""

    def __init__(self, jobs: Sequence[tuple[list[str], dict[str, str]]], logs: list[Path]) -> None:
        self.procs: list[subprocess.Popen] = []
        for (command, env), path in zip(jobs, logs, strict=True):
            with open(path, "wb") as log:
                out = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
                self.procs.append(subprocess.Popen(command, env=env, **out))

    def wait(self, timeout_s: float, poll: Callable[[], None] | None = None) -> str | None:
        """Wait for every process (calling ``poll`` meanwhile); the first failure, or None."""
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in self.procs]
            if bad := [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]:
                return f"process {bad[0][0]} exited with code {bad[0][1]}"
            if None not in codes:
                return None
            if time.monotonic() > deadline:
                return f"did not finish within {timeout_s:g} s"
            if poll is not None:
                poll()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[codes.index(None)].wait(timeout=0.2)

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:  # only the processes started here, by their own process group
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def tail(path: Path, lines: int = 15) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if line.strip()][-lines:]


def launch(target: str, spec: dict[str, Any], run_dir: Path, world: int = 1, **kw: Any) -> dict:
    """Run ``target`` on fresh ranks (``kw``: ``torchrun``, ``timeout_s``, ``sample_s``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"threads": 1, **spec, "target": target, "out_dir": str(run_dir)}
    (run_dir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), env.get("PYTHONPATH")]))
    env.update(dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS"), str(spec["threads"])))
    extensions = Path(tempfile.gettempdir()) / "zero3_offload_peers_torch_extensions"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions))  # DeepSpeed's compiled ops
    for lock in Path(env["TORCH_EXTENSIONS_DIR"]).glob("*/lock"):  # runs never overlap:
        lock.unlink()  # left by a rank killed while compiling, it would hold every later run
    if spec.get("mmap_threshold") is not None:  # glibc mmaps blocks this large, returns them
        env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
    ranks: list[dict[str, str]] = [{} for _ in range(world)]
    if kw.get("torchrun", True):
        with socket.socket() as s:  # a port free a moment ago
            s.bind(("127.0.0.1", 0))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
        ranks = [dict.fromkeys(("RANK", "LOCAL_RANK", "ROLE_RANK"), str(r)) for r in range(world)]
    command = [sys.executable, "-m", "harness.runner", str(run_dir / "spec.json")]
    logs = [run_dir / f"rank{r}.log" for r in range(world)]
    sampler = Sampler(kw["sample_s"]) if kw.get("sample_s") else None
    run, t0 = {"load_average_at_start": list(os.getloadavg()), "ranks": []}, time.perf_counter()
    try:
        with Processes([(command, {**env, **r}) for r in ranks], logs) as procs:
            for r, p in enumerate(procs.procs if sampler else []):
                sampler.watch(r, p.pid)
            error = procs.wait(kw.get("timeout_s", 900.0))
    finally:
        if sampler:
            sampler.stop()
    run.update(ok=error is None, wall_s=time.perf_counter() - t0)
    for r in range(world):
        if (path := run_dir / f"result-rank{r}.json").exists():
            run["ranks"].append(json.loads(path.read_text(encoding="utf-8")))
            run["ranks"][-1]["sampled_peak_bytes"] = sampler.peaks.get(r, {}) if sampler else {}
    if error is not None:
        run["error"] = error.replace("process", "rank")
        run["log_tails"] = {r: tail(path) for r, path in enumerate(logs)}
    return run


class Rank:
    """What a target gets: its rank, the world size and its memory marks."""

    def __init__(self) -> None:
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.marks: dict[str, dict[str, Any]] = {}

    def mark(self, name: str) -> None:
        """This process's ``VmHWM`` and ``VmRSS`` now, as ``name``."""
        st = proc_status()
        self.marks[name] = {"hwm_bytes": st["VmHWM"], "rss_bytes": st["VmRSS"]}

    def reset_peak(self) -> None:
        """Start ``VmHWM`` again from ``VmRSS`` (Linux: ``clear_refs`` 5): the next marks'
        high-water marks are those of what ran since."""
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")


def rank_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    torch.set_num_threads(spec["threads"])
    for name in spec.get("imports", []):  # counted in the "imported" mark
        importlib.import_module(name)
    module, name = spec["target"].split(":")
    fn, ctx = getattr(importlib.import_module(module), name), Rank()
    ctx.mark("imported")
    t0, code = time.perf_counter(), 0
    try:
        result = fn(spec, ctx)
        result = asyncio.run(result) if inspect.isawaitable(result) else result
    except BaseException as exc:
        result, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        print(traceback.format_exc(), file=sys.stderr)
    ctx.mark("end")
    result.update(rank=ctx.rank, world_size=ctx.world, pid=os.getpid(), marks=ctx.marks)
    result.update(torch_threads=torch.get_num_threads(), run_s=time.perf_counter() - t0)
    result["peak_rss_bytes"] = max(m["hwm_bytes"] for m in ctx.marks.values())  # resets too
    if "set_up" in ctx.marks:  # the high-water mark was reset there: the steps' own peak
        result["step_peak_rss_bytes"] = ctx.marks["end"]["hwm_bytes"]
    out = Path(spec["out_dir"]) / f"result-rank{ctx.rank}.json"
    out.write_text(json.dumps(result, default=str), encoding="utf-8")
    sys.stderr.flush()
    os._exit(code)  # DeepSpeed, NCCL and worker threads can abort or hold up a normal exit


def plan(keys: Sequence[str], rounds: int, sizes: Sequence = ("",), rotate: bool = True) -> list:
    """Every run in order: in a round every case once, the order rotated per round and size."""
    out: list[dict[str, Any]] = []
    for r in range(rounds):
        for i, size in enumerate(sizes):
            k = (i + r) % len(keys) if rotate else 0
            for key in [*keys[k:], *keys[:k]]:
                entry = {"index": len(out), "round": r, "key": key}
                out.append({**entry, "size": size} if size else entry)
    return out


def run_plan(entries: list[dict], run_one: Callable) -> list[dict]:
    """Run every entry, but not again a case that failed; progress to stderr."""
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
        progress(f"{tag}: {'done' if run['ok'] else 'FAILED: ' + run['error']} {took}")
        failed |= set() if run["ok"] else {case}
        for rank, lines in run.get("log_tails", {}).items():
            progress("\n    ".join([f"  rank {rank} log tail:", *lines]))
    return runs


def cases(module: str, names: dict[str, str], spec: dict, work: Path, args: Any, **kw: Any) -> Any:
    """``module:save``, then each case's target on fresh ranks, rounds interleaved."""
    if not (saved := launch(f"{module}:save", spec, work / "save", **kw["save"]))["ok"]:
        progress(f"saving failed: {saved['error']}\n" + "\n".join(saved["log_tails"][0]))
        return None, [], []

    def one(e: dict[str, Any]) -> dict[str, Any]:
        name, run_dir = names[e["key"]], work / f"round{e['round']}-{names[e['key']]}"
        return launch(f"{module}:{name}", {**spec, "case": name}, run_dir, **kw["case"])

    n_rounds = args.warmup + args.repeats
    entries = plan(list(names), n_rounds, rotate=kw.get("rotate", True))
    runs = run_plan(entries, one)
    rounds = [{r["key"]: r for r in runs if r["round"] == i} for i in range(n_rounds)]
    return saved, runs, rounds[args.warmup :]


if __name__ == "__main__":
    rank_main(sys.argv[1])
