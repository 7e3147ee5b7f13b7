"""The one launcher of rank processes: a fresh interpreter per rank, and the rank's main.

:func:`launch` starts ``world`` processes ``python -m harness.launcher SPEC.json``, each in its
own session, with its threads and (unless ``torchrun=False``) torchrun's environment; it kills
the process groups it started on failure or time-out. In the child, :func:`rank_main` calls the
spec's ``target`` (``module:function``) and writes what it returns, with the rank's memory
marks, to ``result-rank<r>.json``.
"""

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.sampler import Sampler

BENCHMARKS = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def work_directory(prefix: str, keep: bool, parent: Path | None = None) -> Iterator[Path]:
    """A fresh temporary directory for a benchmark's runs, removed afterwards unless ``keep``."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        if keep:
            print(f"work directory kept: {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def launch(
    target: str,
    spec: dict[str, Any],
    run_dir: Path,
    *,
    world: int = 1,
    torchrun: bool = True,
    timeout_s: float = 900.0,
    sample_s: float | None = None,
) -> dict[str, Any]:
    """Run ``target`` on ``world`` fresh ranks, with the spec's ``threads`` (1) each and glibc's
    ``mmap_threshold``: ``{"ok", "ranks", "wall_s", ...}`` or the error."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, threads = run_dir / "spec.json", spec.get("threads", 1)
    spec = {**spec, "target": target, "threads": threads, "out_dir": str(run_dir)}
    spec["deadline"] = time.time() + timeout_s  # for a target that paces itself
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    extensions = Path(tempfile.gettempdir()) / "zero3_offload_peers_torch_extensions"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions))  # DeepSpeed's compiled ops
    if spec.get("mmap_threshold") is not None:  # glibc mmaps blocks this large, returns them
        env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
    if torchrun:
        with socket.socket() as s:  # a port free a moment ago
            s.bind(("127.0.0.1", 0))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    procs, samplers, load, t0 = [], [], list(os.getloadavg()), time.perf_counter()
    try:
        for rank in range(world):
            ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            cmd = [sys.executable, "-m", "harness.launcher", str(spec_path)]
            rank_env = {**env, **(ranks if torchrun else {})}
            with open(run_dir / f"rank{rank}.log", "wb") as log:
                out = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
                procs.append(subprocess.Popen(cmd, env=rank_env, **out))
            if sample_s is not None:
                samplers.append(Sampler(procs[-1].pid, sample_s))
        error = _wait(procs, time.monotonic() + timeout_s, timeout_s)
    finally:
        for p in procs:  # only the processes started here, by their own process group
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for s in samplers:
            s.stop()
    run: dict[str, Any] = {"ok": error is None, "ranks": [], "wall_s": time.perf_counter() - t0}
    run["load_average_at_start"] = load
    for rank in range(world):
        path = run_dir / f"result-rank{rank}.json"
        if path.exists():
            run["ranks"].append(json.loads(path.read_text(encoding="utf-8")))
            if samplers:
                peaks, samples = samplers[rank].peaks.get("all", {}), samplers[rank].samples
                run["ranks"][-1].update(sampled_peak_bytes=peaks, samples=samples)
    if error is not None:
        run["error"], run["log_tails"] = error, {}
        for r in range(world):  # the last lines of each rank's log
            text = (run_dir / f"rank{r}.log").read_text(encoding="utf-8", errors="replace")
            run["log_tails"][r] = [line for line in text.splitlines() if line.strip()][-15:]
    return run


def _wait(procs: list[subprocess.Popen], deadline: float, timeout_s: float) -> str | None:
    """Wait for every rank; the first failure (a rank's non-zero exit, or the time-out)."""
    while True:
        codes = [p.poll() for p in procs]
        if (bad := next((r for r, c in enumerate(codes) if c not in (None, 0)), None)) is not None:
            return f"rank {bad} exited with code {codes[bad]}"
        if None not in codes:
            return None
        if time.monotonic() > deadline:
            return f"did not finish within {timeout_s:g} s"
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[codes.index(None)].wait(timeout=0.2)


class Rank:
    """What a target gets: its rank, the world size, memory marks and a partial-result save."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.out = Path(spec["out_dir"]) / f"result-rank{self.rank}.json"
        self.sampler, self.partial = Sampler(), {}
        self.mark = self.sampler.mark

    def save(self, result: dict[str, Any]) -> None:
        """Write ``result`` now: kept if the process dies later, the base of an error's result."""
        self.partial = result
        self.out.write_text(json.dumps(result, default=str), encoding="utf-8")


def load(target: str) -> Any:
    """The object a ``module:name`` string names."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def rank_main(spec_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    torch.set_num_threads(spec["threads"])
    for name in spec.get("imports", []):  # counted in the "imported" mark
        importlib.import_module(name)
    fn, ctx = load(spec["target"]), Rank(spec)
    ctx.mark("imported")
    t0, code = time.perf_counter(), 0
    try:
        result = fn(spec, ctx)
        result = asyncio.run(result) if inspect.isawaitable(result) else result
    except BaseException as exc:
        result, code = {**ctx.partial, "error": f"{type(exc).__name__}: {exc}"}, 1
        print(traceback.format_exc(), file=sys.stderr)
    ctx.mark("end")
    marks = ctx.sampler.marks
    result.update(rank=ctx.rank, world_size=ctx.world, pid=os.getpid(), marks=marks)
    result.update(torch_threads=torch.get_num_threads(), run_s=time.perf_counter() - t0)
    result["peak_rss_bytes"] = marks["end"]["hwm_bytes"]
    ctx.save(result)
    sys.stderr.flush()
    os._exit(code)  # DeepSpeed, NCCL and worker threads can abort or hold up a normal exit


if __name__ == "__main__":
    rank_main(sys.argv[1])
