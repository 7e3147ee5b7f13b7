"""One rank of one system in ``compare_peers.py`` (a fresh interpreter per rank).

Started by ``compare_peers.py`` as ``python benchmarks/_peers_worker.py SPEC.json``
with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); the plain-torch system
runs as a single process without them. It trains ``warmup + steps`` steps of
the shared GPT (``_peers_model.py``) and writes ``result-rank<r>.json`` into
the spec's ``out_dir``: losses and per-phase times of every step, the process's
``VmHWM``/``VmRSS`` at marks along the way, and the bytes of model state this
rank holds, counted from the tensors the system exposes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_model import batches, lm_loss, local_slice, make_model

BETAS = (0.9, 0.999)
EPS = 1e-8


def proc_status_kib() -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS (now) of this process, KiB, from /proc/self/status."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(line.split()[1])
    return out


class Marks:
    """``VmHWM`` and ``VmRSS`` (bytes) at named points of the run."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, int]] = {}

    def __call__(self, name: str) -> None:
        st = proc_status_kib()
        self.marks[name] = {"hwm_bytes": st["VmHWM"] * 1024, "rss_bytes": st["VmRSS"] * 1024}


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2)
    return to_local() if callable(to_local) else t


def storage_bytes(groups: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per group of the distinct storages behind the tensors (each counted once).

    A storage seen in an earlier group is not counted again, so views of one
    flat buffer (DeepSpeed's partitions, FSDP2's padded shards) count once,
    at the size of the buffer.
    """
    seen: set[int] = set()
    out = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            s = _local(t).untyped_storage()
            ptr = s.data_ptr()
            if ptr == 0 or ptr in seen or s.nbytes() == 0:
                continue
            seen.add(ptr)
            total += s.nbytes()
        out[name] = total
    out["total"] = sum(out.values())
    return out


def _opt_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _adamw(params: Iterable[torch.nn.Parameter], spec: dict[str, Any]) -> torch.optim.Optimizer:
    kw = {"lr": spec["lr"], "betas": BETAS, "eps": EPS, "weight_decay": spec["weight_decay"]}
    fused = spec["options"].get("fused")
    if fused is not None:
        kw["fused"] = fused
    return torch.optim.AdamW(params, **kw)


def _step_record(t: list[float], cpu0: float, loss: torch.Tensor) -> dict[str, float]:
    return {
        "loss": loss.item(),
        # CPU seconds of all of this process's threads during the step: less
        # sensitive than wall time to other work sharing the machine.
        "cpu_s": time.process_time() - cpu0,
        "forward_s": t[1] - t[0],
        "backward_s": t[2] - t[1],
        "optimizer_s": t[3] - t[2],
        "step_s": t[3] - t[0],
    }


# ---------------------------------------------------------------- systems


def run_torch(spec: dict[str, Any], rank: int, world: int, marks: Marks) -> dict[str, Any]:
    """Plain single-process torch: the whole global batch, AdamW."""
    model = make_model(spec["dims"], spec["seed"])
    marks("model_built")
    return _train_with_torch_adamw(model, spec, rank=0, world=1)


def run_fsdp2(spec: dict[str, Any], rank: int, world: int, marks: Marks) -> dict[str, Any]:
    """FSDP2 ``fully_shard`` on every child and the root (optionally with CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("gloo")
    model = make_model(spec["dims"], spec["seed"])
    marks("model_built")
    kw: dict[str, Any] = {}
    if spec["options"].get("cpu_offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for child in model.children():
        fully_shard(child, **kw)
    fully_shard(model, **kw)
    marks("setup_done")
    return _train_with_torch_adamw(model, spec, rank=rank, world=world)


def _train_with_torch_adamw(
    model: torch.nn.Module, spec: dict[str, Any], *, rank: int, world: int
) -> dict[str, Any]:
    """The step loop of plain torch and FSDP2: this rank's slice of every batch, torch AdamW;
    per-step times and losses, then the model state counted from the tensors."""
    opt = _adamw(model.parameters(), spec)
    data = batches(spec["warmup"] + spec["steps"], spec["global_batch"], spec["dims"]["seq"], 1)
    steps = []
    for x, y in data:
        xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
        cpu0 = time.process_time()
        t = [time.perf_counter()]
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(xs), ys)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        steps.append(_step_record(t, cpu0, loss))
    params = list(model.parameters())
    state = storage_bytes(
        {
            "params": params,
            "grads": [p.grad for p in params],
            "optimizer_state": _opt_state_tensors(opt),
        }
    )
    return {"steps": steps, "model_state": state, "optimizer": type(opt).__name__}


def run_deepspeed(spec: dict[str, Any], rank: int, world: int, marks: Marks) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with offload_optimizer and offload_param on the CPU."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(spec["dims"], spec["seed"])
    marks("model_built")
    per_rank = spec["global_batch"] // world
    zero: dict[str, Any] = {"stage": 3}
    if spec["options"].get("offload", True):
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    zero.update(spec["options"].get("zero_overrides", {}))
    config = {
        "train_batch_size": spec["global_batch"],
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": spec["lr"],
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": spec["weight_decay"],
            },
        },
        "zero_optimization": zero,
        # DeepSpeed clips the global gradient norm at 1.0 unless told otherwise
        # (GRADIENT_CLIPPING_DEFAULT = 1.0); the other systems do not clip.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    marks("setup_done")
    data = batches(spec["warmup"] + spec["steps"], spec["global_batch"], spec["dims"]["seq"], 1)
    steps = []
    for x, y in data:
        xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
        cpu0 = time.process_time()
        t = [time.perf_counter()]
        loss = lm_loss(engine(xs), ys)
        t.append(time.perf_counter())
        engine.backward(loss)
        t.append(time.perf_counter())
        engine.step()
        t.append(time.perf_counter())
        steps.append(_step_record(t, cpu0, loss))
    zopt = engine.optimizer
    params = list(model.parameters())
    persistent = getattr(zopt, "persistent_parameters", [])
    inner = getattr(zopt, "optimizer", None)
    state = storage_bytes(
        {
            # compute copies of this rank's partitions (views of one flat CPU buffer),
            # plus the parameters DeepSpeed keeps gathered (below its persistence threshold)
            "params": [
                *getattr(zopt, "fp16_partitioned_groups_flat", []),
                *(getattr(p, "ds_tensor", None) for p in params),
                *(p.data for p in persistent),
            ],
            "master_params": getattr(zopt, "fp32_partitioned_groups_flat", []),
            "grads": [
                getattr(zopt, "grad_partitions_flat_buffer", None),
                *(p.grad for p in params),
                *(g.grad for g in getattr(zopt, "fp32_partitioned_groups_flat", [])),
            ],
            "optimizer_state": _opt_state_tensors(inner) if inner is not None else [],
        }
    )
    return {
        "steps": steps,
        "model_state": state,
        "optimizer": type(inner).__name__,
        "persistent_params": len(persistent),
        "deepspeed_version": deepspeed.__version__,
    }


async def _run_ours(spec: dict[str, Any], rank: int, world: int, marks: Marks) -> dict[str, Any]:
    from zero3_offload import (
        OptimizerConfig,
        Zero3CpuOffloadConfig,
        Zero3CpuOffloadManager,
        destroy_process_group,
        init_process_group_from_env,
    )

    opts = dict(spec["options"])
    lr_in_backward = bool(opts.pop("lr_in_backward", False))
    log_dir = opts.pop("log_dir", None)
    if log_dir:
        import zero3_offload.logging as zlog

        zlog.configure(json_path=Path(log_dir) / f"rank{rank}.jsonl", level="info")
    group = await init_process_group_from_env("gloo")
    model = make_model(spec["dims"], spec["seed"])
    names = model.layer_names
    marks("model_built")
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=spec["weight_decay"]), **opts
    )
    lr = spec["lr"]
    data = batches(spec["warmup"] + spec["steps"], spec["global_batch"], spec["dims"]["seq"], 1)
    steps = []
    async with Zero3CpuOffloadManager(config, group, model) as manager:
        marks("setup_done")
        for x, y in data:
            xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
            cpu0 = time.process_time()
            t = [time.perf_counter()]
            out = await manager.forward_pass(xs, names)
            out.requires_grad_()
            loss = lm_loss(out, ys)
            loss.backward()
            t.append(time.perf_counter())
            await manager.backward_pass(
                out.grad, names, learning_rate=lr if lr_in_backward else None
            )
            t.append(time.perf_counter())
            await manager.optimizer_step(lr)
            t.append(time.perf_counter())
            steps.append(_step_record(t, cpu0, loss))
        mem = manager.get_memory_stats()
        perf = manager.get_performance_stats()
    destroy_process_group()
    state = {
        "params": mem.master_param_bytes + mem.compute_copy_bytes,
        "grads": mem.gradient_bytes,
        "optimizer_state": mem.optimizer_state_bytes,
    }
    state["total"] = mem.model_state_bytes()
    return {
        "steps": steps,
        "model_state": state,
        "library_memory_stats": {
            k: getattr(mem, k)
            for k in (
                "master_param_bytes",
                "compute_copy_bytes",
                "gradient_bytes",
                "optimizer_state_bytes",
                "gathered_high_water_bytes",
                "gather_pool_bytes",
                "process_rss_bytes",
            )
        },
        "prefetch_counters": dict(perf.prefetch),
        "config": config.to_dict() if hasattr(config, "to_dict") else repr(config),
    }


