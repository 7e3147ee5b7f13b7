"""Real ``zero3-offload train`` jobs under torchrun whose ranks are killed with SIGKILL.

Shared by ``test_train_restart.py`` and ``test_faults.py`` (the fault table). A job runs
the tiny model of ``test_train.SMALL``, saving after every step, under ``python -m
torch.distributed.run`` (the c10d rendezvous on 127.0.0.1); once rank 0 logged a given
step, a rank's process (its pid from its ``manager_ready`` event) gets SIGKILL. The
times come from the JSON logs' ``ts`` fields: the kill, then the first ``train_step``
of the manager built after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zero3_offload.checkpoint.consolidate import iter_full_parameters
from zero3_offload.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
SMALL = [
    "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
    "--batch-size", "4", "--eval-batches", "2", "--warmup-steps", "0", "--lr", "1e-2",
    "--log-every", "1", "--corpus-mb", "1", "--steps", str(STEPS), "--save-every", "1",
]  # fmt: skip
LIMIT_S = 240.0  # a job still running after this long counts as a hang


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}


def train(out: Path, *args: str, world_size: int = 2) -> subprocess.CompletedProcess:
    """An uninterrupted run on ``world_size`` local ranks (the reference)."""
    command = [sys.executable, "-m", "zero3_offload", "train", "--world-size", str(world_size),
               "--out", str(out), *SMALL, *args]  # fmt: skip
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S, env=_env()
    )


def reference(directory: Path) -> Path:
    """The uninterrupted 2-rank run the restarted jobs are compared with, in ``directory``."""
    out = directory / "run"
    proc = train(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def torchrun(nproc: int, max_restarts: int) -> list[str]:
    """The launcher: torchrun's module with the c10d rendezvous on a free local port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1",
            "-m", "zero3_offload", "train"]  # fmt: skip


def events(out: Path, rank: int) -> list[dict[str, Any]]:
    """The events of ``rank``'s JSON log so far (a restarted rank appends to it)."""
    path = out / "logs" / f"rank{rank}.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    # The last line may be half written while the rank runs.
    return [json.loads(line) for line in lines if line.endswith("}")]


def after_last_start(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``train_step`` events of the last manager built (after its ``manager_ready``)."""
    starts = [i for i, e in enumerate(log) if e["event"] == "manager_ready"]
    return [e for e in log[starts[-1] if starts else 0 :] if e["event"] == "train_step"]


def killed_job(
    out: Path, *, kill_rank: int, at_step: int, nproc: int = 2, max_restarts: int = 3
) -> dict[str, Any]:
    """A torchrun job whose ``kill_rank`` gets SIGKILL once rank 0 logged step ``at_step``.

    Returns the job's exit status and stderr, the killed pid, and the seconds from the
    kill to the first step of the restarted job and to its manager's ``manager_ready``
    (None when none came).
    """
    command = [*torchrun(nproc, max_restarts), "--out", str(out), *SMALL]
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    deadline = time.monotonic() + LIMIT_S
    while not any(e["event"] == "train_step" and e["step"] >= at_step for e in events(out, 0)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the job ended before step {at_step}: {proc.communicate()}")
        time.sleep(0.02)
    pid = [e["pid"] for e in events(out, kill_rank) if e["event"] == "manager_ready"][-1]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return {"returncode": None, "stderr": err, "pid": pid, "seconds": None}
    log = events(out, 0)
    restarted = [e for e in after_last_start(log) if e["ts"] > killed_at]
    ready = [e for e in log if e["event"] == "manager_ready" and e["ts"] > killed_at]
    return {
        "returncode": proc.returncode,
        "stderr": err,
        "pid": pid,
        "seconds": restarted[0]["ts"] - killed_at if restarted and ready else None,
        "ready_s": ready[0]["ts"] - killed_at if ready else None,  # the new manager built
        "first_step": restarted[0]["step"] if restarted and ready else None,
    }


def parameters(out: Path) -> dict[str, torch.Tensor]:
    """The full parameters of the latest checkpoint in ``out``."""
    return {name: load() for name, _, load in iter_full_parameters(out / "checkpoints")}


def losses(out: Path) -> dict[int, float]:
    """Rank 0's loss of each step, the last one logged for it (a resumed step's)."""
    return {e["step"]: e["loss"] for e in events(out, 0) if e["event"] == "train_step"}


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
