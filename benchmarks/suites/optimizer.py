"""CPU AdamW step throughput: ShardOptimizers (sequential and on WorkerThreads) vs torch's AdamW.

Interleaved over the same 16 unequal shards, with ``copy_`` and ``add_`` as bandwidth references.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import torch
from harness.plan import check_timing, time_interleaved
from harness.report import Report, cols, fmt, fmt_rate, markdown_table

BYTES_PER_PARAM = 28  # AdamW: param r/w, grad r, exp_avg r/w, exp_avg_sq r/w, fp32
LR = 1e-3

check = check_timing


OPTIONS = {
    "--params": {"type": int, "help": "fp32 parameters in all (100M; quick 2M)"},
    "--layers": {"type": int, "default": 16, "help": "layer shards (16)"},
    "--worker-threads": {"type": int, "default": 2, "help": "WorkerThreads of 'ours, parallel'"},
    "--copy-elements": {"type": int, "help": "fp32 elements of the copy buffers (64M; quick 8M)"},
}
DEFAULTS = {"repeats": 11, "warmup": 2, "params": 100_000_000, "copy_elements": 64 * 2**20}
QUICK, EPILOG = {"repeats": 5, "warmup": 1, "params": 2_000_000, "copy_elements": 8 * 2**20}, None


def run(args: Any) -> dict[str, Any]:
    from zero3_offload.comm.worker_threads import WorkerThreads
    from zero3_offload.config import OptimizerConfig
    from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
    from zero3_offload.stats.timeline import Timeline

    n = args.params
    gen = torch.Generator().manual_seed(0)
    weights = args.layers * (args.layers + 1) // 2  # shard sizes proportional to 1..layers
    sizes = [n * (i + 1) // weights for i in range(args.layers)]
    sizes[-1] += n - sum(sizes)
    names = [f"layer{i:02d}" for i in range(args.layers)]
    params = [torch.randn(k, generator=gen).mul_(0.02) for k in sizes]
    grads = [torch.randn(k, generator=gen).mul_(1e-3) for k in sizes]
    src, dst = torch.randn(args.copy_elements, generator=gen), torch.empty(args.copy_elements)
    cfg = OptimizerConfig(kind="adamw")
    ours = ShardOptimizers(cfg, zip(names, params, strict=True), device=torch.device("cpu"))
    hyper = {"lr": LR, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    torch_opts = {
        kernel: torch.optim.AdamW(params, amsgrad=cfg.amsgrad, **hyper, **{kernel: True})
        for kernel in ("fused", "foreach")
    }
    loop, timeline = asyncio.new_event_loop(), Timeline()

    async def make_workers() -> WorkerThreads:  # made inside the loop that runs them
        return WorkerThreads(threads=args.worker_threads, timeline=timeline)

    workers = loop.run_until_complete(make_workers())

    def sequential() -> None:
        for name, grad in zip(names, grads, strict=True):
            ours.step(name, grad, LR)

    async def parallel() -> None:
        steps = (functools.partial(ours.step, n, g, LR) for n, g in zip(names, grads, strict=True))
        await asyncio.gather(
            *(workers.run("cpu-optimizer", n, "step", s) for n, s in zip(names, steps, strict=True))
        )

    def torch_step(opt: torch.optim.Optimizer) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    kernel = "fused" if ours.fused else "foreach"
    parallel_label = f"ours, parallel ({kernel}, WorkerThreads {args.worker_threads} threads)"
    systems = {
        f"ours, sequential ({kernel})": sequential,
        parallel_label: lambda: loop.run_until_complete(parallel()),
        "torch AdamW fused": functools.partial(torch_step, torch_opts["fused"]),
        "torch AdamW foreach": functools.partial(torch_step, torch_opts["foreach"]),
    }
    cases = {"copy": lambda: dst.copy_(src), "add_": lambda: dst.add_(src), **systems}
    try:
        timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)
    finally:
        loop.close()
    state = {"ours": ours.state_bytes()}
    for kernel_name, opt in torch_opts.items():  # every system keeps its own moments
        tensors = [v for st in opt.state.values() for v in st.values()]
        state[f"torch AdamW {kernel_name}"] = sum(v.numel() * v.element_size() for v in tensors)
    assert min(state.values()) >= 8 * n, f"a system kept no moments: {state}"
    nbytes = src.numel() * src.element_size()

    def bandwidth(case: str, moved: int) -> dict[str, Any]:
        """A reference case's bytes moved per second (``moved`` bytes a call)."""
        rate = moved / timings[case]["median_s"]
        return {"elements": args.copy_elements, "timing": timings[case], "bytes_per_s": rate}

    copy = {**bandwidth("copy", 2 * nbytes), "bytes_moved_per_copy": 2 * nbytes}
    add = {**bandwidth("add_", 3 * nbytes), "bytes_moved_per_add": 3 * nbytes}
    bound, fused_s = copy["bytes_per_s"] / BYTES_PER_PARAM, timings["torch AdamW fused"]["median_s"]
    results = [
        {
            "system": name,
            "timing": timings[name],
            "params_per_s": n / timings[name]["median_s"],
            "ratio_vs_torch_fused": fused_s / timings[name]["median_s"],
            "fraction_of_bandwidth_bound": n / timings[name]["median_s"] / bound,
        }
        for name in systems
    ]
    config = {
        "params": n,
        "layers": args.layers,
        "shard_sizes": sizes,
        "worker_threads": args.worker_threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "lr": LR,
        "ours_fused": ours.fused,
        "optimizer": {**hyper, "kind": cfg.kind, "amsgrad": cfg.amsgrad},
    }
    seen = sorted({e.worker for e in timeline.events() if e.kind == "cpu-optimizer"})
    return {
        "config": config,
        "copy_bandwidth": copy,
        "inplace_add_bandwidth": add,
        "adamw_bytes_per_param": BYTES_PER_PARAM,
        "bandwidth_bound_params_per_s": bound,
        "state_bytes": state,
        "results": results,
        "parallel_worker_threads_seen": seen,
    }


