"""Rank functions that stop or kill a real rank at a chosen point of training, and the
runs that check what the other ranks report and that nothing is lost.

The faulty rank stops (SIGSTOP) or kills (SIGKILL) its own process when its
training reaches the point: the first all-gather of a forward, the first
reduce-scatter of a backward, the gradient-norm all-reduce of an optimizer step
(clipping is on), or the shard write of a checkpoint save. Nothing is replaced:
the point is found by wrapping the real call, which then does not run. Every
other rank records when and how it noticed, in a JSON file per rank, and kills
a stopped peer so the run ends. Used by ``tests/test_liveness.py`` and
``tests/test_faults.py`` (the fault table).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from helpers import lm_loss, local_slice, make_batches, make_model, train_step

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext, free_port
from zero3_offload.testing.run_ranks import process_context

PHASES = ("forward", "backward", "step", "save")
KINDS = ("stop", "kill")
LR = 1e-3
BATCH = 8


@attrs.frozen
class FaultSpec:
    """One faulty run (``kind="none"``: the uninterrupted reference)."""

    out: str  # directory of the checkpoints and of the record files
    kind: str = "none"  # "stop", "kill" or "none"
    rank: int = 1  # the rank that faults
    phase: str = "forward"  # one of PHASES
    steps: int = 4
    fault_step: int = 2  # the step in which the fault happens (checkpoint of step 1 is committed)
    heartbeat_s: float = 1.0
    model: dict[str, Any] = attrs.Factory(dict)

    def config(self) -> Zero3CpuOffloadConfig:
        return Zero3CpuOffloadConfig(
            optimizer=OptimizerConfig(kind="adamw"),
            gradient_clipping=1.0,  # the optimizer step runs a collective: the gradient norm
            heartbeat_timeout_s=self.heartbeat_s,
            collective_timeout_s=300.0,
        )


def _record(spec: FaultSpec, name: str, payload: dict[str, Any]) -> None:
    path = Path(spec.out) / f"{name}.json"
    path.write_text(json.dumps(payload))


def read_record(out: str | Path, name: str) -> dict[str, Any] | None:
    """A record a rank wrote (``fault`` by the faulty rank, ``rank{r}`` by the others)."""
    path = Path(out) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _arm(manager: Zero3CpuOffloadManager, spec: FaultSpec, step: list[int]) -> None:
    """Make this rank fault at ``spec``'s point of step ``spec.fault_step``."""
    engine = manager.engine

    def fault() -> None:
        _record(spec, "fault", {"at": time.time(), "rank": spec.rank, "pid": os.getpid()})
        os.kill(os.getpid(), signal.SIGSTOP if spec.kind == "stop" else signal.SIGKILL)

    def armed(real: Callable[..., Any], when: Callable[..., bool]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if step[0] == spec.fault_step and when(*args, **kwargs):
                fault()
            return real(*args, **kwargs)

        return call

    if spec.phase == "forward":
        engine.comm.start_all_gather = armed(  # type: ignore[method-assign]
            engine.comm.start_all_gather,
            lambda *a, **k: engine.comm.context.startswith("forward_pass"),
        )
    elif spec.phase == "backward":
        engine.comm.start_reduce_scatter_mean = armed(  # type: ignore[method-assign]
            engine.comm.start_reduce_scatter_mean, lambda *a, **k: True
        )
    elif spec.phase == "step":
        engine.comm.start_all_reduce_sum = armed(  # type: ignore[method-assign]
            engine.comm.start_all_reduce_sum, lambda *a, **k: k.get("what") == "the gradient norm"
        )
    elif spec.phase == "save":
        engine.workers.run = armed(  # type: ignore[method-assign]
            engine.workers.run, lambda kind, *a, **k: kind == "checkpoint-write"
        )
    else:
        raise ValueError(f"unknown phase {spec.phase!r}")


async def _pids(ctx: RankContext) -> list[int]:
    pids = torch.zeros(ctx.world_size, dtype=torch.int64)
    pids[ctx.rank] = os.getpid()
    dist.all_reduce(pids, group=ctx.group)
    return [int(p) for p in pids]


async def faulty_run(ctx: RankContext, spec: FaultSpec) -> dict[str, Any]:
    """Train ``spec.steps`` steps, saving after each; the faulty rank faults on the way.

    Returns (on the surviving ranks) the error class and message, or the losses and
    final parameters of a run without a fault.
    """
    pids = await _pids(ctx)
    manager = Zero3CpuOffloadManager(spec.config(), ctx.group, make_model(**spec.model))
    batches = make_batches(spec.steps, BATCH)
    step = [0]
    if spec.kind != "none" and ctx.rank == spec.rank:
        _arm(manager, spec, step)
    losses: list[float] = []
    try:
        for i in range(spec.steps):
            step[0] = i
            losses.append(await train_step(manager, ctx, batches[i], manager.layer_names, LR))
            await manager.save_checkpoint(Path(spec.out) / "ckpt")
    except Zero3Error as exc:
        detected = time.time()
        if spec.kind == "stop":
            os.kill(pids[spec.rank], signal.SIGKILL)  # the stopped rank ends with the run
        result = {"error": type(exc).__name__, "message": str(exc), "detected_at": detected}
        _record(spec, f"rank{ctx.rank}", result)
        return result
    full = await manager.full_state_dict()
    await manager.close()
    return {"losses": losses, "state": full if ctx.rank == 0 else None}


async def resumed_run(ctx: RankContext, spec: FaultSpec) -> dict[str, Any]:
    """Load the latest checkpoint of ``spec.out`` and train to ``spec.steps``."""
    manager = Zero3CpuOffloadManager(spec.config(), ctx.group, make_model(**spec.model))
    await manager.load_checkpoint(Path(spec.out) / "ckpt")
    first = manager.steps_completed
    batches = make_batches(spec.steps, BATCH)
    names = manager.layer_names
    losses = [
        await train_step(manager, ctx, batches[i], names, LR) for i in range(first, spec.steps)
    ]
    full = await manager.full_state_dict()
    await manager.close()
    return {"first": first, "losses": losses, "state": full if ctx.rank == 0 else None}


async def throttled_run(ctx: RankContext, spec: FaultSpec, busy_s: float) -> dict[str, Any]:
    """Train like the reference, but the faulty rank computes for ``busy_s`` (real
    matrix products) between each forward and backward: the others wait that long
    inside a collective while it keeps beating."""
    manager = Zero3CpuOffloadManager(spec.config(), ctx.group, make_model(**spec.model))
    names = list(manager.layer_names)
    losses = []
    waited = []
    for x, y in make_batches(spec.steps, BATCH):
        out = await manager.forward_pass(local_slice(x, ctx), names)
        out.requires_grad_()
        loss = lm_loss(out, local_slice(y, ctx))
        loss.backward()
        if ctx.rank == spec.rank:
            a = torch.randn(256, 256)
            started = time.perf_counter()
            while time.perf_counter() - started < busy_s:
                a = torch.tanh(a @ a)
        started = time.perf_counter()
        await manager.backward_pass(out.grad, names)
        waited.append(time.perf_counter() - started)
        await manager.optimizer_step(LR)
        losses.append(float(loss.item()))
    full = await manager.full_state_dict()
    await manager.close()
    return {"losses": losses, "state": full if ctx.rank == 0 else None, "waited": waited}


async def construction_run(ctx: RankContext, spec: FaultSpec) -> dict[str, Any]:
    """Build a manager; the faulty rank stops or kills itself before it starts building
    its own (``spec.phase == "before"``: the others wait in the first collectives of
    their construction, the divergence check's side group and the heartbeat's key,
    watched by the process heartbeat of the rendezvous), or as its backend probe starts
    (any other phase: the first collectives after the manager's heartbeat started).
    The others record when and how they noticed, as :func:`faulty_run` does."""
    pids = await _pids(ctx)

    def fault() -> None:
        _record(spec, "fault", {"at": time.time(), "rank": spec.rank, "pid": os.getpid()})
        os.kill(os.getpid(), signal.SIGSTOP if spec.kind == "stop" else signal.SIGKILL)

    if ctx.rank == spec.rank and spec.phase == "before":
        fault()
    elif ctx.rank == spec.rank:
        from zero3_offload.comm import collectives

        real = collectives._probe

        def probe(*args: Any, **kwargs: Any) -> Any:
            fault()
            return real(*args, **kwargs)

        collectives._probe = probe  # type: ignore[assignment]
    try:
        manager = Zero3CpuOffloadManager(spec.config(), ctx.group, make_model(**spec.model))
    except Zero3Error as exc:
        detected = time.time()
        if spec.kind == "stop":
            os.kill(pids[spec.rank], signal.SIGKILL)
        result = {"error": type(exc).__name__, "message": str(exc), "detected_at": detected}
        _record(spec, f"rank{ctx.rank}", result)
        return result
    await manager.close()
    return {"built": True}


def rendezvous_rank(
    rank: int, world_size: int, port: int, heartbeat_s: float, timeout_s: float, out: str
) -> None:
    """One rank process of a rendezvous that cannot complete (a rank is missing, or one
    is stopped or killed from outside meanwhile): it records the error it raised, and
    when, in ``out/rank{rank}.json``."""

    async def join() -> None:
        from zero3_offload.comm import destroy_process_group, init_process_group

        try:
            await init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                port=port,
                timeout_s=timeout_s,
                heartbeat_timeout_s=heartbeat_s,
            )
        except Zero3Error as exc:
            result = {"error": type(exc).__name__, "message": str(exc), "detected_at": time.time()}
        else:
            destroy_process_group()
            result = {"error": None, "message": "joined", "detected_at": time.time()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))

    asyncio.run(join())
    os._exit(0)  # the rendezvous thread stays blocked in the backend: do not join it


