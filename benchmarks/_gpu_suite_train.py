"""Parts (b) and (c) of ``gpu_suite.py``: one training run, in its own process.

Started by ``gpu_suite.py`` as ``python benchmarks/_gpu_suite_train.py SPEC.json``
with torchrun's environment for one rank (``RANK=0``, ``WORLD_SIZE=1``,
``LOCAL_RANK=0``, ``MASTER_ADDR``, ``MASTER_PORT``); writes the JSON file the
spec's ``out`` names, also when the run fails (status, error, traceback).

Systems, both on one device with NCCL (gloo on the CPU), the GPT of
``_peers_model.py`` from the same seed, the same batches, AdamW with the same
hyper-parameters, compute in ``spec["dtype"]`` with fp32 master weights,
gradients and optimizer state:

- ``zero3_offload``: ``Zero3CpuOffloadManager`` with ``offload_params``,
  ``offload_grads``, ``offload_optimizer_states`` and ``pin_cpu_memory`` on,
  ``compute_dtype`` = the dtype, every other field at its default;
- ``fsdp2_offload``: ``fully_shard`` on every child and the root with
  ``CPUOffloadPolicy(pin_memory=True)`` and ``MixedPrecisionPolicy(param_dtype=
  dtype, reduce_dtype=float32)``; ``torch.optim.AdamW(fused=True)`` on the CPU
  shards (foreach=False if the fused kernel refuses them, with a note).

Each step: batch to the device, forward, loss (fp32 cross-entropy outside the
model), backward, optimizer step, ``loss.item()`` and a device synchronize;
step time is the wall time of that (``time.perf_counter``). ``warmup_steps``
untimed steps, then up to ``steps`` timed ones (fewer, with a note, when the
deadline is near). Then one more step under ``torch.profiler`` (CPU and CUDA
activities) whose Chrome trace gives the GPU-side exposed-copy fraction: the
time of host<->device memcpys during which no kernel ran, over the time of
all such memcpys. zero3_offload's own figures for part (c) are the deltas of
``get_performance_stats()`` over the timed steps. Peak device memory is
``torch.cuda.max_memory_allocated`` over the whole process (reset after CUDA
initialisation), peak RSS is ``VmHWM``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_suite_trace import Step, profile_step, sync
from _peers_model import batches, count_params, lm_loss, make_model

BETAS = (0.9, 0.999)
EPS = 1e-8
MIN_TIMED = 2  # timed steps kept even when the deadline is near


def proc_status_bytes() -> dict[str, int]:
    """``VmHWM`` (peak resident) and ``VmRSS`` of this process in bytes (Linux)."""
    out = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


# ------------------------------------------------------------ the step loop


async def train_loop(
    step: Step,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    spec: dict[str, Any],
    result: dict[str, Any],
    warm_done: Callable[[], None],
) -> None:
    """Warm-up then timed steps; losses and step times go into ``result``."""
    device = torch.device(spec["device"])
    warm, planned = spec["warmup_steps"], spec["steps"]
    losses, times = [], []
    for i, (x, y) in enumerate(data[: warm + planned]):
        if i == warm:
            warm_done()
        timed = i - warm
        if timed >= MIN_TIMED and times:
            left = spec["deadline"] - time.time()
            if left < 1.5 * max(times) + spec["reserve_s"]:
                result["notes"].append(
                    f"stopped after {timed} of {planned} timed steps: {left:.0f} s left"
                )
                break
        x, y = x.to(device), y.to(device)
        sync(device)
        t0 = time.perf_counter()
        loss = await step(x, y)
        value = loss.item()
        sync(device)
        elapsed = time.perf_counter() - t0
        losses.append(value)
        if i >= warm:
            times.append(elapsed)
        print(f"{spec['system']}: step {i} loss {value:.4f} {elapsed:.3f} s", flush=True)
    result["losses"] = losses
    result["step_s"] = times


def _stat(snapshot: Any, name: str) -> float:
    return float(getattr(snapshot, name, 0.0) or 0.0)


def library_copy_stats(s0: Any, s1: Any) -> dict[str, Any]:
    """Deltas of zero3_offload's own stats between two ``get_performance_stats()``."""
    out: dict[str, Any] = {}
    copy_s = 0.0
    for kind in ("h2d", "d2h"):
        t0 = (getattr(s0, "transfers", {}) or {}).get(kind)
        t1 = (getattr(s1, "transfers", {}) or {}).get(kind)
        n = (t1.transfers if t1 else 0) - (t0.transfers if t0 else 0)
        sec = (t1.time if t1 else 0.0) - (t0.time if t0 else 0.0)
        nbytes = (t1.bytes if t1 else 0) - (t0.bytes if t0 else 0)
        out[kind] = {
            "copies": n,
            "seconds": sec,
            "bytes": nbytes,
            "gb_per_s": nbytes / sec / 1e9 if sec > 0 else None,
        }
        copy_s += sec
    wait_s = _stat(s1, "exposed_communication_time") - _stat(s0, "exposed_communication_time")
    out["copy_s"] = copy_s
    out["exposed_wait_s"] = wait_s
    out["compute_s"] = _stat(s1, "total_compute_time") - _stat(s0, "total_compute_time")
    out["step_s"] = _stat(s1, "total_step_time") - _stat(s0, "total_step_time")
    out["exposed_fraction"] = min(wait_s, copy_s) / copy_s if copy_s > 0 else None
    return out


# ------------------------------------------------------------ systems


