"""GPU suite: zero3_offload's copy path and a ~1B-parameter step vs FSDP2 + CPU offload.

One command for a single-GPU machine, every ratio against a baseline measured
in the same run, each part in its own process (so one part's device memory and
pinned host memory never affect another's):

(a) host<->device copy bandwidth of zero3_offload's copy path (``CopyStreams``,
    pinned compute copies, ``GradientStore``) vs plain torch pinned
    ``.to(non_blocking=True)`` and pageable copies, 16 MiB .. 1 GiB, timed with
    CUDA events (``_gpu_suite_copy.py``);
(b) step time of the GPT of ``_peers_model.py`` at ~1.0B parameters (d 2048,
    20 blocks, context 512, global batch 4, bf16 compute, fp32 masters /
    gradients / AdamW state) with zero3_offload offloading params, grads and
    optimizer states vs PyTorch FSDP2 ``fully_shard`` with
    ``CPUOffloadPolicy(pin_memory=True)``, world size 1 on NCCL, same model,
    data and seed; peak ``torch.cuda.max_memory_allocated`` and peak RSS;
(c) the exposed-copy fraction: zero3_offload's own stats (event-timed
    ``transfers`` vs ``exposed_communication_time`` over the timed steps) and,
    for both systems, a profiled step's trace (memcpy time with no kernel
    running / all memcpy time) (``_gpu_suite_train.py``).

    python benchmarks/gpu_suite.py              # full: expected 3-5 min on one H200, <= ~7.5
    python benchmarks/gpu_suite.py --quick      # small sizes and a ~50M model
    python benchmarks/gpu_suite.py --cpu-check  # the same code paths on the CPU, tiny

Writes ``benchmarks/results/gpu_suite.json`` and ``.md`` (``gpu_suite-quick``,
``gpu_suite-cpu-check`` for the other modes) and prints the markdown. It stays
inside ``--budget-s`` (default 420): a part whose estimate does not fit in
what is left is skipped with a note, and each worker is killed at its share.
Exit status: 0 when every part ran, 1 when a part failed or timed out (the
results are written either way), 2 when it cannot start (no CUDA, say).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, default_out, machine_info, write_results
from _gpu_suite_report import (
    SYSTEMS,
    loss_note,
    render_copies,
    render_exposure,
    render_systems,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MIB = 2**20
COPY_SIZES_MIB = {"full": [16, 64, 256, 1024], "quick": [16, 64], "cpu-check": [1, 4]}
MODELS = {  # d, heads, blocks, context, global batch
    "full": {"d": 2048, "heads": 16, "n_layers": 20, "seq": 512, "global_batch": 4},
    "quick": {"d": 1024, "heads": 8, "n_layers": 4, "seq": 256, "global_batch": 4},
    "cpu-check": {"d": 64, "heads": 4, "n_layers": 2, "seq": 32, "global_batch": 2},
}
# Seconds a part is expected to need (skip it when less is left) and the
# fraction of the budget after which its worker is killed.
ESTIMATE_S = {"copy": {"full": 45, "quick": 25, "cpu-check": 20}}
ESTIMATE_S["train"] = {"full": 120, "quick": 50, "cpu-check": 40}
CAP = {"copy": 0.3, "train": 0.42}
RESERVE_S = 10.0  # kept for writing the report
LR, WEIGHT_DECAY, SEED = 3e-4, 0.01, 0


def say(started: float, text: str) -> None:
    print(f"[gpu_suite {time.monotonic() - started:5.0f} s] {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_worker(
    script: str, label: str, spec: dict[str, Any], timeout: float, tmp: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Run ``script SPEC.json`` in a fresh process group; its JSON result (or why there is none)."""
    out, log = tmp / f"{label}.json", tmp / f"{label}.log"
    spec = {**spec, "out": str(out), "deadline": time.time() + timeout - 5.0}
    spec_path = tmp / f"{label}-spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    timed_out = False
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / script), str(spec_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on Ctrl-C: the worker is in its own session and would run on
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
                proc.wait()
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
    try:
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, or cut short by the kill
        result = {}
    if not result:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.returncode}"
        result = {"status": "failed", "error": f"no result ({why}); last output: {last[:300]}"}
    elif timed_out:
        result.setdefault("notes", []).append(f"killed at its {timeout:.0f} s limit")
        if result.get("status") != "ok":
            result["status"] = "timed out"
    result["log_tail"] = tail
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, default_repeats=10)
    parser.add_argument("--cpu-check", action="store_true", help="run every part on the CPU, tiny")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget (420)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps (5)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled steps")
    args = parser.parse_args(argv)
    if args.repeats < 5 or args.warmup < 1 or args.steps < 2 or args.budget_s < 30:
        parser.error("need --repeats >= 5, --warmup >= 1, --steps >= 2, --budget-s >= 30")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if not args.cpu_check and not torch.cuda.is_available():
        print(
            f"gpu_suite.py: CUDA is not available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); run it on a GPU machine, or use --cpu-check",
            file=sys.stderr,
        )
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    probe = subprocess.run(
        [sys.executable, "-c", "import zero3_offload"], env=env, capture_output=True, text=True
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        print(
            f"gpu_suite.py: zero3_offload does not import ({last}); pip install -e . first",
            file=sys.stderr,
        )
        return 2
    mode = "cpu-check" if args.cpu_check else "quick" if args.quick else "full"
    threads = args.threads or (1 if args.cpu_check else None)
    if threads:
        torch.set_num_threads(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    device = "cpu" if args.cpu_check else "cuda"
    info = machine_info()
    if device == "cuda":
        info.update(gpu_name=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda)
    dims = MODELS[mode]
    dtype = "bfloat16"
    budget_end = started + args.budget_s
    notes: list[str] = []
    failed: list[str] = []

    def share(part: str) -> float | None:
        left = budget_end - time.monotonic() - RESERVE_S
        if left < ESTIMATE_S[part][mode]:
            return None
        return min(left, CAP[part] * args.budget_s)

    with tempfile.TemporaryDirectory(prefix="gpu_suite-") as tmp_name:
        tmp = Path(tmp_name)
        copy: dict[str, Any] = {"status": "skipped"}
        timeout = share("copy")
        if timeout is None:
            notes.append("part (a) skipped: budget too small")
        else:
            say(started, f"(a) copy bandwidth, {COPY_SIZES_MIB[mode]} MiB, limit {timeout:.0f} s")
            sizes = [s * MIB for s in COPY_SIZES_MIB[mode]]
            spec = {"device": device, "sizes_bytes": sizes, "warmup": args.warmup}
            spec.update(repeats=args.repeats, threads=threads)
            copy = run_worker("_gpu_suite_copy.py", "copy", spec, timeout, tmp, env)
            notes += [f"(a) {n}" for n in copy.get("notes", [])]
        runs: dict[str, dict[str, Any]] = {}
        for key, label in SYSTEMS.items():
            timeout = share("train")
            if timeout is None:
                runs[key] = {"status": "skipped (budget)"}
                notes.append(f"(b) {label} skipped: {budget_end - time.monotonic():.0f} s left")
                continue
            say(started, f"(b) {label}, {dims}, limit {timeout:.0f} s")
            env_run = {**env, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
            env_run.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            spec = {"system": key, "device": device, "dims": dims, "dtype": dtype, "seed": SEED}
            spec.update(global_batch=dims["global_batch"], lr=LR, weight_decay=WEIGHT_DECAY)
            spec.update(warmup_steps=args.warmup, steps=args.steps, threads=threads)
            spec.update(backend="nccl" if device == "cuda" else "gloo", reserve_s=5.0)
            spec.update(profile=not args.no_profile)
            runs[key] = run_worker("_gpu_suite_train.py", key, spec, timeout, tmp, env_run)
            notes += [f"(b) {label}: {n}" for n in runs[key].get("notes", [])]
            say(started, f"    {label}: {runs[key].get('status')} {runs[key].get('error', '')}")
    for name, r in [("copy", copy), *runs.items()]:
        if r.get("status") not in ("ok", "skipped", "skipped (budget)"):
            failed.append(f"{name}: {r.get('status')}: {r.get('error', '')}")
    for size in copy.get("sizes", []):
        for row in size["rows"]:
            if row.get("error"):
                mb = size["size_bytes"] // MIB
                failed.append(f"copy {mb} MiB {row['direction']} {row['path']}: {row['error']}")
    params = next((r["params"] for r in runs.values() if "params" in r), None)
    model_txt = (
        f"GPT of _peers_model.py, {params:,} parameters" if params else "GPT of _peers_model.py"
    )
    summary = [
        f"{model_txt} (d {dims['d']}, {dims['heads']} heads, {dims['n_layers']} blocks, "
        f"context {dims['seq']}, global batch {dims['global_batch']}), {dtype} compute, fp32 "
        f"master weights, gradients and AdamW state (lr {LR}, weight decay {WEIGHT_DECAY}), "
        f"seed {SEED}, world size 1 ({'NCCL' if device == 'cuda' else 'gloo'}), one process "
        f"per system; {args.warmup} warm-up then up to {args.steps} timed steps; step = "
        "forward, loss, backward, optimizer step, loss.item() and a device synchronize.",
        loss_note(runs),
        "vs FSDP2 = this system's figure / FSDP2 + CPUOffloadPolicy's (<1: faster or smaller).",
        "exposed copy (profiler): in one profiled step after the timed ones, time of "
        "HtoD/DtoH memcpys during which no kernel ran / time of all of them (trace intervals).",
        "exposed copy (zero3 stats): min(exposed communication, copy time) / copy time over "
        "the timed steps, from get_performance_stats(): transfers (h2d + d2h, timed by the "
        "library's CUDA events) and exposed_communication_time (host waits for gathers, "
        "which here include a 1-rank all-gather, and reduce-scatter slots). On NCCL a "
        "collective's future completes when it is enqueued, so host waits are expected to "
        "miss waits that happen between CUDA streams: the profiler column is the GPU's view.",
        "copies: fp32 tensors, GB/s = bytes counted from the tensors / median of CUDA-event "
        f"time on the copy's stream ({args.repeats} repeats after {args.warmup} warm-up, "
        "interleaved); vs torch pinned / vs pageable: GB/s ratio (>1 faster); host wall "
        "includes enqueueing and the wait; library's own events: what the library's "
        "track_copy timing reports for the same copies.",
        *notes,
        *(f"FAILED {f}" for f in failed),
    ]
    if mode == "cpu-check":
        summary.insert(
            0,
            "CPU CHECK: tiny sizes on the CPU, nothing pinned, host timers; "
            "these figures measure nothing about GPUs.",
        )
    tables = "\n\n".join(
        [
            render_systems(runs, dtype),
            "(a) Copy bandwidth, host<->device:",
            render_copies(copy),
            "(c) Exposed copies in detail:",
            render_exposure(runs),
        ]
    )
    payload = {
        "benchmark": "gpu_suite",
        "mode": mode,
        "machine": info,
        "config": {**vars(args), "dims": dims, "dtype": dtype, "lr": LR, "seed": SEED},
        "copy": copy,
        "runs": runs,
        "failed": failed,
        "elapsed_s": time.monotonic() - started,
    }
    out = args.out or default_out("gpu_suite", args.quick)
    if mode == "cpu-check" and args.out is None:
        out = out.with_name("gpu_suite-cpu-check.json")
    title = "GPU suite: zero3_offload copy path and ~1B-param step vs FSDP2 + CPUOffloadPolicy"
    _, md_path = write_results(out, payload, tables, title=title, notes=summary)
    print(md_path.read_text(encoding="utf-8"))
    say(started, f"wrote {out} and {md_path}; {len(failed)} part(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
