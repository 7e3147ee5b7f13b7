"""The measured side of ``bench_consolidate.py``: the model, the checkpoint and the child processes.

Every case runs in a fresh interpreter (``bench_consolidate.py --child CASE``),
which this module's :func:`run_child` starts and samples; its imports are the
script's (torch, safetensors, zero3_offload), what the baseline case measures.
"""

from __future__ import annotations

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

from zero3_offload.checkpoint.consolidate import consolidate_checkpoint

SCRIPT = Path(__file__).resolve().with_name("bench_consolidate.py")
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

    cmd = [sys.executable, str(SCRIPT), *argv]
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