async def run_zero3(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from zero3_offload import (
        OptimizerConfig,
        Zero3CpuOffloadConfig,
        Zero3CpuOffloadManager,
        destroy_process_group,
        init_process_group_from_env,
    )

    device = torch.device(spec["device"])
    group = await init_process_group_from_env(spec["backend"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = make_model(spec["dims"], spec["seed"])
    names = [name for name, _ in model.named_children()]
    config = Zero3CpuOffloadConfig(
        device=spec["device"],
        compute_dtype=spec["dtype"],
        offload_params=True,
        offload_grads=True,
        offload_optimizer_states=True,
        pin_cpu_memory=True,
        optimizer=OptimizerConfig(
            kind="adamw", betas=BETAS, eps=EPS, weight_decay=spec["weight_decay"]
        ),
    )
    result["config"] = config.to_dict()
    lr = spec["lr"]
    data = batches(
        spec["warmup_steps"] + spec["steps"] + 1, spec["global_batch"], spec["dims"]["seq"], 1
    )
    snaps: list[Any] = []
    async with Zero3CpuOffloadManager(config, group, model) as manager:
        result["setup_done_s"] = time.perf_counter() - result["_t0"]

        async def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = await manager.forward_pass(x, names)
            out.requires_grad_()  # the loss lives outside the manager
            loss = lm_loss(out.float(), y)
            loss.backward()
            await manager.backward_pass(out.grad, names)
            await manager.optimizer_step(lr)
            return loss

        await train_loop(
            step, data, spec, result, lambda: snaps.append(manager.get_performance_stats())
        )
        snaps.append(manager.get_performance_stats())
        result["library_copy_stats"] = library_copy_stats(snaps[0], snaps[-1])
        mem = manager.get_memory_stats()
        result["model_state_bytes"] = {
            k: getattr(mem, k, None)
            for k in ("master_param_bytes", "compute_copy_bytes", "optimizer_state_bytes")
        }
        await finish(spec, result, step, data[-1])
    destroy_process_group()


async def run_fsdp2(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(spec["backend"], init_method="env://")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = make_model(spec["dims"], spec["seed"])
    dtype = getattr(torch, spec["dtype"])
    kw: dict[str, Any] = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    if dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for child in model.children():
        fully_shard(child, **kw)
    fully_shard(model, **kw)
    params = list(model.parameters())
    hyper = {"lr": spec["lr"], "betas": BETAS, "eps": EPS, "weight_decay": spec["weight_decay"]}

    def unfused(exc: Exception) -> torch.optim.Optimizer:
        result["notes"].append(
            f"fused AdamW refused the CPU shards ({str(exc).splitlines()[0]}); "
            "using AdamW(foreach=False)"
        )
        result["optimizer"] = "AdamW(foreach=False)"
        return torch.optim.AdamW(params, foreach=False, **hyper)

    result["optimizer"] = "AdamW(fused=True)"
    try:
        opt = torch.optim.AdamW(params, fused=True, **hyper)
    except (RuntimeError, ValueError) as exc:
        opt = unfused(exc)
    result["setup_done_s"] = time.perf_counter() - result["_t0"]

    async def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal opt
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x).float(), y)
        loss.backward()
        try:
            opt.step()
        except (RuntimeError, NotImplementedError) as exc:
            if result["optimizer"] != "AdamW(fused=True)":
                raise
            opt = unfused(exc)  # before any state existed: the first step
            opt.step()
        return loss

    data = batches(
        spec["warmup_steps"] + spec["steps"] + 1, spec["global_batch"], spec["dims"]["seq"], 1
    )
    await train_loop(step, data, spec, result, lambda: None)
    await finish(spec, result, step, data[-1])
    dist.destroy_process_group()


async def finish(
    spec: dict[str, Any],
    result: dict[str, Any],
    step: Step,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Memory peaks, the partial result on disk, then the profiled step (if time is left)."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        result["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    result["peak_rss_bytes"] = proc_status_bytes().get("VmHWM")
    write(spec, {**result, "status": "ok"})  # kept even if profiling crashes the process
    left = spec["deadline"] - time.time()
    needed = 3.0 * max(result["step_s"] or [1.0]) + spec["reserve_s"]
    if not spec["profile"] or left < needed:
        result["notes"].append(f"profiled step skipped: {left:.0f} s left, ~{needed:.0f} s needed")
        return
    try:
        trace = Path(spec["out"]).with_suffix(".trace.json")
        result["profiler_copy"] = await profile_step(step, *batch, device, trace)
    except Exception as exc:
        result["notes"].append(f"profiled step failed: {type(exc).__name__}: {exc}".splitlines()[0])
    write(spec, {**result, "status": "ok"})  # kept even if closing the process group hangs


SYSTEMS = {"zero3_offload": run_zero3, "fsdp2_offload": run_fsdp2}


def write(spec: dict[str, Any], result: dict[str, Any]) -> None:
    clean = {k: v for k, v in result.items() if not k.startswith("_")}
    Path(spec["out"]).write_text(json.dumps(clean, indent=1, default=str), encoding="utf-8")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model_params, _ = count_params(_meta(spec))
    result: dict[str, Any] = {
        "system": spec["system"],
        "notes": [],
        "params": model_params,
        "_t0": time.perf_counter(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        asyncio.run(SYSTEMS[spec["system"]](spec, result))
        result["status"] = "ok"
    except BaseException as exc:
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result["traceback"] = traceback.format_exc()
    result["run_s"] = time.perf_counter() - result["_t0"]
    result.setdefault("peak_rss_bytes", proc_status_bytes().get("VmHWM"))
    write(spec, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # NCCL and the library's worker threads can hold up interpreter exit; the result is written.
    os._exit(0)


def _meta(spec: dict[str, Any]) -> torch.nn.Module:
    """The model on the meta device, to count its parameters without allocating them."""
    from _peers_model import GPT

    d = spec["dims"]
    with torch.device("meta"):
        return GPT(d=d["d"], heads=d["heads"], n_layers=d["n_layers"], seq=d["seq"])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
