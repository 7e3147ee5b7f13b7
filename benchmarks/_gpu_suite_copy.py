"""Part (a) of ``gpu_suite.py``: host<->device copy bandwidth, in its own process.

Started by ``gpu_suite.py`` as ``python benchmarks/_gpu_suite_copy.py SPEC.json``;
writes the JSON file the spec's ``out`` names (also when a case fails: the
error is recorded and the other cases go on).

For each size, fp32 tensors of ``size`` bytes, six paths (three per direction):

- H2D ``torch pageable .to()``: ``pageable.to(device)``;
- H2D ``torch pinned .to(non_blocking)``: ``pinned.to(device, non_blocking=True)``;
- H2D ``zero3_offload h2d``: the statements of ``ParameterGatherer.launch`` that
  copy a compute copy, with the library's own objects: a pinned
  ``ShardCodec.empty`` shard, ``CompressedShard.to(device, non_blocking=True)``
  on ``CopyStreams.h2d`` between ``CopyStreams.record`` events, ``track_copy``,
  and the compute stream waiting on the copy's event;
- D2H ``torch pageable copy_()``: ``pageable_dst.copy_(dev)``, preallocated;
- D2H ``torch pinned .to(non_blocking)``: ``dev.to("cpu", non_blocking=True)``
  (torch allocates a pinned result from its caching host allocator);
- D2H ``zero3_offload d2h``: ``GradientStore.commit_layer`` itself (d2h
  stream, a pinned host buffer per copy, a worker thread waits for the copy).

Timing: on CUDA, two ``torch.cuda.Event(enable_timing=True)`` recorded on the
stream the copy runs on (the side stream for the library's paths), around the
call; host wall time around the call plus the event wait is kept too. On the
CPU (``--cpu-check``) ``time.perf_counter`` only, nothing pinned, and a
``.to()`` to the same device is no copy at all (reported as such). Cases are
interleaved round-robin after warm-up; every case's result is checked against
its source (sampled elements) once, and its bytes are counted from the tensors.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MIB = 2**20
_CHECK_STRIDE = 1_000_003  # prime stride of the sampled result check


@dataclass
class Case:
    """One copy path at one size."""

    name: str
    direction: str  # "h2d" or "d2h"
    fn: Callable[[], Any]  # does one copy; returns the destination tensor (maybe awaitable)
    source: torch.Tensor
    stream: Any = None  # CUDA stream the copy runs on (None: the current stream)
    library: bool = False
    device_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    error: str | None = None
    copied: bool | None = None  # False when the "copy" returned its source (CPU)
    nbytes: int = 0


async def _call(fn: Callable[[], Any]) -> Any:
    out = fn()
    return await out if inspect.isawaitable(out) else out


async def measure(case: Case, cuda: bool) -> tuple[float, float, Any]:
    """One timed call of ``case``: (device-timed s, host wall s, destination tensor)."""
    if not cuda:
        h0 = time.perf_counter()
        out = await _call(case.fn)
        host = time.perf_counter() - h0
        return host, host, out
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    h0 = time.perf_counter()
    start.record(case.stream)
    out = await _call(case.fn)
    end.record(case.stream)
    end.synchronize()
    host = time.perf_counter() - h0
    torch.cuda.synchronize()  # whatever else the call enqueued (e.g. the consumer's wait)
    return start.elapsed_time(end) / 1e3, host, out


def check_result(out: torch.Tensor, source: torch.Tensor) -> tuple[bool, int]:
    """Whether ``out`` holds ``source``'s values (sampled) and is a copy; its bytes."""
    if out.shape != source.shape or out.dtype != source.dtype:
        raise AssertionError(
            f"copy result {out.shape}/{out.dtype} != {source.shape}/{source.dtype}"
        )
    n = source.numel()
    idx = torch.cat([torch.arange(0, n, _CHECK_STRIDE), torch.tensor([n - 1])])
    got = out.index_select(0, idx.to(out.device)).cpu()
    want = source.index_select(0, idx.to(source.device)).cpu()
    if not torch.equal(got, want):
        raise AssertionError("copy result differs from its source")
    copied = out.device != source.device or out.data_ptr() != source.data_ptr()
    return copied, out.numel() * out.element_size()


