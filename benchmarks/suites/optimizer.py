"""CPU AdamW step throughput: ShardOptimizers vs torch's AdamW (fused, foreach).

Interleaved over 16 unequal shards, against the bandwidth bound of torch's fused kernel."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import torch
from harness.render import Col, fmt
from harness.sampler import check_timing, time_interleaved

from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import OptimizerConfig
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

LR = 1e-3
check = check_timing
OPTIONS = {
    "--params": {"type": int, "help": "fp32 parameters in all"},
    "--layers": {"type": int, "default": 16, "help": "layer shards"},
    "--worker-threads": {"type": int, "default": 2, "help": "WorkerThreads of 'ours, parallel'"},
    "--copy-elements": {"type": int, "help": "fp32 elements of the copy buffers"},
}
DEFAULTS = {"repeats": 11, "warmup": 2, "params": 100_000_000, "copy_elements": 64 * 2**20}
QUICK = {"repeats": 5, "warmup": 1, "params": 2_000_000, "copy_elements": 8 * 2**20}
TITLE = "CPU AdamW optimizer step"
# fmt: off
LAYOUT = [([
    Col("system", "system"), Col("median step s", "median_s", ".4f"),
    Col("params/s", "params_per_s", "rate"), Col("ratio vs fused torch", "{ratio:.2f}x"),
    Col("fraction of bandwidth bound", "bound", ".2f"),
], "rows")]
NOTES = [
    "{config[layers]} shards, {config[params]:,} fp32 params (sizes proportional to "
    "1..{config[layers]}: {config[smallest]:,} to {config[largest]:,}); median of "
    "{config[repeats]} repeats after {config[warmup]} warm-up, cases interleaved.",
    "copy bandwidth {copy[gbs]:sig} GB/s (dst.copy_(src), {copy[elements]:,} fp32 elements, 2 x "
    "nbytes counted; median {copy[ms]:.1f} ms) -> bound {bound:rate} params/s at the {per:sig} "
    "B/param counted for torch fused (its kernel's tensors: param and moments read and written, "
    "grad read).",
    "in-place add_ bandwidth {add[gbs]:sig} GB/s (3 x nbytes counted) -> {add[params_per_s]:rate} "
    "params/s at {per:sig} B/param.",
    "ours picked fused={config[ours_fused]}; 'ours, parallel' ran its steps on {workers_seen} "
    "distinct worker threads.",
]
# fmt: on


def run(args: Any) -> dict[str, Any]:
    n, gen = args.params, torch.Generator().manual_seed(0)
    weights = args.layers * (args.layers + 1) // 2  # shard sizes proportional to 1..layers
    sizes = [n * (i + 1) // weights for i in range(args.layers)]
    sizes[-1] += n - sum(sizes)
    names = [f"layer{i:02d}" for i in range(args.layers)]
    params = [torch.randn(k, generator=gen).mul_(0.02) for k in sizes]
    grads = [torch.randn(k, generator=gen).mul_(1e-3) for k in sizes]
    layers = list(zip(names, grads, strict=True))
    src, dst = torch.randn(args.copy_elements, generator=gen), torch.empty(args.copy_elements)
    cfg = OptimizerConfig(kind="adamw")
    ours = ShardOptimizers(cfg, zip(names, params, strict=True), device=torch.device("cpu"))
    hyper = dict(
        lr=LR, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, amsgrad=cfg.amsgrad
    )
    opts = {k: torch.optim.AdamW(params, **hyper, **{k: True}) for k in ("fused", "foreach")}
    loop, timeline = asyncio.new_event_loop(), Timeline()

    async def make_workers() -> WorkerThreads:  # made inside the loop that runs them
        return WorkerThreads(threads=args.worker_threads, timeline=timeline)

    async def parallel() -> None:
        steps = [(nm, functools.partial(ours.step, nm, g, LR)) for nm, g in layers]
        await asyncio.gather(*(workers.run("cpu-optimizer", nm, Phase.STEP, s) for nm, s in steps))

    def torch_step(opt: torch.optim.Optimizer) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    workers, kernel = loop.run_until_complete(make_workers()), "fused" if ours.fused else "foreach"
    parallel_label = f"ours, parallel ({kernel}, WorkerThreads {args.worker_threads} threads)"
    systems = {f"ours, sequential ({kernel})": lambda: [ours.step(nm, g, LR) for nm, g in layers]}
    systems[parallel_label] = lambda: loop.run_until_complete(parallel())
    systems.update({f"torch AdamW {k}": functools.partial(torch_step, o) for k, o in opts.items()})
    cases = {"copy": lambda: dst.copy_(src), "add_": lambda: dst.add_(src), **systems}
    try:
        timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)
    finally:
        loop.close()

    def nbytes(tensors: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [t for st in opts["fused"].state.values() for t in st.values() if torch.is_tensor(t)]
    per = (2 * nbytes(params) + nbytes(grads) + 2 * nbytes(state)) / n
    copy_s, fused_s = timings["copy"], timings["torch AdamW fused"]
    copy, add = 2 * nbytes([src]) / copy_s, 3 * nbytes([src]) / timings["add_"]
    rows = []
    for name, s in ((name, timings[name]) for name in systems):
        rows.append({"system": name, "median_s": s, "params_per_s": n / s, "ratio": fused_s / s})
        rows[-1]["bound"] = n / s / (copy / per)
    label = f"bandwidth bound (copy / {fmt(per)} B counted for torch fused)"
    rows.append({"system": label, "params_per_s": copy / per, "bound": 1.0})
    config = {"params": n, "layers": args.layers, "repeats": args.repeats, "warmup": args.warmup}
    config.update(worker_threads=args.worker_threads, ours_fused=ours.fused)
    config.update(smallest=min(sizes), largest=max(sizes))
    copies = {"gbs": copy / 1e9, "elements": args.copy_elements, "ms": copy_s * 1e3}
    workers_seen = len({e.worker for e in timeline.events() if e.kind == "cpu-optimizer"})
    out = {"config": config, "rows": rows, "copy": copies}
    out["add"] = {"gbs": add / 1e9, "params_per_s": add / per}
    return {**out, "bound": copy / per, "per": per, "workers_seen": workers_seen}
