"""One GPU: a ~1B-parameter step of zero3_offload vs FSDP2 + CPUOffloadPolicy, and its copies.

(a) plain torch's host<->device copies per size (pageable and pinned), the references for the
library's own copies in (b): their bytes and seconds as get_performance_stats() counts them
(`transfers`, timed with CUDA events); (b) step time and peak memory; (c) the copies no kernel
overlapped in one profiled step. Each part its own processes, within ``--budget-s``;
``--cpu-check`` runs the same code on the CPU.
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
OFFLOAD = {"offload_params": True, "offload_grads": True, "offload_optimizer_states": True}
SYSTEMS = {  # the system the suite is about, then the baseline; each on one rank
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
    "--budget-s": {"type": float, "default": 420.0, "help": "wall-clock budget (420)"},
    "--steps": {"type": int, "default": 5, "help": "timed training steps (5)"},
    "--no-profile": {"action": "store_true", "help": "skip the profiled steps"},
}
DEFAULTS = {"repeats": 10, "warmup": 2}
EPILOG = "--repeats/--warmup: timed/untimed copies per case (10/2); --warmup: also steps (2)"
TITLE = "GPU suite: zero3_offload's ~1B-param step and copies vs FSDP2 + CPUOffloadPolicy"
COPIES = [
    Col("size MiB", "size"),
    Col("dir", "direction"),
    Col("path", "path"),
    Col("median ms", "median_s", "ms1"),
    Col("GB/s", "gbs", "sig", missing="no copy"),
    Col("vs torch pinned", "gbs", "x", "pinned"),
]


def check(args: Any) -> str | None:
    args.threads = args.threads or (1 if args.cpu_check else torch.get_num_threads())
    if args.repeats < 5 or args.warmup < 1 or args.steps < 2 or args.budget_s < 30:
        return "need --repeats >= 5, --warmup >= 1, --steps >= 2, --budget-s >= 30"
    return None


def time_copies(device: torch.device, size: int, warmup: int, repeats: int) -> list[dict]:
    """Plain torch's copies of ``size`` bytes each way, interleaved, the first checked: by CUDA
    events (on the CPU, the host's clock) the median of ``repeats`` after ``warmup``."""
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
    copied, events = {}, [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
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
        row = {"size": f"{size // MIB:,}", "direction": direction.upper(), "path": path}
        row["median_s"] = statistics.median(samples)
        rows.append(
            {**row, "gbs": size / row["median_s"] / 1e9} if copied[(direction, path)] else row
        )
    return rows


def copies(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target of (a): every size, smallest first; the larger skipped near the deadline."""
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
    """One more step under torch.profiler: the time of its HtoD/DtoH memcpys during which no
    kernel ran (interval unions), over the time of all of them."""
    from torch.profiler import ProfilerActivity, profile

    left, needed = (
        spec["deadline"] - 5.0 - time.time(),
        3.0 * max(s["step_s"] for s in result["steps"]) + 5,
    )
    if not spec["profile"] or left < needed:
        result["notes"].append(f"profiled step skipped: {left:.0f} s left, ~{needed:.0f} s needed")
        return
    device = torch.device(spec["device"])
    x, y = (
        t.to(device) for t in workload.batches(len(result["steps"]) + 1, spec["dims"], SEED + 1)[-1]
    )
    trace = Path(spec["out_dir"]) / "profile.trace.json"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    try:
        with profile(activities=activities) as prof:
            (await system.step(x, y, StepClock())).item()
            if device.type == "cuda":
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
    except Exception as exc:  # the timed steps stand; the note says why this one is missing
        result["notes"].append(f"profiled step failed: {type(exc).__name__}: {exc}".splitlines()[0])
        return
    events = json.loads(trace.read_text(encoding="utf-8")).get("traceEvents", [])
    trace.unlink()  # tens of MB; the figures are kept
    kernels, copied = [], []
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e:
            span = (float(e["ts"]) / 1e6, (float(e["ts"]) + float(e.get("dur", 0))) / 1e6)
            name, cat = str(e.get("name", "")), str(e.get("cat", "")).lower()
            kernels += [span] if cat == "kernel" else []
            copied += [span] if cat == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name) else []
    busy = covered(kernels)
    result["copy_s"], result["exposed_s"] = covered(copied), covered(copied + kernels) - busy


def run(args: Any) -> dict[str, Any] | None:
    if not args.cpu_check and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
        progress(f"gpu: CUDA is not available ({build}); run it on a GPU, or with --cpu-check")
        return None
    mode = "cpu-check" if args.cpu_check else "quick" if args.quick else "full"
    device = "cpu" if args.cpu_check else "cuda"
    copy_mib, (d, heads, blocks, seq, batch) = MODES[mode]
    started = time.monotonic()
    with work_directory("gpu-", keep=False) as work:  # (a), in a process of its own
        spec = {
            "device": device,
            "sizes_bytes": [s * MIB for s in copy_mib],
            "threads": args.threads,
        }
        spec.update(warmup=args.warmup, repeats=args.repeats)
        copy = launch(
            "suites.gpu:copies", spec, work, torchrun=False, timeout_s=SHARE["copy"] * args.budget_s
        )
    # (b) and (c): the training comparison of peers, with these systems on this device, one rank
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
    part = train.part(compared, dtype=DTYPE, repeats=args.repeats, budget_s=args.budget_s)
    rows = copy["ranks"][0].get("rows", []) if copy["ranks"] else []
    for r in compared["runs"]:
        rank, key = r["ranks"][0] if r["ranks"] else {}, r["key"]
        if key in part["systems"] and "copy_s" in rank:
            part["systems"][key].update(copy_s=rank["copy_s"], exposed_s=rank["exposed_s"])
        for direction in ("h2d", "d2h") if r["ok"] and key == OURS else ():  # its own CUDA events
            got = [s["stats"]["transfers"].get(direction) for s in rank["steps"][r["warmup"] :]]
            nbytes, seconds = sum(g["bytes"] for g in got if g), sum(g["time"] for g in got if g)
            row = {
                "size": "per layer",
                "direction": direction.upper(),
                "path": "zero3_offload in (b)",
            }
            rows.append(
                {**row, "median_s": None, **({"gbs": nbytes / seconds / 1e9} if seconds else {})}
            )
    notes = [
        f"{r['key']}: {n}"
        for r in compared["runs"]
        for rk in r["ranks"]
        for n in rk.get("notes", [])
    ]
    notes += [f"copy: {n}" for n in (copy["ranks"][0].get("notes", []) if copy["ranks"] else [])]
    failed = [
        f"{r['key']}: {r['error']}"
        for r in [{"key": "copy", **copy}, *compared["runs"]]
        if not r["ok"]
    ]
    name = "gpu" if mode == "full" else f"gpu-{mode}"
    return {
        "benchmark": name,
        "mode": mode,
        **part,
        "copies": rows,
        "notes": notes,
        "failed": failed,
        "elapsed_s": time.monotonic() - started,
    }


def layout(p: dict[str, Any]) -> list:
    pinned = {(r["size"], r["direction"]): r for r in p["copies"] if "pinned" in r["path"]}
    rows = [{**r, "pinned": pinned.get((r["size"], r["direction"]), {})} for r in p["copies"]]
    columns = peers.system_columns({"FSDP2": BASELINE})
    columns.append(Col("exposed copy (profiled step)", "{exposed_s:.4f} of {copy_s:.4f} s"))
    return [
        (columns, p["systems"]),
        "(a) Copy bandwidth, host<->device (plain torch; zero3_offload's own copies in (b)):",
        (COPIES, rows),
    ]


def notes(p: dict[str, Any]) -> list[str]:
    cfg, dims, cuda = p["config"], p["config"]["dims"], p["mode"] != "cpu-check"
    a, b = (p["systems"].get(k, {}).get("losses") or [] for k in (OURS, BASELINE))
    n = min(len(a), len(b))
    shown = ", ".join(f"{x:.4f}/{y:.4f}" for x, y in zip(a[:4], b[:4], strict=False))
    diff = max((abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)), default=0.0)
    check = "CPU CHECK: tiny sizes on the CPU, nothing pinned, host timers; these figures measure "
    return [
        *([] if cuda else [check + "nothing about GPUs."]),
        f"{cfg['model']}, {cfg['params']:,} parameters (d {dims['d']}, {dims['heads']} heads, "
        f"{dims['n_layers']} blocks, context {dims['seq']}, global batch {dims['global_batch']}), "
        f"{cfg['dtype']} compute, fp32 masters, seed {cfg['seed']}, world size 1 "
        f"({'NCCL' if cuda else 'gloo'}); {cfg['warmup']} warm-up then up to {cfg['steps']} timed "
        "steps, as docs/benchmarks.md (gpu) describes them and their columns.",
        f"losses (zero3_offload/FSDP2), first steps: {shown}; max |diff| over {n} steps {diff:.2e}"
        if n
        else "losses: not comparable (a run produced none)",
        f"copies: {cfg['repeats']} repeats after {cfg['warmup']} warm-up, interleaved; "
        "zero3_offload's: the bytes and seconds of its h2d/d2h transfers over the timed steps of "
        "(b) (get_performance_stats()).",
        *p["notes"],
        *(f"FAILED {f}" for f in p["failed"]),
    ]


NOTES = [notes]
