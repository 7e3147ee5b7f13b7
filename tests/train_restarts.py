"""Real ``zero3-offload train`` jobs under torchrun whose ranks are killed with SIGKILL.

Shared by ``test_train_restart.py`` and ``test_faults.py`` (the fault table). A job runs
the tiny model of ``test_train.SMALL``, saving after every step, under ``python -m
torch.distributed.run`` (the c10d rendezvous on 127.0.0.1); once rank 0 logged a given
step, a rank's process (its pid from its ``manager_ready`` event) gets SIGKILL. The
times come from the JSON logs' ``ts`` fields: the kill, then the first ``train_step``
of the manager built after it. ``shrunk_job`` runs two torchrun agents as two nodes of
an elastic job (``--nnodes 1:2``) and loses one of them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
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


def torchrun(nproc: int, max_restarts: int, *launcher: str, endpoint: str = "") -> list[str]:
    """The launcher: torchrun's module with the c10d rendezvous on ``endpoint`` (a free
    local port when not given) and the ``launcher`` options after its own."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint or f"127.0.0.1:{free_port()}", "--monitor-interval",
            "0.1", *launcher, "-m", "zero3_offload", "train"]  # fmt: skip


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


# The elastic rendezvous of ``shrunk_job``'s two nodes: an agent silent for 3 s (3 missed
# keep-alives of 1 s) is a dead node; a round with fewer than --nnodes' 2 nodes completes
# LAST_CALL_S after the first one joined (so the first round needs node B within it, and
# the round after the loss waits it out alone).
LAST_CALL_S = 15
RDZV_CONF = f"keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout={LAST_CALL_S}"


def _node(out: Path, endpoint: str, run_id: str, name: str, *, host: bool) -> subprocess.Popen:
    """One node of ``shrunk_job``: a torchrun agent of 1 rank in a process group of its own
    (its rank is in another one: torchelastic starts each rank in a new session), its
    output in ``OUT/../node-NAME.{out,err}``; ``host`` says it hosts the rendezvous store."""
    conf = f"{RDZV_CONF},join_timeout={int(LIMIT_S)},is_host={int(host)}"
    launcher = ["--nnodes", "1:2", "--rdzv-id", run_id, "--rdzv-conf", conf]
    command = [*torchrun(1, 3, *launcher, endpoint=endpoint), "--out", str(out), *SMALL]
    with (
        open(out.parent / f"node-{name}.out", "w") as stdout,
        open(out.parent / f"node-{name}.err", "w") as stderr,
    ):
        return subprocess.Popen(command, cwd=ROOT, stdout=stdout, stderr=stderr, env=_env(),
                                start_new_session=True)  # fmt: skip


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _parent(pid: int) -> int | None:
    try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _ready(out: Path) -> dict[int, dict[str, Any]]:
    """The last ``manager_ready`` event of each rank that logged one."""
    found = {}
    for rank in (0, 1):
        ready = [e for e in events(out, rank) if e["event"] == "manager_ready"]
        if ready:
            found[rank] = ready[-1]
    return found


def _stop(proc: subprocess.Popen) -> None:
    """End a node still running: SIGTERM (its agent stops its rank), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def shrunk_job(out: Path, *, at_step: int) -> dict[str, Any]:
    """An elastic job of two torchrun agents as two nodes (``--nnodes 1:2``, 1 rank each,
    ``--max-restarts 3``) whose second node is lost once rank 0 logged step ``at_step``.

    Node A starts first and hosts the c10d rendezvous store; node B starts once the store
    is up. The loss is SIGKILL to node B's agent and to its rank, each in its own process
    group: nothing of node B is left to leave the rendezvous. Node A's rank fails, its
    agent restarts it, the rendezvous forms again with node A alone and the job goes on
    on 1 rank. Whichever rank node B's was, node A's is rank 0 after the loss.

    Returns node A's exit status (None when it hung) and stderr, the rank and pid node B
    lost, the world size of the manager built after the kill, the seconds from the kill to
    its ``manager_ready`` and to the first step it trained (None when none came), and
    that step.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint, run_id = f"127.0.0.1:{port}", f"elastic-{port}"
    deadline = time.monotonic() + LIMIT_S
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(node_a := _node(out, endpoint, run_id, "a", host=True))
        while not _listening(port):  # node A hosts the store
            if node_a.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"node A hosted no store: {_stderr(out, 'a')}")
            time.sleep(0.02)
        nodes.append(node_b := _node(out, endpoint, run_id, "b", host=False))
        while not any(e["event"] == "train_step" and e["step"] >= at_step for e in events(out, 0)):
            if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
                raise AssertionError(
                    f"the job ended before step {at_step}: node A {_stderr(out, 'a')}\n"
                    f"node B {_stderr(out, 'b')}"
                )
            time.sleep(0.02)
        ready = _ready(out)
        if sorted(ready) != [0, 1] or {e["world_size"] for e in ready.values()} != {2}:
            raise AssertionError(f"the first rendezvous did not form with both nodes: {ready}")
        [(rank, pid)] = [(r, e["pid"]) for r, e in ready.items() if _parent(e["pid"]) == node_b.pid]
        groups = [os.getpgid(node_b.pid), os.getpgid(pid)]
        killed_at = time.time()
        for group in groups:
            os.killpg(group, signal.SIGKILL)
        node_b.wait()
        try:
            returncode: int | None = node_a.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            returncode = None  # a hang
    finally:
        for node in reversed(nodes):
            _stop(node)
    log = events(out, 0)
    restarted = [e for e in after_last_start(log) if e["ts"] > killed_at]
    new = [e for e in log if e["event"] == "manager_ready" and e["ts"] > killed_at]
    trained = bool(restarted and new)
    return {
        "returncode": returncode,
        "stderr": _stderr(out, "a"),
        "killed_rank": rank,
        "pid": pid,
        "world_size": new[-1]["world_size"] if new else None,
        "seconds": restarted[0]["ts"] - killed_at if trained else None,
        "ready_s": new[0]["ts"] - killed_at if new else None,  # the new manager built
        "first_step": restarted[0]["step"] if trained else None,
    }


def _stderr(out: Path, name: str) -> str:
    return (out.parent / f"node-{name}.err").read_text()


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
