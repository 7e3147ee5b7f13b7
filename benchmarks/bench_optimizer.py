"""CPU AdamW step throughput of ``ShardOptimizers`` against torch.optim.AdamW.

What is measured (all in one process, cases interleaved round-robin, median of
the timed repeats after warm-up; see ``_common.py``):

- **ours, sequential**: ``ShardOptimizers.step(layer, grad, lr)`` for each
  of the layer shards in turn (the manager picks the fused kernel when torch
  has one for the CPU);
- **ours, parallel**: the same per-layer steps dispatched through
  ``WorkerThreads(threads=N)`` and ``asyncio.gather``, which is how the manager
  runs them in ``optimizer_step``;
- **torch AdamW fused** / **torch AdamW foreach**: one ``torch.optim.AdamW``
  over the same shard tensors, with the same hyper-parameters;
- **copy bandwidth**: ``dst.copy_(src)`` on large preallocated fp32 buffers,
  counted as ``2 * nbytes`` moved. AdamW reads and writes about 28 bytes per
  parameter (param r/w, grad r, exp_avg r/w, exp_avg_sq r/w = 7 x 4 bytes), so
  ``bandwidth / 28`` params/s is the memory-bandwidth bound that every system
  is reported against. For reference the in-place ``dst.add_(src)`` rate is
  measured too (3 x nbytes: two reads and an in-place write, which, unlike a
  copy, pays no write-allocate read of the destination).

All shards, gradients and copy buffers are allocated once, before timing.
Every system owns its own optimizer state (counted from the state tensors)
and all of them update the same parameter tensors.

Run: ``python benchmarks/bench_optimizer.py`` (about a minute) or with
``--quick`` (seconds). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from pathlib import Path

import torch

from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import OptimizerConfig
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.stats.timeline import Timeline

try:
    from _common import (
        add_common_args,
        apply_threads,
        check_common_args,
        default_out,
        fmt,
        fmt_rate,
        machine_info,
        machine_line,
        markdown_table,
        time_interleaved,
        write_results,
    )
except ModuleNotFoundError:  # run as ``python -m benchmarks.bench_optimizer``
    from benchmarks._common import (
        add_common_args,
        apply_threads,
        check_common_args,
        default_out,
        fmt,
        fmt_rate,
        machine_info,
        machine_line,
        markdown_table,
        time_interleaved,
        write_results,
    )

NAME = "optimizer"
ADAMW_BYTES_PER_PARAM = 28  # param r/w + grad r + exp_avg r/w + exp_avg_sq r/w, fp32
LR = 1e-3


def shard_sizes(total: int, layers: int) -> list[int]:
    """``layers`` unequal sizes summing to ``total``: proportional to 1, 2, ..., layers."""
    weight_sum = layers * (layers + 1) // 2
    sizes = [total * (i + 1) // weight_sum for i in range(layers)]
    sizes[-1] += total - sum(sizes)
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="CPU AdamW optimizer-step throughput (params/s): ShardOptimizers "
        "(sequential and through WorkerThreads) vs torch.optim.AdamW fused/foreach, against "
        "the memory-bandwidth bound measured in the same run.",
    )
    parser.add_argument(
        "--params",
        type=int,
        default=None,
        help="total fp32 parameters over all shards (default 100M; 2M with --quick)",
    )
    parser.add_argument(
        "--layers", type=int, default=16, help="number of layer shards (default 16)"
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=2,
        help="WorkerThreads capacity for 'ours, parallel' (default 2)",
    )
    parser.add_argument(
        "--copy-elements",
        type=int,
        default=None,
        help="fp32 elements per copy-bandwidth buffer (default 64M; 8M with --quick)",
    )
    add_common_args(parser, default_repeats=11)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.quick:
        args.params = args.params or 2_000_000
        args.copy_elements = args.copy_elements or 8 * 2**20
        args.repeats = min(args.repeats, 5)
        args.warmup = 1
    else:
        args.params = args.params or 100_000_000
        args.copy_elements = args.copy_elements or 64 * 2**20
    if args.layers < 1 or args.params < args.layers:
        parser.error("need --layers >= 1 and --params >= --layers")
    return args


def _torch_adamw(cfg: OptimizerConfig, params: list[torch.Tensor], **kernel: bool):
    return torch.optim.AdamW(
        params,
        lr=LR,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        amsgrad=cfg.amsgrad,
        **kernel,
    )


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_threads(args.threads)
    info = machine_info()
    print(f"machine: {machine_line(info)}", flush=True)

    gen = torch.Generator().manual_seed(0)
    sizes = shard_sizes(args.params, args.layers)
    names = [f"layer{i:02d}" for i in range(args.layers)]
    params = [torch.randn(n, generator=gen).mul_(0.02) for n in sizes]
    grads = [torch.randn(n, generator=gen).mul_(1e-3) for n in sizes]
    total = sum(p.numel() for p in params)
    assert total == args.params
    copy_src = torch.randn(args.copy_elements, generator=gen)
    copy_dst = torch.empty_like(copy_src)
    copy_bytes = 2 * copy_src.numel() * copy_src.element_size()
    add_bytes = 3 * copy_src.numel() * copy_src.element_size()
    print(
        f"{args.layers} shards, {total:,} fp32 params "
        f"(smallest {min(sizes):,}, largest {max(sizes):,}); "
        f"copy buffers {copy_src.numel():,} fp32 elements",
        flush=True,
    )

    cfg = OptimizerConfig(kind="adamw")
    mgr = ShardOptimizers(cfg, zip(names, params, strict=True), device=torch.device("cpu"))
    fused_opt = _torch_adamw(cfg, params, fused=True)
    foreach_opt = _torch_adamw(cfg, params, foreach=True)
    pairs = list(zip(names, grads, strict=True))

    def ours_sequential() -> None:
        for name, grad in pairs:
            mgr.step(name, grad, LR)

    loop = asyncio.new_event_loop()
    timeline = Timeline()

    async def make_workers() -> WorkerThreads:
        return WorkerThreads(threads=args.worker_threads, timeline=timeline)

    workers = loop.run_until_complete(make_workers())

    async def parallel_step() -> None:
        await asyncio.gather(
            *(
                workers.run(
                    "cpu-optimizer", name, "step", functools.partial(mgr.step, name, grad, LR)
                )
                for name, grad in pairs
            )
        )

    def ours_parallel() -> None:
        loop.run_until_complete(parallel_step())

    def torch_step(opt: torch.optim.Optimizer) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    kernel = "fused" if mgr.fused else "foreach"
    sys_seq = f"ours, sequential ({kernel})"
    sys_par = f"ours, parallel ({kernel}, WorkerThreads {args.worker_threads} threads)"
    sys_fused = "torch AdamW fused"
    sys_foreach = "torch AdamW foreach"
    cases = {
        "copy": lambda: copy_dst.copy_(copy_src),
        "add_": lambda: copy_dst.add_(copy_src),
        sys_seq: ours_sequential,
        sys_par: ours_parallel,
        sys_fused: functools.partial(torch_step, fused_opt),
        sys_foreach: functools.partial(torch_step, foreach_opt),
    }
    try:
        timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    for p in params:
        p.grad = None

    # Every system really ran: each owns exp_avg + exp_avg_sq for every parameter.
    moments = 2 * 4 * total
    state_bytes = {
        "ours": mgr.state_bytes(),
        sys_fused: _state_bytes(fused_opt),
        sys_foreach: _state_bytes(foreach_opt),
    }
    for who, nbytes in state_bytes.items():
        assert nbytes >= moments, f"{who}: {nbytes} state bytes < {moments}"
    worker_names = sorted({e.worker for e in timeline.events() if e.kind == "cpu-optimizer"})

    bandwidth = copy_bytes / timings["copy"].median
    bound = bandwidth / ADAMW_BYTES_PER_PARAM
    add_bandwidth = add_bytes / timings["add_"].median
    fused_s = timings[sys_fused].median
    headers = [
        "system",
        "median step s",
        "params/s",
        "ratio vs fused torch",
        "fraction of bandwidth bound",
    ]
    rows: list[list[str]] = []
    results = []
    for system in (sys_seq, sys_par, sys_fused, sys_foreach):
        t = timings[system]
        rate = total / t.median
        ratio = fused_s / t.median
        frac = rate / bound
        rows.append([system, f"{t.median:.4f}", fmt_rate(rate), f"{ratio:.2f}x", f"{frac:.2f}"])
        results.append(
            {
                "system": system,
                "timing": t.as_dict(),
                "params_per_s": rate,
                "ratio_vs_torch_fused": ratio,
                "fraction_of_bandwidth_bound": frac,
            }
        )
    rows.append(["bandwidth bound (copy / 28 B)", "-", fmt_rate(bound), "-", "1.00"])
    table = markdown_table(headers, rows)
    notes = [
        f"{args.layers} shards, {total:,} fp32 params (sizes proportional to 1..{args.layers}: "
        f"{min(sizes):,} to {max(sizes):,}); median of {args.repeats} repeats after "
        f"{args.warmup} warm-up, cases interleaved.",
        f"copy bandwidth {fmt(bandwidth / 1e9)} GB/s (dst.copy_(src), "
        f"{copy_src.numel():,} fp32 elements, 2 x nbytes counted; median "
        f"{timings['copy'].median * 1e3:.1f} ms) -> bound {fmt_rate(bound)} params/s at "
        f"{ADAMW_BYTES_PER_PARAM} B/param.",
        f"in-place add_ bandwidth {fmt(add_bandwidth / 1e9)} GB/s (3 x nbytes counted) -> "
        f"{fmt_rate(add_bandwidth / ADAMW_BYTES_PER_PARAM)} params/s at "
        f"{ADAMW_BYTES_PER_PARAM} B/param.",
        "ratio vs fused torch = torch-fused step time / system step time (>1 is faster).",
        f"ShardOptimizers picked fused={mgr.fused}; 'ours, parallel' ran on worker "
        f"threads {worker_names}.",
    ]
    print()
    print(table)
    print()
    for n in notes:
        print(f"- {n}")

    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "machine": info,
        "config": {
            "params": total,
            "layers": args.layers,
            "shard_sizes": sizes,
            "worker_threads": args.worker_threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "lr": LR,
            "optimizer": {
                "kind": cfg.kind,
                "betas": list(cfg.betas),
                "eps": cfg.eps,
                "weight_decay": cfg.weight_decay,
                "amsgrad": cfg.amsgrad,
            },
            "ours_fused": mgr.fused,
        },
        "copy_bandwidth": {
            "elements": copy_src.numel(),
            "bytes_moved_per_copy": copy_bytes,
            "timing": timings["copy"].as_dict(),
            "bytes_per_s": bandwidth,
        },
        "inplace_add_bandwidth": {
            "elements": copy_src.numel(),
            "bytes_moved_per_add": add_bytes,
            "timing": timings["add_"].as_dict(),
            "bytes_per_s": add_bandwidth,
        },
        "adamw_bytes_per_param": ADAMW_BYTES_PER_PARAM,
        "bandwidth_bound_params_per_s": bound,
        "state_bytes": state_bytes,
        "parallel_worker_threads_seen": worker_names,
        "results": results,
        "table_markdown": table,
    }
    out: Path = args.out or default_out(NAME, args.quick)
    json_path, md_path = write_results(
        out, payload, table, title="CPU AdamW optimizer step", notes=notes
    )
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
