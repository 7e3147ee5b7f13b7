"""What ``compare_peers.py`` runs: sizes, the systems table, the DeepSpeed probe, one run.

:func:`launch` starts one run of one system: ``world`` fresh interpreters
running ``_peers_worker.py`` with torchrun's environment variables, and
collects their per-rank results (or the error and the logs' tails).
``scaling.py`` launches its runs with it too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _common import load_average

WORKER = Path(__file__).resolve().parent / "_peers_worker.py"
WORLD = 2
LR = 3e-4
WEIGHT_DECAY = 0.01
System = tuple[str, str, int, dict[str, Any]]  # label, kind, world size, options

SIZES = {
    "quick": {"d": 128, "heads": 4, "n_layers": 2, "seq": 64, "global_batch": 8},
    "small": {"d": 512, "heads": 8, "n_layers": 6, "seq": 128, "global_batch": 8},
    "large": {"d": 1024, "heads": 16, "n_layers": 24, "seq": 128, "global_batch": 8},
}

# key -> (label, kind, world size, options)
SYSTEMS: dict[str, System] = {
    "torch": ("plain torch (1 process)", "torch", 1, {"fused": True}),
    "fsdp2": ("FSDP2", "fsdp2", WORLD, {"fused": True}),
    "fsdp2_offload": (
        "FSDP2 + CPUOffloadPolicy",
        "fsdp2",
        WORLD,
        {"fused": True, "cpu_offload": True},
    ),
    "deepspeed": ("DeepSpeed ZeRO-3 offload", "deepspeed", WORLD, {}),
    "ours_default": ("zero3_offload default", "zero3_offload", WORLD, {}),
    "ours_fast": (
        "zero3_offload tuned",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "prefetch_buffer_size": 1},
    ),
    "ours_ckpt": (
        "zero3_offload tuned + activation ckpt",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "prefetch_buffer_size": 1, "activation_checkpointing": True},
    ),
}
DEFAULT_SYSTEMS = list(SYSTEMS)

# Candidates for ours' fastest configuration (``--sweep-ours``).
_NO_OFFLOAD = {"offload_params": False, "offload_grads": False, "offload_optimizer_states": False}
SWEEP: dict[str, System] = {
    "ours_default": SYSTEMS["ours_default"],
    "lr_bwd": ("lr in backward_pass", "zero3_offload", WORLD, {"lr_in_backward": True}),
    "lr_bwd_nooffload": (
        "lr in backward, offload off",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, **_NO_OFFLOAD},
    ),
    "lr_bwd_1worker": (
        "lr in backward, cpu_worker_threads=1",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "cpu_worker_threads": 1},
    ),
    "lr_bwd_depth1": (
        "lr in backward, prefetch_buffer_size=1",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "prefetch_buffer_size": 1},
    ),
    "lr_bwd_persist": (
        "lr in backward, small layers persistent",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "param_persistence_threshold": 300_000},
    ),
    "no_prefetch": ("async_prefetch=False", "zero3_offload", WORLD, {"async_prefetch": False}),
}


# ---------------------------------------------------------------- launching


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def describe_systems(
    systems: Mapping[str, tuple[str, str, int, dict[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """The systems of a run as JSON: key -> label, kind, world size, options."""
    return {
        k: {"label": v[0], "kind": v[1], "world": v[2], "options": v[3]} for k, v in systems.items()
    }


def deepspeed_status() -> tuple[bool, str]:
    """Whether ``import deepspeed`` works here (in a child, with DS_ACCELERATOR=cpu)."""
    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed is not installed (pip install deepspeed to include it)"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return False, "import deepspeed failed: " + " | ".join(tail)
    return True, proc.stdout.strip().splitlines()[-1]


def launch(
    key: str,
    system: System,
    common: dict[str, Any],
    run_dir: Path,
    *,
    threads: int,
    timeout_s: float,
    py_spy_out: Path | None = None,
    log_dir: Path | None = None,
    mmap_threshold: int | None = None,
    rank_threads: int | None = None,
) -> dict[str, Any]:
    """Run one system once: ``world`` fresh processes; their results, or the error.

    Every rank runs ``rank_threads`` torch threads when given; otherwise
    ``threads``, and plain torch (one process) ``threads * WORLD``. Every
    system but plain torch gets torchrun's environment, also with one rank.
    With ``py_spy_out``, rank 0 runs under ``py-spy record`` (collapsed stacks
    written there); with ``log_dir``, zero3_offload ranks write JSON-lines logs
    there for ``zero3-offload analyze``.
    """
    _label, kind, world, options = system
    if log_dir is not None and kind == "zero3_offload":
        log_dir.mkdir(parents=True, exist_ok=True)
        options = {**options, "log_dir": str(log_dir)}
    run_dir.mkdir(parents=True)
    distributed = kind != "torch"
    if rank_threads is not None:
        per_rank_threads = rank_threads
    else:
        per_rank_threads = threads if distributed else threads * WORLD
    spec = {
        **common,
        "key": key,
        "kind": kind,
        "options": options,
        "threads": per_rank_threads,
        "out_dir": str(run_dir),
    }
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    base_env = {
        **os.environ,
        "OMP_NUM_THREADS": str(per_rank_threads),
        "MKL_NUM_THREADS": str(per_rank_threads),
        "DS_ACCELERATOR": "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    base_env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/zero3_offload_peers_torch_extensions")
    if mmap_threshold is not None:
        # glibc: allocations of this size or more are mmapped and returned on free
        # (what zero3_offload.memory.allocator.set_mmap_threshold sets).
        base_env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if distributed:
        base_env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "GROUP_RANK": "0",
            }
        )
    procs = []
    logs = []
    load = load_average()
    t0 = time.perf_counter()
    try:
        for rank in range(world):
            env = dict(base_env)
            if distributed:
                env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)})
            log = (run_dir / f"rank{rank}.log").open("w", encoding="utf-8")
            logs.append(log)
            cmd = [sys.executable, str(WORKER), str(spec_path)]
            if py_spy_out is not None and rank == 0:
                cmd = ["py-spy", "record", "--format", "raw", "--rate", "50", "--threads",
                       "--output", str(py_spy_out), "--", *cmd]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout_s
        error = None
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                error = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                error = f"did not finish within {timeout_s:g} s"
                break
            time.sleep(0.2)
        if error is None:
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                error = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
    finally:
        for p in procs:  # only the processes started here, by their own handle
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - t0
    if error is not None:
        tails = {}
        for rank in range(len(procs)):
            lines = (run_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
            tails[rank] = [ln for ln in lines if ln.strip()][-15:]
        return {
            "key": key,
            "ok": False,
            "error": error,
            "log_tails": tails,
            "wall_s": wall,
            "load_average_at_start": load,
        }
    ranks = [
        json.loads((run_dir / f"result-rank{r}.json").read_text(encoding="utf-8"))
        for r in range(world)
    ]
    return {"key": key, "ok": True, "ranks": ranks, "wall_s": wall, "load_average_at_start": load}