def make_library(device: torch.device, numel: int) -> dict[str, Any]:
    """zero3_offload's objects for one size: streams, timeline, gradient store, a pinned shard."""
    from zero3_offload.comm.copy_streams import CopyStreams
    from zero3_offload.comm.worker_threads import WorkerThreads
    from zero3_offload.config import CpuCompressionMethod
    from zero3_offload.gradient.store import GradientStore
    from zero3_offload.parameter.codec import ShardCodec
    from zero3_offload.stats.timeline import Timeline

    cuda, cpu = device.type == "cuda", torch.device("cpu")
    timeline = Timeline()
    streams = CopyStreams(device)
    store = GradientStore(
        device=cpu,
        streams=streams,
        workers=WorkerThreads(threads=2, timeline=timeline),
        timeline=timeline,
        pin=cuda,
    )
    codec = ShardCodec(CpuCompressionMethod.NONE, torch.float32)
    shard = codec.empty(numel, device=cpu, pin=cuda)  # the library's pinned compute copy
    shard.payload.copy_(torch.arange(numel, dtype=torch.float32))
    return {"streams": streams, "timeline": timeline, "store": store, "shard": shard}


def library_cases(device: torch.device, lib: dict[str, Any], dev: torch.Tensor) -> list[Case]:
    """The library's two paths, using the objects of :func:`make_library`."""
    streams, store, shard = lib["streams"], lib["store"], lib["shard"]

    def library_h2d() -> torch.Tensor:
        # ParameterGatherer.launch's copy, with the library's objects.
        with streams.on(streams.h2d):
            started = streams.record(streams.h2d)
            staged = shard.to(device, non_blocking=True)
            if staged is not shard:
                streams.track_copy("h2d", "bench", "forward", shard.nbytes(), started, streams.h2d)
            done = streams.record(streams.h2d)
        streams.wait(done)  # the consumer (compute stream) waits for the copy, not the host
        streams.mark_used_on_current(staged.payload)
        return staged.payload

    async def library_d2h() -> torch.Tensor:
        store.clear()  # no accumulation: each call lands one fresh shard
        await store.commit_layer("bench", dev)
        return store.get("bench")

    return [
        Case("zero3_offload h2d", "h2d", library_h2d, shard.payload, streams.h2d, library=True),
        Case("zero3_offload d2h", "d2h", library_d2h, dev, streams.d2h, library=True),
    ]


def build_cases(device: torch.device, numel: int, lib: dict[str, Any] | str) -> list[Case]:
    """The six paths for ``numel`` fp32 elements (sources hold 0, 1, 2, ...).

    ``lib`` is :func:`make_library`'s result, or the error that building it
    raised: the library's two cases are then reported failed with it.
    """
    cuda = device.type == "cuda"
    cpu = torch.device("cpu")
    pageable = torch.arange(numel, dtype=torch.float32)
    pinned = torch.empty(numel, dtype=torch.float32, pin_memory=cuda)
    pinned.copy_(pageable)
    dev = torch.arange(numel, dtype=torch.float32, device=device)
    pageable_dst = torch.empty(numel, dtype=torch.float32)
    if isinstance(lib, str):
        ours = [
            Case(f"zero3_offload {d}", d, lambda: None, pageable, library=True, error=lib)
            for d in ("h2d", "d2h")
        ]
    else:
        ours = library_cases(device, lib, dev)
    return [
        Case("torch pageable .to()", "h2d", lambda: pageable.to(device), pageable),
        Case(
            "torch pinned .to(non_blocking)",
            "h2d",
            lambda: pinned.to(device, non_blocking=True),
            pinned,
        ),
        ours[0],
        Case("torch pageable copy_()", "d2h", lambda: pageable_dst.copy_(dev), dev),
        Case("torch pinned .to(non_blocking)", "d2h", lambda: dev.to(cpu, non_blocking=True), dev),
        ours[1],
    ]