def rendezvous_fault(
    out: Path, *, kind: str, heartbeat_s: float, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Ranks 0 and 1 of a 3-rank rendezvous (rank 2 never starts); once rank 1 beats in
    the store, it gets SIGKILL or SIGSTOP (``kind``). Returns rank 0's record and the
    seconds from the fault to rank 0's error; ``kind="none"`` faults nobody, so the
    record is rank 0's for ranks that never arrived (after ``timeout_s``)."""
    ctx = process_context()
    port = free_port()
    procs = [
        ctx.Process(
            target=rendezvous_rank,
            # Rank 1 waits longer than rank 0: its own timeout is not what rank 0 reports.
            args=(rank, 3, port, heartbeat_s, timeout_s + 60 * rank, str(out)),
            daemon=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, 3, is_master=False, timeout=_dt.timedelta(seconds=60)
        )
        beat = "zero3/attempt-0/heartbeat/beat/1"
        store.wait([beat])
        while int(store.add(beat, 0)) < 2:  # rank 1 is beating: it is in the rendezvous
            time.sleep(0.05)
        faulted = time.time()
        if kind != "none":
            os.kill(procs[1].pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
        procs[0].join(timeout=timeout_s + 60)
        found = read_record(out, "rank0")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    seconds = None if found is None else found["detected_at"] - faulted
    return {"record": found, "seconds": seconds}