def report(payload: dict[str, Any]) -> Report:
    cfg, copy = payload["config"], payload["copy_bandwidth"]
    bound, sizes = payload["bandwidth_bound_params_per_s"], cfg["shard_sizes"]
    rows = []
    for r in payload["results"]:
        step, ratio = f"{r['timing']['median_s']:.4f}", f"{r['ratio_vs_torch_fused']:.2f}x"
        fraction = f"{r['fraction_of_bandwidth_bound']:.2f}"
        rows.append([r["system"], step, fmt_rate(r["params_per_s"]), ratio, fraction])
    rows.append(["bandwidth bound (copy / 28 B)", "-", fmt_rate(bound), "-", "1.00"])
    headers = cols(
        "system; median step s; params/s; ratio vs fused torch; fraction of bandwidth bound"
    )
    add_bw = payload["inplace_add_bandwidth"]["bytes_per_s"]
    per = payload["adamw_bytes_per_param"]
    notes = [
        f"{cfg['layers']} shards, {cfg['params']:,} fp32 params (sizes proportional to "
        f"1..{cfg['layers']}: {min(sizes):,} to {max(sizes):,}); median of {cfg['repeats']} "
        f"repeats after {cfg['warmup']} warm-up, cases interleaved.",
        f"copy bandwidth {fmt(copy['bytes_per_s'] / 1e9)} GB/s (dst.copy_(src), "
        f"{copy['elements']:,} fp32 elements, 2 x nbytes counted; median "
        f"{copy['timing']['median_s'] * 1e3:.1f} ms) -> bound {fmt_rate(bound)} params/s at "
        f"{per} B/param.",
        f"in-place add_ bandwidth {fmt(add_bw / 1e9)} GB/s (3 x nbytes counted) -> "
        f"{fmt_rate(add_bw / per)} params/s at {per} B/param.",
        "ratio vs fused torch = torch-fused step time / system step time (>1 is faster).",
        f"ours picked fused={cfg['ours_fused']}; 'ours, parallel' ran on worker threads "
        f"{payload['parallel_worker_threads_seen']}.",
    ]
    return Report("CPU AdamW optimizer step", markdown_table(headers, rows), notes)