def _library_timing(lib: dict[str, Any], note: list[str]) -> None:
    """Let the library time its finished copies with its own events (its figures)."""
    if lib.get("timing_error"):
        return
    try:
        lib["streams"].record_finished_copies(lib["timeline"])
    except Exception as exc:  # the library's own timing failed; ours is unaffected
        lib["timing_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        note.append(f"library copy timing (record_finished_copies) failed: {lib['timing_error']}")


async def run_size(
    device: torch.device, size: int, warmup: int, repeats: int, notes: list[str]
) -> dict[str, Any]:
    """Every path at ``size`` bytes: warm-up, check, then interleaved timed repeats."""
    cuda = device.type == "cuda"
    try:
        lib: dict[str, Any] | str = make_library(device, size // 4)
    except Exception as exc:  # the library's internals changed: its cases fail, ours run
        lib = f"building the library's objects failed: {type(exc).__name__}: {exc}"
        lib = lib.splitlines()[0]
        notes.append(f"{size // MIB} MiB: {lib}")
    cases = build_cases(device, size // 4, lib)
    timeline = lib["timeline"] if isinstance(lib, dict) else None
    for case in cases:
        if case.error is not None:  # the library's objects could not be built
            continue
        try:
            for i in range(warmup):
                _, _, out = await measure(case, cuda)
                if i == 0:
                    case.copied, case.nbytes = check_result(out, case.source)
                del out
        except Exception as exc:
            case.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            notes.append(f"{size // MIB} MiB {case.direction} {case.name}: failed: {case.error}")
    if cuda and isinstance(lib, dict):
        _library_timing(lib, notes)
    before = timeline.totals() if timeline is not None else {}
    for _ in range(repeats):
        for case in cases:
            if case.error is not None:
                continue
            try:
                dev_s, host_s, out = await measure(case, cuda)
            except Exception as exc:
                case.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            del out
            case.device_s.append(dev_s)
            case.host_s.append(host_s)
            if case.library and cuda and isinstance(lib, dict):
                _library_timing(lib, notes)
    after = timeline.totals() if timeline is not None else {}
    rows = []
    for case in cases:
        row: dict[str, Any] = {
            "size_bytes": size,
            "direction": case.direction,
            "path": case.name,
            "library": case.library,
            "copied": case.copied,
            "bytes": case.nbytes,
            "error": case.error,
            "device_s": case.device_s,
            "host_s": case.host_s,
        }
        if case.device_s:
            med = statistics.median(case.device_s)
            row["median_s"] = med
            row["median_host_s"] = statistics.median(case.host_s)
            row["gb_per_s"] = case.nbytes / med / 1e9 if med > 0 else None
        if case.library:
            n0, s0, b0 = before.get(case.direction, (0, 0.0, 0))
            n1, s1, b1 = after.get(case.direction, (0, 0.0, 0))
            row["library_timed"] = {"copies": n1 - n0, "seconds": s1 - s0, "bytes": b1 - b0}
            if s1 > s0:
                row["library_gb_per_s"] = (b1 - b0) / (s1 - s0) / 1e9
        rows.append(row)
    del cases, lib
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {"size_bytes": size, "rows": rows}


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    """All sizes, smallest first, skipping the rest when the deadline is near."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    notes: list[str] = []
    sizes: list[dict[str, Any]] = []
    per_byte_s: float | None = None  # wall seconds per byte of the previous size
    for size in spec["sizes_bytes"]:
        if per_byte_s is not None:
            estimate = 2.0 + 1.5 * per_byte_s * size
            left = spec["deadline"] - time.time()
            if estimate > left:
                notes.append(
                    f"skipped {size // MIB} MiB and larger: estimated {estimate:.0f} s, "
                    f"{left:.0f} s left in the budget"
                )
                break
        t0 = time.perf_counter()
        sizes.append(await run_size(device, size, spec["warmup"], spec["repeats"], notes))
        per_byte_s = (time.perf_counter() - t0) / size
    return {"status": "ok", "sizes": sizes, "notes": notes}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    try:
        result = asyncio.run(run(spec))
    except Exception as exc:
        result = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
            "traceback": traceback.format_exc(),
        }
    Path(spec["out"]).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