def run_ours(spec: dict[str, Any], rank: int, world: int, marks: Marks) -> dict[str, Any]:
    return asyncio.run(_run_ours(spec, rank, world, marks))


SYSTEMS: dict[str, Callable[[dict[str, Any], int, int, Marks], dict[str, Any]]] = {
    "torch": run_torch,
    "fsdp2": run_fsdp2,
    "deepspeed": run_deepspeed,
    "zero3_offload": run_ours,
}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    torch.set_num_threads(spec["threads"])
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    marks = Marks()
    if spec["kind"] == "deepspeed":
        import deepspeed  # noqa: F401  (its import is part of what a rank costs)
    elif spec["kind"] == "zero3_offload":
        import zero3_offload  # noqa: F401
    marks("imported")
    t0 = time.perf_counter()
    result = SYSTEMS[spec["kind"]](spec, rank, world, marks)
    marks("end")
    result.update(
        {
            "rank": rank,
            "world_size": world,
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "run_s": time.perf_counter() - t0,
            "marks": marks.marks,
            "peak_rss_bytes": marks.marks["end"]["hwm_bytes"],
        }
    )
    out = Path(spec["out_dir"]) / f"result-rank{rank}.json"
    out.write_text(json.dumps(result, default=str), encoding="utf-8")
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # DeepSpeed leaves threads behind that abort the interpreter at exit
    # ("terminate called without an active exception"); the result is written.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
