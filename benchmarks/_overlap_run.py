"""The measured side of ``bench_overlap.py``: one run's spec and the rank body.

Per timed step and rank, the step's wall time, the library's timeline and
communication stats deltas, and the collectives' isolated cost (see the
docstring of ``bench_overlap.py`` for the definitions).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import lm_loss, make_batches, make_model

WORLD = 2
LR = 1e-3
ISO_REPEATS = 5
OFF, ON = "prefetch off", "prefetch on"
PREFETCH_KEYS = ("requests", "hits", "partial_hits", "misses", "wasted", "cancelled")


@attrs.frozen
class RunSpec:
    """One run: a configuration, the model, the data and how many steps."""

    async_prefetch: bool
    prefetch_buffer_size: int
    d: int
    heads: int
    n_blocks: int
    batch: int  # global batch (split over the ranks)
    warmup: int
    steps: int
    seed: int


def _local(t: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    per = t.shape[0] // ctx.world_size
    return t[ctx.rank * per : (ctx.rank + 1) * per]


def _span(events: list[Any], kind: str, phase: str | None = None) -> float:
    return sum(
        e.end - e.start for e in events if e.kind == kind and (phase is None or e.phase == phase)
    )


async def _isolated_comm(manager: Zero3CpuOffloadManager) -> dict[str, dict[str, float]]:
    """Median seconds of each layer's all-gather and reduce-scatter, run alone."""
    out: dict[str, dict[str, float]] = {"all_gather": {}, "reduce_scatter": {}}
    for name, layout in manager.engine.layouts.items():
        if not layout.padded_numel:
            continue
        full = torch.zeros(layout.padded_numel, dtype=torch.float32)
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32)
        for op in out:
            samples = []
            for _ in range(ISO_REPEATS + 1):  # the first one is a warm-up
                t0 = time.perf_counter()
                if op == "all_gather":
                    await manager.engine.comm.all_gather(full, shard)
                else:
                    await manager.engine.comm.reduce_scatter_mean(shard, full)
                samples.append(time.perf_counter() - t0)
            out[op][name] = statistics.median(samples[1:])
    return out


async def overlap_run(ctx: RankContext, spec: RunSpec) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; per timed step, times and the library's stats deltas."""
    model = make_model(seed=spec.seed, d=spec.d, heads=spec.heads, n_blocks=spec.n_blocks)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw"),
        async_prefetch=spec.async_prefetch,
        prefetch_buffer_size=spec.prefetch_buffer_size,
    )
    batches = make_batches(spec.warmup + spec.steps, spec.batch, seed=spec.seed + 1)
    marks: list[tuple[float, float, float, float, float, float]] = []
    snaps = []
    losses = []
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        first = manager.get_performance_stats()
        for x, y in batches:
            xs, ys = _local(x, ctx), _local(y, ctx)
            t0 = time.perf_counter()
            out = await manager.forward_pass(xs, names)
            t1 = time.perf_counter()
            out.requires_grad_()
            loss = lm_loss(out, ys)
            loss.backward()
            t2 = time.perf_counter()
            await manager.backward_pass(out.grad, names)
            t3 = time.perf_counter()
            await manager.optimizer_step(LR)
            t4 = time.perf_counter()
            snaps.append(manager.get_performance_stats())
            t5 = time.perf_counter()  # the next step starts now
            marks.append((t0, t1, t2, t3, t4, t5))
            losses.append(loss.item())
        iso = await _isolated_comm(manager)
        layer_numel = {n: lay.numel for n, lay in manager.engine.layouts.items()}
    steps = []
    for i in range(spec.warmup, len(batches)):
        prev, snap = (snaps[i - 1] if i else first), snaps[i]
        t0, t1, t2, t3, t4, t5 = marks[i]
        events = snap.timeline[len(prev.timeline) :]  # recorded during this step
        comm = {
            op: {
                "operations": c.operations - prev.communication.get(op, type(c)()).operations,
                "time_s": c.time - prev.communication.get(op, type(c)()).time,
                "bytes": c.bytes - prev.communication.get(op, type(c)()).bytes,
            }
            for op, c in snap.communication.items()
        }
        pre = {k: snap.prefetch.get(k, 0) - prev.prefetch.get(k, 0) for k in PREFETCH_KEYS}
        uses = pre["hits"] + pre["partial_hits"] + pre["misses"]
        compute_fwd = _span(events, "compute", "forward")
        compute_bwd = _span(events, "compute", "backward")
        optimizer = snap.total_optimizer_time - prev.total_optimizer_time
        compute_only = compute_fwd + compute_bwd + optimizer
        t_step = t5 - t0
        t_comm = sum(c["time_s"] for c in comm.values())
        gathered = [e.layer for e in events if e.kind == "gather"]
        iso_comm = sum(iso["all_gather"][n] for n in gathered) + sum(iso["reduce_scatter"].values())
        exposed = t_step - compute_only
        steps.append(
            {
                "t_step_s": t_step,
                "t_compute_only_s": compute_only,
                "compute_forward_s": compute_fwd,
                "compute_backward_s": compute_bwd,
                "optimizer_s": optimizer,
                "t_comm_s": t_comm,
                "t_comm_isolated_s": iso_comm,
                "exposed_s": exposed,
                "exposed_fraction": exposed / t_comm if t_comm > 0 else float("nan"),
                "exposed_fraction_isolated": exposed / iso_comm if iso_comm > 0 else float("nan"),
                "forward_call_s": t1 - t0,
                "loss_s": t2 - t1,
                "backward_call_s": t3 - t2,
                "optimizer_call_s": t4 - t3,
                "snapshot_s": t5 - t4,
                "forward_not_compute_s": (t1 - t0) - compute_fwd,
                "backward_not_compute_s": (t3 - t2) - compute_bwd,
                "gather_intervals_s": _span(events, "gather"),
                "gathers": len(gathered),
                "cpu_optimizer_jobs_s": _span(events, "cpu-optimizer"),
                "compress_jobs_s": _span(events, "compress"),
                "grad_accumulate_jobs_s": _span(events, "grad-accumulate"),
                "communication": comm,
                "prefetch": pre,
                "hit_rate": (pre["hits"] + pre["partial_hits"]) / uses if uses else 0.0,
                "full_hit_rate": pre["hits"] / uses if uses else 0.0,
            }
        )
    return {
        "rank": ctx.rank,
        "losses": losses,
        "steps": steps,
        "isolated_comm_s": iso,
        "layer_numel": layer_numel,
        "torch_threads": torch.get_num_threads(),
    }
