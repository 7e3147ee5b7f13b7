"""CPU AdamW step throughput and memory traffic: ShardOptimizers and the library's full layer
update vs torch's AdamW.

Interleaved over the same 16 unequal shards, with ``copy_`` and ``add_`` as bandwidth references.
The bytes each system reads and writes per step are counted from the tensors of every aten op
one traced step runs (``numel * element_size``), not assumed.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from harness.render import Col, fmt
from harness.sampler import check_timing, time_interleaved
from torch.utils._python_dispatch import TorchDispatchMode

LR = 1e-3
FP32_BYTES = torch.empty((), dtype=torch.float32).element_size()  # one "memory pass" per element
TEMPORARY = "temporary (allocated in the step)"
FULL_UPDATE = "ours, full layer update (step + compute-copy refresh)"
FULL_UPDATE_BF16 = "ours, full layer update, compute_dtype=bf16 (step + compute-copy refresh)"
check = check_timing
OPTIONS = {
    "--params": {"type": int, "help": "fp32 parameters in all"},
    "--layers": {"type": int, "default": 16, "help": "layer shards"},
    "--worker-threads": {"type": int, "default": 2, "help": "WorkerThreads of 'ours, parallel'"},
    "--copy-elements": {"type": int, "help": "fp32 elements of the copy buffers"},
}
DEFAULTS = {"repeats": 11, "warmup": 2, "params": 100_000_000, "copy_elements": 64 * 2**20}
QUICK = {"repeats": 5, "warmup": 1, "params": 2_000_000, "copy_elements": 8 * 2**20}
TITLE = "CPU AdamW optimizer step"
# fmt: off
MAIN = [
    Col("system", "system"), Col("median step s", "median_s", ".4f"),
    Col("params/s", "params_per_s", "rate"), Col("ratio vs fused torch", "{ratio:.2f}x"),
    Col("fraction of bandwidth bound", "bound", ".2f"), Col("B/param moved", "per_param", "sig"),
    Col("memory passes", "passes", ".2f"), Col("achieved GB/s", "achieved", "gb"),
    Col("fraction of copy bandwidth", "copy", ".2f"),
    Col("fraction of add_ bandwidth", "add", ".2f"),
]
PASSES = [Col("systems", "0"), Col("aten op", "1"), Col("tensor", "2"), Col("read B/param", "3"),
          Col("written B/param", "4")]
# fmt: on


def refresh_note(p: dict[str, Any]) -> str:
    parts = []
    for name, i in p["config"]["full_layer_update"].items():
        parts.append(
            f"{name.split(' (')[0]}: compute dtype {i['compute_dtype']}, cpu_compression "
            f"{i['cpu_compression']}, compute copy {i['compute_copy_dtype']}"
            + (
                ", the master itself (refresh moves nothing)"
                if i["compute_copy_aliases_master"]
                else ""
            )
            + f", grad scale {i['grad_scale']:g}"
        )
    return (
        "full layer update = per layer what StepRunner.update_layer does (grad scale mul_ when "
        "not 1, ShardOptimizers.step, ParameterStore.refresh_compute_copy) on a ParameterStore "
        f"built as engine.build_engine builds it, run in turn. {'; '.join(parts)}."
    )


NOTES = [
    "{config[layers]} shards, {config[params]:,} fp32 params (sizes proportional to "
    "1..{config[layers]}: {config[smallest]:,} to {config[largest]:,}); median of "
    "{config[repeats]} repeats after {config[warmup]} warm-up, cases interleaved.",
    "copy bandwidth {copy[gbs]:sig} GB/s (dst.copy_(src), {copy[elements]:,} fp32 elements, 2 x "
    "nbytes counted; median {copy[ms]:.1f} ms) -> bound {bound:rate} params/s at the {per:sig} "
    "B/param counted for torch fused.",
    "in-place add_ bandwidth {add[gbs]:sig} GB/s (3 x nbytes counted) -> {add[params_per_s]:rate} "
    "params/s at {per:sig} B/param.",
    refresh_note,
    "ours picked fused={config[ours_fused]}; 'ours, parallel' ran its steps on {workers_seen} "
    "distinct worker threads.",
]


# Schema arguments marked mutable that a kernel writes only when another argument is given:
# torch's fused Adam(W) kernels store the gradient back only to unscale it by ``grad_scale``
# (aten/src/ATen/native/cpu/FusedAdamKernel.cpp); otherwise they only read it.
_WRITTEN_ONLY_WITH = {
    ("_fused_adamw_", "grads"): "grad_scale",
    ("_fused_adam_", "grads"): "grad_scale",
}
# In-place ops that overwrite their mutable argument without reading it.
_OVERWRITES = {"copy_", "_foreach_copy_", "fill_", "zero_", "_foreach_zero_"}


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _key(t: torch.Tensor) -> tuple[int, int, int]:
    return t.data_ptr(), t.numel(), t.element_size()


class Traffic:
    """Bytes read and written by every aten op run under :meth:`wrap`, by op and tensor.

    Each op reads each distinct tensor argument once (an in-place op's target too; a
    tensor passed twice, as in ``addcmul_(v, g, g)``, once) and writes the arguments its
    schema marks mutable (``Tensor(a!)``) and the tensors it returns that alias no input.
    Views (ops returning aliases and writing nothing) move nothing. A tensor is named by
    ``roles`` (storage address -> name), else it is a temporary the step allocated.
    """

    def __init__(self, roles: Mapping[int, str]) -> None:
        self.roles = dict(roles)
        self.rows: dict[tuple[str, str], list[int]] = {}  # (op, tensor) -> [read, written]
        self._lock = threading.Lock()

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` traced in the thread that runs it (dispatch modes are per thread)."""

        def traced() -> Any:
            with _TrafficMode(self):
                return fn()

        return traced

    def role(self, t: torch.Tensor) -> str:
        return self.roles.get(t.untyped_storage().data_ptr(), TEMPORARY)

    def record(self, func: Any, args: tuple, kwargs: dict, out: object) -> None:
        schema = func._schema
        name = schema.name.split("::")[-1]
        op = f"{name}.{schema.overload_name}" if schema.overload_name else name
        bound = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
        reads: dict[tuple, torch.Tensor] = {}
        writes: dict[tuple, torch.Tensor] = {}
        for arg in schema.arguments:
            tensors = _tensors(bound.get(arg.name))
            written = arg.alias_info is not None and arg.alias_info.is_write
            given = _WRITTEN_ONLY_WITH.get((name, arg.name))
            if written and given is not None and bound.get(given) is None:
                written = False
            read = not (written and (arg.is_out or name in _OVERWRITES))
            for t in tensors:
                if read:
                    reads[_key(t)] = t
                if written:
                    writes[_key(t)] = t
        if not writes and schema.returns and all(r.alias_info for r in schema.returns):
            return  # a view: no data moves
        inputs = {t.untyped_storage().data_ptr() for t in (*reads.values(), *writes.values())}
        for t in _tensors(out):
            if t.untyped_storage().data_ptr() not in inputs:
                writes[_key(t)] = t
        with self._lock:
            for tensors, column in ((reads, 0), (writes, 1)):
                for t in tensors.values():
                    row = self.rows.setdefault((op, self.role(t)), [0, 0])
                    row[column] += t.numel() * t.element_size()

    def table(self) -> list[dict[str, Any]]:
        """``{"op", "tensor", "read_bytes", "written_bytes"}`` in the order first seen."""
        return [
            {"op": op, "tensor": tensor, "read_bytes": r, "written_bytes": w}
            for (op, tensor), (r, w) in self.rows.items()
        ]


