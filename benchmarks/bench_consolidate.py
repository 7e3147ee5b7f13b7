"""Peak memory and wall time of consolidating a sharded checkpoint into one file.

A model of ~285 MB fp32 (8 ``nn.Linear`` of widths 2048..4096 and 2
``nn.LayerNorm``, 10 layers; the largest parameter is one 4096 x 4096 weight,
64 MiB) is saved with ``Zero3CpuOffloadManager.save_checkpoint`` on 2 gloo
ranks (``zero3_offload.testing.run_ranks``) right after construction. Then
each case runs in its own fresh interpreter, so every peak is one process's:

- **baseline**: the process only imports torch, safetensors and zero3_offload
  (what every other case pays before it starts);
- **consolidate -> safetensors**: ``consolidate_checkpoint(ckpt, out.safetensors)``,
  streamed tensor by tensor;
- **consolidate -> pt**: ``consolidate_checkpoint(ckpt, out.pt, fmt="pt")``,
  which assembles the whole state dict before ``torch.save``;
- **naive load_file (mmap) + read all**: ``safetensors.torch.load_file`` of
  the consolidated file, then every tensor summed once (a full load, for
  reference). safetensors 0.8 maps the file (``backend="mmap"``, its default)
  and hands out tensors over the mapping, so ``load_file`` alone reads
  nothing (~1 ms, +3 MiB); summing makes every page resident;
- **naive load_file (pread)**: ``load_file(..., backend="pread")``, which
  reads the file into ordinary (anonymous) memory (skipped with a safetensors
  that has no ``backend`` argument).

Memory, per process:

- peak RSS: ``VmHWM`` of ``/proc/self/status``, read by the child at its end
  (the kernel's high-water mark of this process's resident memory). Not
  ``ru_maxrss``: Linux carries the high-water mark of the image before
  ``exec`` into it, so a child's ``ru_maxrss`` is never below the parent's peak
  at the fork (it read 305.7 MiB for every case of a tiny model, the parent's
  figure; the JSON keeps it as ``ru_maxrss_bytes``). Resident memory counts
  file pages mapped into the process as well as anonymous memory;
- peak anonymous RSS: ``RssAnon`` of ``/proc/<pid>/status``, sampled by the
  parent every ~2 ms while the child runs (there is no kernel high-water mark
  for it, so a spike shorter than that could be missed). This is the memory
  that has to exist; mapped clean file pages can be dropped under pressure.

Both are reported minus the baseline's (the median over its runs) and divided
by the model's bytes and by the largest tensor's bytes. Wall time is
``time.perf_counter`` around the call alone (interpreter start and imports are
not in it); the safetensors path ends with an ``fsync`` of its output (timed
on its own too, by wrapping ``os.fsync`` in the child), ``torch.save`` does
not fsync. The checkpoint and outputs were just written,
so they are read from the page cache.

Cases run interleaved (baseline, safetensors, pt, naive, naive pread, baseline, ...):
``--warmup`` untimed rounds, then ``--repeats`` rounds; medians are reported
(every sample is in the JSON). Correctness is checked in separate processes
afterwards: the consolidated safetensors file (via ``load_file``) and the
``.pt`` file (via ``torch.load(weights_only=True)``) must hold exactly the
model's state-dict names, shapes and dtypes, load ``strict=True`` into the
model class, and every tensor's SHA-256 must equal that of the model the
ranks were built from (hashed on rank 0 before the manager took it over).

Run: ``python benchmarks/bench_consolidate.py`` (about a minute and a half here) or with
``--quick`` (a tiny model, seconds). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import itertools
import json
import os
import resource
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

import zero3_offload
from zero3_offload.consolidate import consolidate_checkpoint

NAME = "consolidate"
WORLD = 2
SEED = 0
FULL_WIDTHS = (2048, 3072, 4096, 4096, 3072, 2048, 2048, 3072, 2048)
QUICK_WIDTHS = (64, 128, 256, 256, 128, 64, 64, 128, 64)
LN_AFTER = (2, 5)  # a LayerNorm after these Linear layers (small tensors between big ones)
SAMPLE_INTERVAL_S = 0.002
MIB = 2**20

BASELINE = "baseline"
STREAM = "consolidate -> safetensors"
PT = "consolidate -> pt"
NAIVE = "naive load_file (mmap) + read all"
NAIVE_PREAD = "naive load_file (pread)"
CASES = {
    BASELINE: "baseline",
    STREAM: "stream",
    PT: "pt",
    NAIVE: "naive",
    NAIVE_PREAD: "naive-pread",
}
if "backend" not in inspect.signature(safetensors.torch.load_file).parameters:
    del CASES[NAIVE_PREAD]  # safetensors < 0.8 has no choice of backend
ST_FILE, PT_FILE = "model.safetensors", "model.pt"


def make_model(widths: tuple[int, ...], seed: int) -> nn.Sequential:
    """Linear layers ``widths[i] -> widths[i+1]``, LayerNorms after :data:`LN_AFTER`.

    Each layer is seeded on its own, so the same call builds the same model anywhere.
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        torch.manual_seed(seed + i)
        layers[f"fc{i}"] = nn.Linear(fan_in, fan_out)
        if i in LN_AFTER:
            ln = nn.LayerNorm(fan_out)
            with torch.no_grad():
                ln.weight.normal_(1.0, 0.02)
                ln.bias.normal_(0.0, 0.02)
            layers[f"ln{i}"] = ln
    return nn.Sequential(layers)


