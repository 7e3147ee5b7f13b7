"""The exposed-copy figure of a profiled step (part (c) of ``gpu_suite.py``).

A step runs under ``torch.profiler``; its Chrome trace lists the device's
kernels and memcpys as intervals. The exposed-copy fraction is the time of
host<->device memcpys during which no kernel ran, over the time of all of them
(unions of intervals, so overlapping copies count once).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

Step = Callable[[torch.Tensor, torch.Tensor], Awaitable[torch.Tensor]]


def sync(device: torch.device) -> None:
    """Wait for the device's work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def merge(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint (start, end) pairs."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def copy_exposure(trace: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """Host<->device memcpys of a Chrome trace, and how much of them no kernel overlapped.

    Kineto writes device work as complete events (``"ph": "X"``, ``ts``/``dur``
    in microseconds): category ``kernel`` for kernels, ``gpu_memcpy`` for
    copies named ``Memcpy HtoD (...)`` / ``Memcpy DtoH (...)`` with their
    ``bytes`` in ``args``.
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    kernels: list[tuple[float, float]] = []
    copies: dict[str, list[tuple[float, float]]] = {"h2d": [], "d2h": []}
    nbytes = {"h2d": 0, "d2h": 0}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        start = float(e["ts"]) / 1e6
        span = (start, start + float(e.get("dur", 0.0)) / 1e6)
        cat, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        if cat == "kernel":
            kernels.append(span)
        elif cat == "gpu_memcpy":
            kind = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
            if kind is not None:
                copies[kind].append(span)
                args = e.get("args") or {}
                nbytes[kind] += int(args.get("bytes", 0) or 0)
    busy = merge(kernels)
    out: dict[str, Any] = {"kernels": len(kernels), "kernel_busy_s": length(busy)}
    for kind in ("h2d", "d2h"):
        union = merge(copies[kind])
        out[kind] = {
            "copies": len(copies[kind]),
            "bytes": nbytes[kind],
            "seconds": length(union),
            "exposed_s": length(union) - overlap(union, busy),
        }
    both = merge(copies["h2d"] + copies["d2h"])
    out["copy_s"] = length(both)
    out["exposed_s"] = length(both) - overlap(both, busy)
    out["exposed_fraction"] = out["exposed_s"] / out["copy_s"] if out["copy_s"] > 0 else None
    return out


async def profile_step(
    step: Step, x: torch.Tensor, y: torch.Tensor, device: torch.device, trace_path: Path
) -> dict[str, Any]:
    """One step under ``torch.profiler``; its trace's copy exposure."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    x, y = x.to(device), y.to(device)
    sync(device)
    with profile(activities=activities) as prof:
        loss = await step(x, y)
        loss.item()
        sync(device)
    prof.export_chrome_trace(str(trace_path))
    result = copy_exposure(json.loads(trace_path.read_text(encoding="utf-8")))
    result["trace_bytes"] = trace_path.stat().st_size
    trace_path.unlink()  # tens of MB; the figures are kept
    return result
