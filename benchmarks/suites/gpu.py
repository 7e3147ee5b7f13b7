"""One GPU: zero3_offload's copy path and a ~1B-parameter step vs FSDP2 + CPUOffloadPolicy.

(a) copy bandwidth, (b) step time and peak memory, (c) exposed copies; each part its own
process, within ``--budget-s``. ``--cpu-check`` runs the same code on the CPU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from harness import train, workload
from harness.launcher import launch, work_directory
from harness.plan import progress
from harness.report import MIB, Report, fmt, markdown_table, ratio, systems_table
from harness.sampler import StepClock
from harness.systems import System

from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import CpuCompressionMethod
from zero3_offload.gradient.store import GradientStore
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.stats.timeline import Timeline

SEED, DTYPE, OURS, BASELINE = 0, "bfloat16", "zero3_offload", "fsdp2_offload"
MODES = {  # copy sizes MiB; d, heads, blocks, context, global batch
    "full": ([16, 64, 256, 1024], (2048, 16, 20, 512, 4)),
    "quick": ([16, 64], (1024, 8, 4, 256, 4)),
    "cpu-check": ([1, 4], (64, 4, 2, 32, 2)),
}
# The share of --budget-s a part's process gets before it is killed (the copies; each training
# run), and the fewest timed steps a training run stopped early at its deadline keeps.
SHARE, MIN_TIMED = {"copy": 0.3, "train": 0.32}, 2
HOOKS = "suites.gpu:Hooks"  # the training's additions: a deadline, a profiled step
OFFLOAD = {"offload_params": True, "offload_grads": True, "offload_optimizer_states": True}
OURS_OPTIONS = {"compute_dtype": DTYPE, "pin_cpu_memory": True, **OFFLOAD}
FSDP2_OPTIONS = {"fused": True, "cpu_offload": True, "param_dtype": DTYPE}
SYSTEMS = {  # the system the suite is about, then the baseline; each on one rank
    OURS: System("zero3_offload offload", OURS, 1, OURS_OPTIONS),
    BASELINE: System("FSDP2 + CPUOffloadPolicy", "fsdp2", 1, FSDP2_OPTIONS),
}

OPTIONS = {
    "--cpu-check": {"action": "store_true", "help": "every part on the CPU, tiny"},
    "--budget-s": {"type": float, "default": 420.0, "help": "wall-clock budget (420)"},
    "--steps": {"type": int, "default": 5, "help": "timed training steps (5)"},
    "--no-profile": {"action": "store_true", "help": "skip the profiled steps"},
}
DEFAULTS = {"repeats": 10, "warmup": 2}
EPILOG = "--repeats/--warmup: timed/untimed copies per case (10/2); --warmup: also steps (2)"


def check(args: Any) -> str | None:
    args.threads = args.threads or (1 if args.cpu_check else torch.get_num_threads())
    if args.repeats < 5 or args.warmup < 1 or args.steps < 2 or args.budget_s < 30:
        return "need --repeats >= 5, --warmup >= 1, --steps >= 2, --budget-s >= 30"
    return None


class Copy(NamedTuple):
    """One way to copy: ``fn()`` returns the destination (maybe awaitable) of ``source``."""

    path: str
    direction: str  # h2d or d2h
    fn: Callable[[], Any]
    source: torch.Tensor
    stream: Any = None  # the CUDA stream the copy runs on
    library: bool = False


def copy_paths(device: torch.device, numel: int) -> tuple[list[Copy], Timeline, CopyStreams]:
    """The six paths for ``numel`` fp32 elements; the library's timeline and streams."""
    cuda, cpu = device.type == "cuda", torch.device("cpu")
    pageable = torch.arange(numel, dtype=torch.float32)
    pinned = torch.empty(numel, pin_memory=cuda).copy_(pageable)
    dev, dst = torch.arange(numel, dtype=torch.float32, device=device), torch.empty(numel)
    timeline, streams = Timeline(), CopyStreams(device)
    workers = WorkerThreads(threads=2, timeline=timeline)
    store = GradientStore(device=cpu, streams=streams, workers=workers, timeline=timeline, pin=cuda)
    shard = ShardCodec(CpuCompressionMethod.NONE, torch.float32).empty(numel, device=cpu, pin=cuda)
    shard.payload.copy_(pageable)

    def library_h2d() -> torch.Tensor:  # ParameterGatherer.launch's copy
        with streams.on(streams.h2d):
            started = streams.record(streams.h2d)
            staged = shard.to(device, non_blocking=True)
            if staged is not shard:
                streams.track_copy("h2d", "bench", "forward", shard.nbytes(), started, streams.h2d)
            done = streams.record(streams.h2d)
        streams.wait(done)  # the compute stream waits for the copy, not the host
        streams.mark_used_on_current(staged.payload)
        return staged.payload

    async def library_d2h() -> torch.Tensor:
        store.clear()  # no accumulation: each call lands one fresh shard
        await store.commit_layer("bench", dev)
        return store.get("bench")

    pinned_to = "torch pinned .to(non_blocking)"
    paths = [
        Copy("torch pageable .to()", "h2d", lambda: pageable.to(device), pageable),
        Copy(pinned_to, "h2d", lambda: pinned.to(device, non_blocking=True), pinned),
        Copy("zero3_offload h2d", "h2d", library_h2d, shard.payload, streams.h2d, True),
        Copy("torch pageable copy_()", "d2h", lambda: dst.copy_(dev), dev),
        Copy(pinned_to, "d2h", lambda: dev.to(cpu, non_blocking=True), dev),
        Copy("zero3_offload d2h", "d2h", library_d2h, dev, streams.d2h, True),
    ]
    return paths, timeline, streams