def digests(state: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """name -> [dtype, shape, sha256 of the bytes] (hashes the tensor's memory, no copy)."""
    out = {}
    for name, t in state.items():
        t = t.detach().contiguous()
        h = hashlib.sha256(t.reshape(-1).numpy().data).hexdigest()
        out[name] = [str(t.dtype), list(t.shape), h]
    return out


# ----------------------------------------------------------------- checkpoint (2 ranks)


async def save_rank(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model, construct the manager, save a checkpoint at once (no training)."""
    from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager

    model = make_model(tuple(spec["widths"]), spec["seed"])
    ref = digests(model.state_dict()) if ctx.rank == 0 else None
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Generous budgets, each within its limit (the config checks budget <= limit).
    cpu_budget = max(4 * model_bytes, 64 * MIB)
    gpu_budget = max(2 * model_bytes, 64 * MIB)
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw"),
        cpu_memory_budget=cpu_budget,
        max_cpu_memory_mb=2 * -(-cpu_budget // MIB),
        gpu_param_memory_budget=gpu_budget,
        max_gpu_memory_mb=2 * -(-gpu_budget // MIB),
    )
    t0 = time.perf_counter()
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        t1 = time.perf_counter()
        path = await manager.save_checkpoint(spec["root"])
        t2 = time.perf_counter()
    return {
        "rank": ctx.rank,
        "path": str(path),
        "construct_s": t1 - t0,
        "save_s": t2 - t1,
        "digests": ref,
        "config": config.to_dict(),
    }


# ----------------------------------------------------------------- child processes


def child_main(case: str, ckpt: str, work: str, threads: int | None) -> None:
    """One measured case in this fresh process; prints one JSON line."""
    if threads is not None:
        torch.set_num_threads(threads)
    work_dir = Path(work)
    result: dict[str, Any] = {"case": case, "torch_threads": torch.get_num_threads()}
    result["before_op"] = _proc_status("self")
    fsync_s = [0.0]
    real_fsync = os.fsync

    def timed_fsync(fd: int) -> None:  # consolidate's safetensors path ends with an fsync
        start = time.perf_counter()
        real_fsync(fd)
        fsync_s[0] += time.perf_counter() - start

    os.fsync = timed_fsync
    t0 = time.perf_counter()
    if case == "stream":
        consolidate_checkpoint(ckpt, work_dir / ST_FILE)
    elif case == "pt":
        consolidate_checkpoint(ckpt, work_dir / PT_FILE, fmt="pt")
    elif case in ("naive", "naive-pread"):
        kwargs = {"backend": "pread"} if case == "naive-pread" else {}
        state = safetensors.torch.load_file(str(work_dir / ST_FILE), **kwargs)
        result["load_s"] = time.perf_counter() - t0
        if case == "naive":  # mmap tensors are read lazily: read every byte once
            result["checksum"] = sum(float(t.sum()) for t in state.values())
        result["tensors"] = len(state)
        result["loaded_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    elif case != "baseline":
        raise SystemExit(f"unknown case {case!r}")
    result["wall_s"] = time.perf_counter() - t0
    result["fsync_s"] = fsync_s[0]
    # The peak is VmHWM: the high-water mark of this process image's resident set.
    # ru_maxrss is not usable here: Linux carries the pre-exec high-water mark over
    # exec, so a child's ru_maxrss is at least the parent's peak when it forked.
    status = _proc_status("self")
    result["peak_rss_bytes"] = status["VmHWM"]
    result["at_end"] = status
    result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result), flush=True)


def verify_main(work: str, widths: list[int]) -> None:
    """Load both outputs, check strict loading, print their digests as one JSON line."""
    work_dir = Path(work)
    out: dict[str, Any] = {}
    for label, load in (
        ("safetensors", lambda: safetensors.torch.load_file(str(work_dir / ST_FILE))),
        ("pt", lambda: torch.load(work_dir / PT_FILE, weights_only=True)),
    ):
        state = load()
        with torch.device("meta"):  # strict load without allocating a second model
            model = make_model(tuple(widths), SEED + 1)
        model.load_state_dict(state, strict=True, assign=True)
        out[label] = digests(state)
        del state, model
    print(json.dumps(out), flush=True)


_STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def _proc_status(pid: int | str) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem (bytes) of ``pid``; empty once it is gone."""
    vals = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in _STATUS_KEYS:
                    vals[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return vals


def run_child(argv: list[str]) -> dict[str, Any]:
    """Run this script with ``argv`` in a fresh interpreter, sampling its memory."""
    import subprocess
    import tempfile

    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    peaks = dict.fromkeys(_STATUS_KEYS, 0)
    samples = 0
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        while proc.poll() is None:
            vals = _proc_status(proc.pid)
            if vals:
                samples += 1
                for k, v in vals.items():
                    peaks[k] = max(peaks[k], v)
            time.sleep(SAMPLE_INTERVAL_S)
        process_s = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{stderr}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["process_s"] = process_s
    result["sampled_peak_bytes"] = peaks
    result["samples"] = samples
    return result


# ----------------------------------------------------------------- parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model (~0.4 MB), finishes in seconds"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="measured rounds of all cases (default 5; 1)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds first (default 1; quick 0)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads in the measured processes (default: torch's setting)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/consolidate.json, consolidate-quick.json "
        "with --quick); a .md table is written beside it",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the checkpoint and outputs go (a fresh temporary directory under it; "
        "default: the system's temp dir); removed at the end",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    # Internal: the measured child processes.
    parser.add_argument("--child", choices=sorted(CASES.values()), help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--widths", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.ckpt, args.work, args.threads)
        return 0
    if args.verify:
        verify_main(args.work, json.loads(args.widths))
        return 0

    import asyncio
    import shutil
    import tempfile

    from zero3_offload.testing import run_ranks

    try:
        from _common import default_out, machine_info, machine_line, markdown_table, write_results
    except ModuleNotFoundError:  # run as ``python -m benchmarks.bench_consolidate``
        from benchmarks._common import (
            default_out,
            machine_info,
            machine_line,
            markdown_table,
            write_results,
        )

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # machine info then shows the children's setting
    info = machine_info()
    print(f"machine: {machine_line(info)}", flush=True)
    widths = QUICK_WIDTHS if args.quick else FULL_WIDTHS
    started = time.perf_counter()

    with torch.device("meta"):  # sizes only
        meta_model = make_model(widths, SEED)
    sizes = {n: p.numel() * p.element_size() for n, p in meta_model.state_dict().items()}
    model_bytes = sum(sizes.values())
    largest_name = max(sizes, key=sizes.__getitem__)
    largest = sizes[largest_name]
    n_layers = len(list(meta_model.children()))
    print(
        f"model: {n_layers} layers, {len(sizes)} tensors, {model_bytes:,} bytes "
        f"({_mib(model_bytes)} MiB) fp32; largest {largest_name} {largest:,} bytes "
        f"({_mib(largest)} MiB)",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="bench-consolidate-", dir=args.workdir))
    try:
        root = work / "ckpt"
        t0 = time.perf_counter()
        ranks = asyncio.run(
            run_ranks(save_rank, WORLD, {"widths": list(widths), "seed": SEED, "root": str(root)})
        )
        build_s = time.perf_counter() - t0
        ckpt_dir = Path(ranks[0]["path"])
        ckpt_files = {p.name: p.stat().st_size for p in sorted(ckpt_dir.iterdir())}
        ref = ranks[0]["digests"]
        print(
            f"checkpoint: {ckpt_dir.name}, {sum(ckpt_files.values()):,} bytes in "
            f"{len(ckpt_files)} files; built in {build_s:.1f} s (save "
            f"{max(r['save_s'] for r in ranks):.2f} s)",
            flush=True,
        )

        rounds = []
        for r in range(args.warmup + args.repeats):
            measured = r >= args.warmup
            row = {}
            for label, case in CASES.items():
                row[label] = run_child(
                    ["--child", case, "--ckpt", str(root), "--work", str(work)]
                    + (["--threads", str(args.threads)] if args.threads else [])
                )
            rounds.append({"round": r, "warmup": not measured, "cases": row})
            print(
                f"round {r}{' (warm-up)' if not measured else ''}: "
                + ", ".join(
                    f"{label} {res['wall_s']:.2f} s / {_mib(res['peak_rss_bytes'])} MiB"
                    for label, res in row.items()
                ),
                flush=True,
            )

        out_sizes = {
            ST_FILE: (work / ST_FILE).stat().st_size,
            PT_FILE: (work / PT_FILE).stat().st_size,
        }
        verified = run_child(["--verify", "--work", str(work), "--widths", json.dumps(widths)])
        checks = {}
        for label in ("safetensors", "pt"):
            got = verified[label]
            checks[label] = {
                "same_names": sorted(got) == sorted(ref),
                "tensors_equal": sum(got.get(n) == d for n, d in ref.items()),
                "tensors": len(ref),
            }
        ok = all(c["same_names"] and c["tensors_equal"] == c["tensors"] for c in checks.values())
        print(f"verify: {checks} -> {'OK' if ok else 'MISMATCH'}", flush=True)
    finally:
        if args.keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    total_s = time.perf_counter() - started
    if not ok:
        print("consolidated output differs from the model: no results written", file=sys.stderr)
        return 1

    measured_rounds = [rd for rd in rounds if not rd["warmup"]]

    def col(label: str, key: str) -> list[float]:
        vals = []
        for rd in measured_rounds:
            res = rd["cases"][label]
            vals.append(
                res["sampled_peak_bytes"][key] if key in ("RssAnon", "RssFile") else res[key]
            )
        return vals

    base_rss = _median(col(BASELINE, "peak_rss_bytes"))
    base_anon = _median(col(BASELINE, "RssAnon"))
    summary = {}
    rows = []
    for label in CASES:
        peak = _median(col(label, "peak_rss_bytes"))
        anon = _median(col(label, "RssAnon"))
        file_peak = _median(col(label, "RssFile"))
        wall = _median(col(label, "wall_s"))
        fsync = _median(col(label, "fsync_s"))
        s = {
            "wall_s_median": wall,
            "wall_s": col(label, "wall_s"),
            "fsync_s_median": fsync,
            "fsync_s": col(label, "fsync_s"),
            "process_s": col(label, "process_s"),
            "peak_rss_bytes_median": peak,
            "peak_rss_bytes": col(label, "peak_rss_bytes"),
            "peak_rss_minus_baseline_bytes": peak - base_rss,
            "peak_rss_minus_baseline_over_model": (peak - base_rss) / model_bytes,
            "peak_rss_minus_baseline_over_largest": (peak - base_rss) / largest,
            "peak_anon_bytes_median": anon,
            "peak_anon_bytes": col(label, "RssAnon"),
            "peak_anon_minus_baseline_bytes": anon - base_anon,
            "peak_anon_minus_baseline_over_model": (anon - base_anon) / model_bytes,
            "peak_anon_minus_baseline_over_largest": (anon - base_anon) / largest,
            "peak_file_rss_bytes_median": file_peak,
        }
        summary[label] = s
        is_base = label == BASELINE
        rows.append(
            [
                label,
                "-" if is_base else f"{wall:.3f}",
                f"{fsync:.3f}" if fsync else "-",
                _mib(peak),
                "-" if is_base else _mib(peak - base_rss),
                "-" if is_base else f"{s['peak_rss_minus_baseline_over_model']:.2f}",
                "-" if is_base else f"{s['peak_rss_minus_baseline_over_largest']:.2f}",
                _mib(anon),
                "-" if is_base else _mib(anon - base_anon),
                "-" if is_base else f"{s['peak_anon_minus_baseline_over_model']:.2f}",
                "-" if is_base else f"{s['peak_anon_minus_baseline_over_largest']:.2f}",
            ]
        )
    headers = [
        "case",
        "wall s",
        "of which fsync s",
        "peak RSS MiB",
        "- baseline MiB",
        "/ model",
        "/ largest",
        "peak anon MiB",
        "- baseline MiB",
        "/ model",
        "/ largest",
    ]
    table = markdown_table(headers, rows)
    threads = measured_rounds[0]["cases"][STREAM]["torch_threads"]
    notes = [
        f"model: {n_layers} layers (nn.Linear widths {' -> '.join(map(str, widths))}, "
        f"LayerNorm after fc{', fc'.join(map(str, LN_AFTER))}), {len(sizes)} tensors, "
        f"{model_bytes:,} bytes fp32 ({_mib(model_bytes)} MiB); largest tensor "
        f"{largest_name}: {largest:,} bytes ({_mib(largest)} MiB).",
        f"checkpoint: saved by Zero3CpuOffloadManager on {WORLD} gloo ranks right after "
        f"construction (no optimizer state yet), {sum(ckpt_files.values()):,} bytes in "
        f"{len(ckpt_files)} files; outputs {out_sizes[ST_FILE]:,} bytes (.safetensors) and "
        f"{out_sizes[PT_FILE]:,} bytes (.pt). Read from the page cache (just written).",
        f"each case a fresh process ({threads} torch threads); medians of {args.repeats} "
        f"round(s) after {args.warmup} warm-up round(s), cases interleaved.",
        "peak RSS = the child's VmHWM (includes mapped file pages; ru_maxrss would include "
        "the parent's peak, see the script); peak anon = RssAnon "
        f"of /proc/<pid>/status sampled every {SAMPLE_INTERVAL_S * 1000:g} ms by the parent; "
        "'- baseline' subtracts the baseline process's median (imports only); "
        "'/ model' and '/ largest' divide that by the model's and the largest tensor's bytes.",
        "wall s = time.perf_counter around the call only (no interpreter start or imports); "
        "the safetensors path fsyncs its output (timed apart by wrapping os.fsync in the "
        "child), torch.save does not.",
        "verified: both outputs hold exactly the model's state-dict names, load strict=True, "
        "and every tensor's SHA-256 equals the original model's.",
    ]
    for note in notes:
        print(f"- {note}")
    print()
    print(table)

    payload = {
        "benchmark": NAME,
        "machine": info,
        "config": {
            "quick": args.quick,
            "world_size": WORLD,
            "widths": list(widths),
            "layernorm_after": list(LN_AFTER),
            "seed": SEED,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": args.threads,
            "sample_interval_s": SAMPLE_INTERVAL_S,
            "zero3_offload_version": zero3_offload.__version__,
            "safetensors_version": safetensors.__version__,
            "manager_config": ranks[0]["config"],
        },
        "model": {
            "layers": n_layers,
            "tensors": len(sizes),
            "model_bytes": model_bytes,
            "largest_tensor": largest_name,
            "largest_tensor_bytes": largest,
            "tensor_bytes": sizes,
        },
        "checkpoint": {
            "files": ckpt_files,
            "build_s": build_s,
            "per_rank": [{k: v for k, v in r.items() if k != "digests"} for r in ranks],
        },
        "outputs_bytes": out_sizes,
        "baseline": {"peak_rss_bytes": base_rss, "peak_anon_bytes": base_anon},
        "summary": summary,
        "rounds": rounds,
        "verification": checks,
        "total_wall_s": total_s,
    }
    out = args.out or default_out(NAME, args.quick)
    json_path, md_path = write_results(
        out,
        payload,
        table,
        title=f"Checkpoint consolidation ({_mib(model_bytes)} MiB fp32 model, {WORLD} ranks)",
        notes=notes,
    )
    print(f"\nwrote {json_path} and {md_path} (total {total_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
