"""One GPU: a ~1B-parameter step of zero3_offload vs FSDP2 + CPUOffloadPolicy, and its copies.

peers' comparison of the two on one CUDA rank (bf16 compute, fp32 masters); the library's own
host<->device copies as get_performance_stats() counts them, next to plain torch's (pageable,
pinned) in a process of their own; the copies no kernel overlapped in one profiled step. Within
--budget-s; --cpu-check runs the same code on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness import train, workload
from harness.render import MIB, Col
from harness.runner import launch, progress, work_directory
from harness.sampler import StepClock
from harness.systems import System

from suites import peers

SEED, DTYPE, OURS, BASELINE = 0, "bfloat16", "zero3_offload", "fsdp2_offload"
MODES = {  # copy sizes MiB; d, heads, blocks, context, global batch
    "full": ([16, 64, 256, 1024], (2048, 16, 20, 512, 4)),
    "quick": ([16, 64], (1024, 8, 4, 256, 4)),
    "cpu-check": ([1, 4], (64, 4, 2, 32, 2)),
}
SHARE = {"copy": 0.3, "train": 0.32}  # of --budget-s: the copies' process; each training run
OFFLOAD = dict.fromkeys(("offload_params", "offload_grads", "offload_optimizer_states"), True)
SYSTEMS = {  # each on one rank
    OURS: System(
        "zero3_offload offload",
        OURS,
        1,
        {"compute_dtype": DTYPE, "pin_cpu_memory": True, **OFFLOAD},
    ),
    BASELINE: System(
        "FSDP2 + CPUOffloadPolicy",
        "fsdp2",
        1,
        {"fused": True, "cpu_offload": True, "param_dtype": DTYPE},
    ),
}
OPTIONS = {
    "--cpu-check": {"action": "store_true", "help": "every part on the CPU, tiny"},
    "--budget-s": {"type": float, "default": 420.0, "help": "wall-clock budget"},
    "--steps": {"type": int, "default": 5, "help": "timed training steps"},
    "--no-profile": {"action": "store_true", "help": "skip the profiled steps"},
}
DEFAULTS = {"repeats": 10, "warmup": 2}  # copies per case; --warmup: also the training's
TITLE = "GPU suite: zero3_offload's ~1B-param step and copies vs FSDP2 + CPUOffloadPolicy"
# fmt: off
COPIES = [Col("size MiB", "size"), Col("dir", "direction"), Col("path", "path"),
          Col("median ms", "median_s", "ms1"), Col("GB/s", "gbs", "sig", missing="no copy"),
          Col("vs torch pinned", "gbs", "x", "pinned")]
# fmt: on


def check(args: Any) -> str | None:
    args.threads = args.threads or (1 if args.cpu_check else torch.get_num_threads())
    if args.repeats < 5 or args.steps < 2 or args.budget_s < 30:
        return "need --repeats >= 5, --steps >= 2, --budget-s >= 30"
    return None


def time_copies(device: torch.device, size: int, warmup: int, repeats: int) -> list[dict]:
    """Plain torch's copies of ``size`` bytes each way, interleaved, the first checked: the median
    by CUDA events (on the CPU, the host's clock) of ``repeats`` after ``warmup``."""
    cuda, n = device.type == "cuda", size // 4
    pageable = torch.arange(n, dtype=torch.float32)
    pinned, dev, dst = (
        torch.empty(n, pin_memory=cuda).copy_(pageable),
        pageable.to(device),
        torch.empty(n),
    )
    paths = {
        ("h2d", "torch pageable .to()"): (lambda: pageable.to(device), pageable),
        ("h2d", "torch pinned .to(non_blocking)"): (
            lambda: pinned.to(device, non_blocking=True),
            pinned,
        ),
        ("d2h", "torch pageable copy_()"): (lambda: dst.copy_(dev), dev),
        ("d2h", "torch pinned .to(non_blocking)"): (lambda: dev.to("cpu", non_blocking=True), dev),
    }
    times: dict[tuple, list[float]] = {k: [] for k in paths}
    copied, events = {}, [torch.cuda.Event(enable_timing=True) for _ in range(2 * cuda)]
    for i in range(warmup + repeats):
        for key, (fn, source) in paths.items():
            if cuda:
                torch.cuda.synchronize()
                events[0].record()
            h0, got = time.perf_counter(), fn()
            if cuda:
                events[1].record()
                torch.cuda.synchronize()
            if i == 0:
                assert torch.equal(got.cpu(), source.cpu()), f"{key}: the copy differs"
                copied[key] = got.device != source.device or got.data_ptr() != source.data_ptr()
            if i >= warmup:
                times[key].append(
                    events[0].elapsed_time(events[1]) / 1e3 if cuda else time.perf_counter() - h0
                )
    rows = []
    for (direction, path), samples in times.items():
        row = {
            "size": f"{size // MIB:,}",
            "direction": direction.upper(),
            "path": path,
            "median_s": statistics.median(samples),
        }
        rows.append(
            {**row, "gbs": size / row["median_s"] / 1e9} if copied[(direction, path)] else row
        )
    return rows


def copies(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: every size, smallest first; the larger skipped near the deadline."""
    device, out, per_byte_s = torch.device(spec["device"]), {"rows": [], "notes": []}, None
    for size in spec["sizes_bytes"]:
        if (
            per_byte_s is not None
            and 2.0 + 1.5 * per_byte_s * size > spec["deadline"] - 5 - time.time()
        ):
            out["notes"].append(f"skipped {size // MIB} MiB and larger: near the deadline")
            break
        t0 = time.perf_counter()
        out["rows"] += time_copies(device, size, spec["warmup"], spec["repeats"])
        per_byte_s = (time.perf_counter() - t0) / size
        ctx.save(out)  # kept if a larger size kills the process
    return out


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals (overlapping ones count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


async def profiled(spec: dict[str, Any], system: Any, result: dict[str, Any]) -> None:
    """One more step under torch.profiler: the seconds of its HtoD/DtoH memcpys during which no
    kernel ran (interval unions), and of all of them."""
    from torch.profiler import ProfilerActivity, profile

    left, needed = (
        spec["deadline"] - 5.0 - time.time(),
        3.0 * max(s["step_s"] for s in result["steps"]) + 5,
    )
    if not spec["profile"] or left < needed:
        result["notes"].append(f"profiled step skipped: {left:.0f} s left, ~{needed:.0f} s needed")
        return
    device, trace = torch.device(spec["device"]), Path(spec["out_dir"]) / "profile.trace.json"
    x, y = (
        t.to(device) for t in workload.batches(len(result["steps"]) + 1, spec["dims"], SEED + 1)[-1]
    )
    try:
        with profile(
            activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
        ) as prof:
            (await system.step(x, y, StepClock())).item()
            if device.type == "cuda":
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
    except Exception as exc:  # the timed steps stand; the note says why this one is missing
        result["notes"].append(f"profiled step failed: {type(exc).__name__}: {exc}".splitlines()[0])
        return
    kernels, copied = [], []
    for e in json.loads(trace.read_text(encoding="utf-8")).get("traceEvents", []):
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e:
            span, name = (e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6), str(e.get("name", ""))
            kernels += [span] if str(e.get("cat", "")).lower() == "kernel" else []
            copied += (
                [span]
                if str(e.get("cat", "")).lower() == "gpu_memcpy"
                and ("HtoD" in name or "DtoH" in name)
                else []
            )
    trace.unlink()  # tens of MB; the figures are kept
    result["copy_s"], result["exposed_s"] = (
        covered(copied),
        covered(copied + kernels) - covered(kernels),
    )


def run(args: Any) -> dict[str, Any] | None:
    if not args.cpu_check and not torch.cuda.is_available():
        progress(
            f"gpu: CUDA is not available (torch {torch.__version__}); run it on a GPU, or with "
            f"--cpu-check"
        )
        return None
    mode = "cpu-check" if args.cpu_check else "quick" if args.quick else "full"
    device, (copy_mib, (d, heads, blocks, seq, batch)) = (
        "cpu" if args.cpu_check else "cuda",
        MODES[mode],
    )
    started = time.monotonic()
    with work_directory("gpu-", keep=False) as work:
        spec = {
            "device": device,
            "sizes_bytes": [s * MIB for s in copy_mib],
            "threads": args.threads,
        }
        spec.update(warmup=args.warmup, repeats=args.repeats)
        copy = launch(
            "suites.gpu:copies", spec, work, torchrun=False, timeout_s=SHARE["copy"] * args.budget_s
        )
    options = argparse.Namespace(warmup=args.warmup, repeats=args.steps, seed=SEED, rounds=1)
    options.timeout = SHARE["train"] * args.budget_s
    spec = {
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "pace": True,
        "stats": True,
    }
    spec.update(finish="suites.gpu:profiled", profile=not args.no_profile)
    dims = dict(d=d, heads=heads, n_layers=blocks, seq=seq, global_batch=batch)
    compared = train.compare(
        options, dict(SYSTEMS), dims, threads=dict.fromkeys(SYSTEMS, args.threads), spec=spec
    )
    part = train.part(compared, OURS, dtype=DTYPE, repeats=args.repeats, budget_s=args.budget_s)
    rows, notes = copy["ranks"][0].get("rows", []) if copy["ranks"] else [], []
    for r in compared["runs"]:
        rank = r["ranks"][0] if r["ranks"] else {}
        notes += [f"{r['key']}: {n}" for n in rank.get("notes", [])]
        if r["key"] in part["systems"] and "copy_s" in rank:
            part["systems"][r["key"]].update(copy_s=rank["copy_s"], exposed_s=rank["exposed_s"])
        for direction in ("h2d", "d2h") if r["ok"] and r["key"] == OURS else ():  # its CUDA events
            got = [
                g
                for s in rank["steps"][r["warmup"] :]
                if (g := s["stats"]["transfers"].get(direction))
            ]
            nbytes, seconds = sum(g["bytes"] for g in got), sum(g["time"] for g in got)
            row = {
                "size": "per layer",
                "direction": direction.upper(),
                "path": "zero3_offload in training",
            }
            rows.append({**row, **({"gbs": nbytes / seconds / 1e9} if seconds else {})})
    notes += [f"copy: {n}" for n in (copy["ranks"][0].get("notes", []) if copy["ranks"] else [])]
    failed = [
        f"{r['key']}: {r['error']}"
        for r in [{"key": "copy", **copy}, *compared["runs"]]
        if not r["ok"]
    ]
    out = {
        "benchmark": {"full": "gpu", "quick": "gpu-quick", "cpu-check": "gpu-cpu-check-quick"}[
            mode
        ],
        "mode": mode,
        **part,
        "copies": rows,
    }
    return {**out, "notes": notes, "failed": failed, "elapsed_s": time.monotonic() - started}


def layout(p: dict[str, Any]) -> list:
    pinned = {(r["size"], r["direction"]): r for r in p["copies"] if "pinned" in r["path"]}
    rows = [{**r, "pinned": pinned.get((r["size"], r["direction"]), {})} for r in p["copies"]]
    blocks = peers.layout(p, {"FSDP2": BASELINE})
    blocks[0][0].append(Col("exposed copy (profiled step)", "{exposed_s:.4f} of {copy_s:.4f} s"))
    return [
        *blocks,
        "Copy bandwidth, host<->device (zero3_offload's: its own CUDA events):",
        (COPIES, rows),
    ]


def notes(p: dict[str, Any]) -> list[str]:
    check = [
        "CPU CHECK: tiny sizes on the CPU, nothing pinned, host timers; these figures measure "
        "nothing about GPUs."
    ]
    cfg = p["config"]
    return [
        *(check if p["mode"] == "cpu-check" else []),
        *peers.notes(p),
        f"{cfg['dtype']} compute, fp32 masters, world size 1; copies: {cfg['repeats']} repeats "
        f"after "
        f"{cfg['warmup']} warm-up, interleaved; docs/benchmarks.md (gpu) describes the parts.",
        *p["notes"],
        *(f"FAILED {f}" for f in p["failed"]),
    ]


NOTES = [notes]