def check_copy(out: torch.Tensor, source: torch.Tensor) -> tuple[bool, int]:
    """Whether ``out`` is a copy of ``source`` (equal to it, elsewhere in memory); its bytes."""
    assert torch.equal(out.cpu(), source.cpu()), "copy result differs from its source"
    copied = out.device != source.device or out.data_ptr() != source.data_ptr()
    return copied, out.numel() * out.element_size()


async def run_size(device: torch.device, size: int, warmup: int, repeats: int) -> dict:
    """Every path at ``size`` bytes, interleaved: warm-up (the first call checked), then the timed
    repeats; and what the library's own events timed of its copies."""
    cuda = device.type == "cuda"
    paths, timeline, streams = copy_paths(device, size // 4)
    rows = [
        dict(size_bytes=size, direction=c.direction, path=c.path, library=c.library) for c in paths
    ]
    for row in rows:
        row.update(copied=None, bytes=0, error=None, device_s=[], host_s=[])

    async def call(copy: Copy, row: dict[str, Any], i: int) -> None:
        """One call: the first checked, those after the warm-up timed by events on the copy's
        stream (on the CPU, by the host's clock) and by the host's wall clock."""
        try:
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda.synchronize()
                start.record(copy.stream)
            h0 = time.perf_counter()
            out = copy.fn()
            out = await out if inspect.isawaitable(out) else out
            if cuda:
                end.record(copy.stream)
                end.synchronize()
            host_s = time.perf_counter() - h0
            if cuda:
                torch.cuda.synchronize()  # whatever else the call enqueued (the consumer's wait)
            if i == 0:
                row["copied"], row["bytes"] = check_copy(out, copy.source)
            if i >= warmup:
                row["device_s"].append(start.elapsed_time(end) / 1e3 if cuda else host_s)
                row["host_s"].append(host_s)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if copy.library and cuda:  # the library times its finished copies with its own events
            streams.record_finished_copies(timeline)

    before = {}
    for i in range(warmup + repeats):  # every path in turn, warm-up rounds first
        if i == warmup:
            before = timeline.totals()
        for copy, row in zip(paths, rows, strict=True):
            if row["error"] is None:
                await call(copy, row, i)
    after = timeline.totals()
    for row in rows:
        if row["device_s"]:
            med = statistics.median(row["device_s"])
            row.update(median_s=med, median_host_s=statistics.median(row["host_s"]))
            row["gb_per_s"] = row["bytes"] / med / 1e9 if med > 0 else None
        if row["library"]:
            (n0, s0, b0), (n1, s1, b1) = (
                t.get(row["direction"], (0, 0.0, 0)) for t in (before, after)
            )
            row["library_timed"] = {"copies": n1 - n0, "seconds": s1 - s0, "bytes": b1 - b0}
            row["library_gb_per_s"] = (b1 - b0) / (s1 - s0) / 1e9 if s1 > s0 else None
    if cuda:
        del paths
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {"size_bytes": size, "rows": rows}


async def copies(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target of part (a): every size, smallest first; the larger ones are skipped when the
    deadline is near."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    result: dict[str, Any] = {"sizes": [], "notes": []}
    per_byte_s = None  # wall seconds per byte of the previous size
    for size in spec["sizes_bytes"]:
        left = spec["deadline"] - 5.0 - time.time()
        if per_byte_s is not None and 2.0 + 1.5 * per_byte_s * size > left:
            result["notes"].append(f"skipped {size // MIB} MiB and larger: {left:.0f} s left")
            break
        t0 = time.perf_counter()
        result["sizes"].append(await run_size(device, size, spec["warmup"], spec["repeats"]))
        per_byte_s = (time.perf_counter() - t0) / size
        ctx.save(result)  # kept if a larger size kills the process
    return result


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals (overlapping ones count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def copy_exposure(events: list[Any]) -> dict[str, Any]:
    """The memcpys of a Chrome trace (complete events, ``ts``/``dur`` in µs; category ``kernel``,
    and ``gpu_memcpy`` named ``Memcpy HtoD``/``DtoH`` with ``bytes``) and how much of their time
    no kernel ran: the union of copies and kernels less the union of kernels."""
    kernels, spans, nbytes = [], {"h2d": [], "d2h": []}, {"h2d": 0, "d2h": 0}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e:
            span = (float(e["ts"]) / 1e6, (float(e["ts"]) + float(e.get("dur", 0))) / 1e6)
            name, cat = str(e.get("name", "")), str(e.get("cat", "")).lower()
            kind = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
            if cat == "kernel":
                kernels.append(span)
            elif cat == "gpu_memcpy" and kind:
                spans[kind].append(span)
                nbytes[kind] += int((e.get("args") or {}).get("bytes", 0) or 0)
    busy = covered(kernels)
    out: dict[str, Any] = {"kernels": len(kernels), "kernel_busy_s": busy}
    for kind, copied in [*spans.items(), ("all", spans["h2d"] + spans["d2h"])]:
        out[kind] = {"copies": len(copied), "bytes": nbytes.get(kind), "seconds": covered(copied)}
        out[kind]["exposed_s"] = covered(copied + kernels) - busy
    out["copy_s"], out["exposed_s"] = out["all"]["seconds"], out["all"]["exposed_s"]
    out["exposed_fraction"] = out["exposed_s"] / out["copy_s"] if out["copy_s"] > 0 else None
    return out


class Hooks:
    """Progress per step, a deadline for the timed steps, then one more step under the profiler."""

    def __init__(self, spec: dict[str, Any], ctx: Any) -> None:
        self.spec, self.ctx, self.notes, self.times = spec, ctx, [], []

    def step(self, i: int, clock: StepClock, system: Any) -> bool:
        print(f"{self.spec['kind']}: step {i} {clock.elapsed:.3f} s", flush=True)
        if i >= self.spec["warmup"]:
            self.times.append(clock.elapsed)
        timed, planned = len(self.times), self.spec["steps"]
        left = self.spec["deadline"] - 5.0 - time.time()
        if MIN_TIMED <= timed < planned and left < 1.5 * max(self.times) + 5:
            self.notes.append(f"stopped after {timed} of {planned} timed steps: {left:.0f} s left")
            return False
        return True

    async def end(self, system: Any, result: dict[str, Any]) -> None:
        device, result["notes"] = torch.device(self.spec["device"]), self.notes
        self.ctx.save(result)  # kept if the profiled step crashes the process
        left = self.spec["deadline"] - 5.0 - time.time()
        needed = 3.0 * max(self.times or [1.0]) + 5
        if not self.spec["profile"] or left < needed:
            self.notes.append(f"profiled step skipped: {left:.0f} s left, ~{needed:.0f} s needed")
            return
        from torch.profiler import ProfilerActivity, profile

        batch = workload.batches(len(result["steps"]) + 1, self.spec["dims"], SEED + 1)[-1]
        x, y = (t.to(device) for t in batch)
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
        trace = Path(self.spec["out_dir"]) / "profile.trace.json"
        try:
            with profile(activities=activities) as prof:
                (await system.step(x, y, StepClock())).item()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text(encoding="utf-8"))
            result["profiler_copy"] = copy_exposure(events.get("traceEvents", []))
            trace.unlink()  # tens of MB; the figures are kept
        except Exception as exc:
            self.notes.append(f"profiled step failed: {type(exc).__name__}: {exc}".splitlines()[0])


def run(args: Any) -> dict[str, Any] | None:
    if not args.cpu_check and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
        progress(f"gpu: CUDA is not available ({build}); run it on a GPU, or with --cpu-check")
        return None
    mode = "cpu-check" if args.cpu_check else "quick" if args.quick else "full"
    device = "cpu" if args.cpu_check else "cuda"
    copy_mib, (d, heads, blocks, seq, batch) = MODES[mode]
    started, budget = time.monotonic(), args.budget_s
    with work_directory("gpu-", keep=False) as work:  # (a), in a process of its own
        spec = {"device": device, "sizes_bytes": [s * MIB for s in copy_mib]}
        spec.update(warmup=args.warmup, repeats=args.repeats, threads=args.threads)
        timeout = SHARE["copy"] * budget
        progress(f"gpu: copies, {len(copy_mib)} sizes, at most {timeout:.0f} s")
        copy = launch("suites.gpu:copies", spec, work, torchrun=False, timeout_s=timeout)
    # (b) and (c): the training comparison of peers, with these systems on this device, one rank
    options = argparse.Namespace(warmup=args.warmup, repeats=args.steps, seed=SEED, rounds=1)
    options.timeout = SHARE["train"] * budget
    spec = {"device": device, "backend": "nccl" if device == "cuda" else "gloo", "hooks": HOOKS}
    spec["profile"] = not args.no_profile
    dims = dict(d=d, heads=heads, n_layers=blocks, seq=seq, global_batch=batch)
    threads = dict.fromkeys(SYSTEMS, args.threads)
    compared = train.compare(options, dict(SYSTEMS), dims, threads=threads, spec=spec)
    notes: list[str] = []
    failed = []
    for name, r in [("copy", copy)] + [(r["key"], r) for r in compared["runs"]]:
        notes.extend(f"{name}: {n}" for rk in r["ranks"] for n in rk.get("notes", []))
        if not r["ok"]:
            failed.append(f"{name}: {r['error']}")
    sizes = copy["ranks"][0].get("sizes", []) if copy["ranks"] else []  # those measured
    if broken := [row for size in sizes for row in size["rows"] if row["error"]]:
        failed.append(f"copy: {len(broken)} of the paths failed (their errors are in the table)")
    config = dict(dtype=DTYPE, repeats=args.repeats, budget_s=args.budget_s, threads=args.threads)
    return {
        "benchmark": "gpu" if mode == "full" else f"gpu-{mode}",
        "mode": mode,
        **compared,
        "config": {**compared["config"], **config},
        "copy": copy,
        "notes": notes,
        "failed": failed,
        "elapsed_s": time.monotonic() - started,
    }


def report(payload: dict[str, Any]) -> Report:
    cfg, dims, summary = payload["config"], payload["config"]["dims"], train.summarize(payload)
    first = {run["key"]: run["ranks"][0] for run in payload["runs"] if run["ok"]}

    def exposed(key: str) -> str:
        p = first[key].get("profiler_copy") or {}
        share = p.get("exposed_fraction")
        return f"{'-' if share is None else f'{100 * share:.1f}%'} of {p.get('copy_s', 0):.4f} s"

    extra = {"exposed copy (profiled step)": exposed}  # the timed steps: a note when cut short
    # (a): per size, direction and path the median time, GB/s and its ratios to plain torch's
    # pinned and pageable copies in that direction, the host's wall time, the library's timing
    copy = payload["copy"]
    rows = []
    for size in copy["ranks"][0].get("sizes", []) if copy["ranks"] else []:
        for r in size["rows"]:
            same = [x for x in size["rows"] if x["direction"] == r["direction"] and x["copied"]]
            refs = [
                next((x.get("gb_per_s") for x in same if not x["error"] and k in x["path"]), None)
                for k in ("pinned", "pageable")
            ]
            gbs, lib = r.get("gb_per_s"), r.get("library_gb_per_s")
            shown = "no copy" if r["copied"] is False else fmt(gbs) if gbs else "-"
            shown = f"failed: {r['error'][:80]}" if r["error"] else shown
            ms = [f"{1e3 * r[k]:.3f}" if r.get(k) else "-" for k in ("median_s", "median_host_s")]
            vs = [ratio(gbs, ref) if r["copied"] else "-" for ref in refs]
            which = [fmt(size["size_bytes"] / MIB), r["direction"].upper(), r["path"]]
            rows.append([*which, ms[0], shown, *vs, ms[1], fmt(lib) if lib else "-"])
    headers = ["size MiB", "dir", "path", "median ms", "GB/s", "vs torch pinned", "vs pageable"]
    copies = markdown_table([*headers, "host wall ms", "GB/s (library's own events)"], rows)
    steps = systems_table(summary, {"FSDP2": BASELINE}, extra)
    tables = f"{steps}\n\n(a) Copy bandwidth, host<->device:\n\n{copies}"
    a, b = (summary.get(k, {}).get("losses") or [] for k in (OURS, BASELINE))
    n = min(len(a), len(b))
    shown = ", ".join(f"{x:.4f}/{y:.4f}" for x, y in zip(a[:4], b[:4], strict=False))
    diff = max((abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)), default=0.0)
    cuda = payload["mode"] != "cpu-check"
    cpu_check = "CPU CHECK: tiny sizes on the CPU, nothing pinned, host timers; these figures "
    notes = [
        *([] if cuda else [cpu_check + "measure nothing about GPUs."]),
        f"{cfg['model']}, {cfg['params']:,} parameters (d {dims['d']}, {dims['heads']} heads, "
        f"{dims['n_layers']} blocks, context {dims['seq']}, global batch {dims['global_batch']}), "
        f"{cfg['dtype']} compute, fp32 masters, seed {cfg['seed']}, world size 1 "
        f"({'NCCL' if cuda else 'gloo'}); {cfg['warmup']} warm-up then up to {cfg['steps']} timed "
        "steps, as docs/benchmarks.md (gpu) describes them and their columns.",
        f"losses (zero3_offload/FSDP2), first steps: {shown}; max |diff| over {n} steps {diff:.2e}"
        if n
        else "losses: not comparable (a run produced none)",
        f"copies: {cfg['repeats']} repeats after {cfg['warmup']} warm-up, interleaved.",
        *payload["notes"],
        *(f"FAILED {f}" for f in payload["failed"]),
    ]
    title = "GPU suite: zero3_offload copy path and ~1B-param step vs FSDP2 + CPUOffloadPolicy"
    return Report(title, tables, notes)