class _TrafficMode(TorchDispatchMode):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.traffic.record(func, args, kwargs, out)
        return out


def _state_roles(states: Iterable[Mapping[str, Any]]) -> dict[int, str]:
    """Storage address -> state name (``exp_avg``, ``step``, ...) of optimizer state tensors."""
    return {
        v.untyped_storage().data_ptr(): key
        for state in states
        for key, v in state.items()
        if torch.is_tensor(v)
    }


def run(args: Any) -> dict[str, Any]:
    from zero3_offload.comm.worker_threads import WorkerThreads
    from zero3_offload.config import OptimizerConfig, Zero3CpuOffloadConfig
    from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
    from zero3_offload.parameter.codec import ShardCodec
    from zero3_offload.parameter.store import ParameterStore
    from zero3_offload.stats.timeline import Timeline

    n, gen = args.params, torch.Generator().manual_seed(0)
    weights = args.layers * (args.layers + 1) // 2  # shard sizes proportional to 1..layers
    sizes = [n * (i + 1) // weights for i in range(args.layers)]
    sizes[-1] += n - sum(sizes)
    names = [f"layer{i:02d}" for i in range(args.layers)]
    params = [torch.randn(k, generator=gen).mul_(0.02) for k in sizes]
    grads = [torch.randn(k, generator=gen).mul_(1e-3) for k in sizes]
    src, dst = torch.randn(args.copy_elements, generator=gen), torch.empty(args.copy_elements)
    cfg = OptimizerConfig(kind="adamw")
    ours = ShardOptimizers(cfg, zip(names, params, strict=True), device=torch.device("cpu"))
    hyper = {"lr": LR, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    torch_opts = {
        kernel: torch.optim.AdamW(params, amsgrad=cfg.amsgrad, **hyper, **{kernel: True})
        for kernel in ("fused", "foreach")
    }
    loop, timeline = asyncio.new_event_loop(), Timeline()

    async def make_workers() -> WorkerThreads:  # made inside the loop that runs them
        return WorkerThreads(threads=args.worker_threads, timeline=timeline)

    workers = loop.run_until_complete(make_workers())

    def library_update(config: Zero3CpuOffloadConfig) -> tuple[Callable[[], None], dict]:
        """A ParameterStore and ShardOptimizers built as ``engine.build_engine`` does (CPU device),
        and a step doing per layer what ``StepRunner.update_layer`` does."""
        device, cpu = torch.device(config.device), torch.device("cpu")
        codec = ShardCodec(
            config.cpu_compression, config.compute_dtype, block_size=config.compression_block_size
        )
        store = ParameterStore(
            codec=codec,
            master_device=cpu if config.offload_optimizer_states else device,
            copy_device=cpu if config.offload_params else device,
            pin=config.pin_cpu_memory and device.type == "cuda",
        )
        for name, param in zip(names, params, strict=True):
            store.put_master(name, param)  # the master is ``param`` itself (fp32, on the CPU)
        opt = ShardOptimizers(
            config.optimizer, [(nm, store.master(nm)) for nm in names], device=store.master_device
        )
        grad_scale = 1.0 / config.gradient_accumulation_steps  # as land_and_update passes it

        def update() -> None:
            for name, grad in zip(names, grads, strict=True):
                if grad_scale != 1.0:
                    grad.mul_(grad_scale)
                opt.step(name, grad, LR)
                store.refresh_compute_copy(name)

        copies = {nm: store.compute_copy(nm) for nm in names}
        ptr = {nm: store.master(nm).untyped_storage().data_ptr() for nm in names}
        dtype = str(copies[names[0]].payload.dtype).removeprefix("torch.")
        roles = {  # an aliased compute copy is the master: it stays "param"
            c.payload.untyped_storage().data_ptr(): f"compute copy ({dtype})"
            for nm, c in copies.items()
            if c.payload.untyped_storage().data_ptr() != ptr[nm]
        }
        roles |= {
            c.scales.untyped_storage().data_ptr(): "compute copy scales"
            for c in copies.values()
            if c.scales is not None
        }
        info = {
            "compute_dtype": str(config.compute_dtype).removeprefix("torch."),
            "compute_copy_dtype": dtype,
        }
        info.update(cpu_compression=config.cpu_compression.name.lower(), grad_scale=grad_scale)
        info["compute_copy_aliases_master"] = all(
            c.payload.data_ptr() == store.master(nm).data_ptr() for nm, c in copies.items()
        )
        return update, {"opt": opt, "roles": roles, "info": info}

    default_update, default_parts = library_update(Zero3CpuOffloadConfig(optimizer=cfg))
    bf16_config = Zero3CpuOffloadConfig(optimizer=cfg, compute_dtype=torch.bfloat16)
    bf16_update, bf16_parts = library_update(bf16_config)

    def sequential() -> None:
        for name, grad in zip(names, grads, strict=True):
            ours.step(name, grad, LR)

    async def parallel(wrap: Callable = lambda fn: fn) -> None:
        steps = [
            functools.partial(ours.step, nm, g, LR) for nm, g in zip(names, grads, strict=True)
        ]
        await asyncio.gather(
            *(
                workers.run("cpu-optimizer", nm, "step", wrap(s))
                for nm, s in zip(names, steps, strict=True)
            )
        )

    def torch_step(opt: torch.optim.Optimizer) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    kernel = "fused" if ours.fused else "foreach"
    parallel_label = f"ours, parallel ({kernel}, WorkerThreads {args.worker_threads} threads)"
    systems = {
        f"ours, sequential ({kernel})": sequential,
        parallel_label: lambda: loop.run_until_complete(parallel()),
        FULL_UPDATE: default_update,
        FULL_UPDATE_BF16: bf16_update,
        "torch AdamW fused": functools.partial(torch_step, torch_opts["fused"]),
        "torch AdamW foreach": functools.partial(torch_step, torch_opts["foreach"]),
    }
    grad_sums = [g.sum(dtype=torch.float64).item() for g in grads]
    try:
        for fn in systems.values():  # one step each first: the optimizer state exists after it
            fn()
        # What each system's step reads and writes, from one traced step on the real tensors.
        roles = {t.untyped_storage().data_ptr(): "param" for t in params}
        roles |= {t.untyped_storage().data_ptr(): "grad" for t in grads}
        for opt in (ours, default_parts["opt"], bf16_parts["opt"]):
            roles |= _state_roles(opt.layer_state(nm) for nm in names)
        for opt in torch_opts.values():
            roles |= _state_roles(opt.state.values())
        roles |= default_parts["roles"] | bf16_parts["roles"]
        traffic: dict[str, Traffic] = {}
        for name, fn in systems.items():
            traffic[name] = Traffic(roles)
            if name == parallel_label:  # traced in the worker threads that run the steps
                loop.run_until_complete(parallel(traffic[name].wrap))
            else:
                traffic[name].wrap(fn)()
        cases = {"copy": lambda: dst.copy_(src), "add_": lambda: dst.add_(src), **systems}
        timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)
    finally:
        loop.close()
    # the counts have every system only read the gradients: they must come out unchanged
    assert grad_sums == [g.sum(dtype=torch.float64).item() for g in grads], "a step wrote grads"
    param_bytes = sum(t.numel() * t.element_size() for t in params)
    moved = {}
    for name, tr in traffic.items():
        rows = tr.table()
        for column in ("read_bytes", "written_bytes"):  # every system reads and writes every param
            assert sum(r[column] for r in rows if r["tensor"] == "param") >= param_bytes, (
                name,
                rows,
            )
        moved[name] = {
            "rows": rows,
            **{k: sum(r[k] for r in rows) for k in ("read_bytes", "written_bytes")},
        }
    nbytes = src.numel() * src.element_size()
    config = {"params": n, "layers": args.layers, "shard_sizes": sizes, "repeats": args.repeats}
    config.update(warmup=args.warmup, worker_threads=args.worker_threads, ours_fused=ours.fused)
    config["full_layer_update"] = {
        FULL_UPDATE: default_parts["info"],
        FULL_UPDATE_BF16: bf16_parts["info"],
    }
    raw = {"config": config, "traffic": moved, "timings": timings, "systems": list(systems)}
    raw["workers_seen"] = len({e.worker for e in timeline.events() if e.kind == "cpu-optimizer"})
    raw.update(copy_bytes=2 * nbytes, add_bytes=3 * nbytes, copy_elements=args.copy_elements)
    return summarize(raw)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Each system's step against torch fused, the bandwidth bound and the copy and add_
    references; the traffic of systems that move the same bytes, grouped."""
    cfg, timings, moved, n = raw["config"], raw["timings"], raw["traffic"], raw["config"]["params"]
    copy, add = (
        raw["copy_bytes"] / timings["copy"]["median_s"],
        raw["add_bytes"] / timings["add_"]["median_s"],
    )
    fused = moved["torch AdamW fused"]
    per = (fused["read_bytes"] + fused["written_bytes"]) / n
    bound, fused_s, rows = copy / per, timings["torch AdamW fused"]["median_s"], []
    for name in raw["systems"]:
        step, total = (
            timings[name]["median_s"],
            moved[name]["read_bytes"] + moved[name]["written_bytes"],
        )
        rows.append(
            {"system": name, "median_s": step, "params_per_s": n / step, "ratio": fused_s / step}
        )
        rows[-1].update(
            bound=n / step / bound, per_param=total / n, passes=total / (FP32_BYTES * n)
        )
        rows[-1].update(achieved=total / step, copy=total / step / copy, add=total / step / add)
    label = f"bandwidth bound (copy / {fmt(per)} B counted for torch fused)"
    rows.append(
        {"system": label, "params_per_s": bound, "bound": 1.0, "per_param": per, "achieved": copy}
    )
    rows[-1].update(copy=1.0, add=copy / add)
    groups: dict[str, dict[str, Any]] = {}
    for name, t in moved.items():
        key = repr([(r["op"], r["tensor"], r["read_bytes"], r["written_bytes"]) for r in t["rows"]])
        groups.setdefault(key, {**t, "systems": []})["systems"].append(name)
    config = {k: v for k, v in cfg.items() if k != "shard_sizes"}
    config.update(smallest=min(cfg["shard_sizes"]), largest=max(cfg["shard_sizes"]))
    copies = {
        "gbs": copy / 1e9,
        "elements": raw["copy_elements"],
        "ms": timings["copy"]["median_s"] * 1e3,
    }
    out = {"config": config, "rows": rows, "traffic": list(groups.values()), "copy": copies}
    return {
        **out,
        "add": {"gbs": add / 1e9, "params_per_s": add / per},
        "bound": bound,
        "per": per,
        "workers_seen": raw["workers_seen"],
    }


def layout(p: dict[str, Any]) -> list:
    n = p["config"]["params"]

    def per(nbytes: float) -> str:
        return fmt(nbytes / n) if nbytes else "0"

    rows = []
    for group in p["traffic"]:
        label = " / ".join(m.split(" (")[0] for m in group["systems"])
        for r in group["rows"]:
            rows.append(
                [label, r["op"], r["tensor"], per(r["read_bytes"]), per(r["written_bytes"])]
            )
            label = ""
        total = group["read_bytes"] + group["written_bytes"]
        rows.append(
            [
                "",
                "**all**",
                f"**{fmt(total / n)} B/param**",
                per(group["read_bytes"]),
                per(group["written_bytes"]),
            ]
        )
    rows = [dict(zip("01234", r, strict=True)) for r in rows]
    return [(MAIN, p["rows"]), "Memory traffic per step, counted:", (PASSES, rows)]
