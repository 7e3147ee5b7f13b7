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
from harness.plan import check_timing, time_interleaved
from harness.report import Report, cols, fmt, fmt_rate, markdown_table
from torch.utils._python_dispatch import TorchDispatchMode

LR = 1e-3
FP32_BYTES = torch.empty((), dtype=torch.float32).element_size()  # one "memory pass" per element
TEMPORARY = "temporary (allocated in the step)"
FULL_UPDATE = "ours, full layer update (step + compute-copy refresh)"
FULL_UPDATE_BF16 = "ours, full layer update, compute_dtype=bf16 (step + compute-copy refresh)"

check = check_timing


OPTIONS = {
    "--params": {"type": int, "help": "fp32 parameters in all (100M; quick 2M)"},
    "--layers": {"type": int, "default": 16, "help": "layer shards (16)"},
    "--worker-threads": {"type": int, "default": 2, "help": "WorkerThreads of 'ours, parallel'"},
    "--copy-elements": {"type": int, "help": "fp32 elements of the copy buffers (64M; quick 8M)"},
}
DEFAULTS = {"repeats": 11, "warmup": 2, "params": 100_000_000, "copy_elements": 64 * 2**20}
QUICK, EPILOG = {"repeats": 5, "warmup": 1, "params": 2_000_000, "copy_elements": 8 * 2**20}, None

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

    n = args.params
    gen = torch.Generator().manual_seed(0)
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

        copies = [store.compute_copy(nm) for nm in names]
        aliased = all(
            c.payload.data_ptr() == store.master(nm).data_ptr()
            for c, nm in zip(copies, names, strict=True)
        )
        dtype = str(copies[0].payload.dtype).removeprefix("torch.")
        roles = {  # an aliased compute copy is the master: it stays "param"
            c.payload.untyped_storage().data_ptr(): f"compute copy ({dtype})"
            for c, nm in zip(copies, names, strict=True)
            if c.payload.untyped_storage().data_ptr()
            != store.master(nm).untyped_storage().data_ptr()
        }
        roles |= {
            c.scales.untyped_storage().data_ptr(): "compute copy scales"
            for c in copies
            if c.scales is not None
        }
        info = {
            "compute_dtype": str(config.compute_dtype).removeprefix("torch."),
            "cpu_compression": config.cpu_compression.name.lower(),
            "compute_copy_dtype": dtype,
            "compute_copy_aliases_master": aliased,
            "fused": opt.fused,
            "grad_scale": grad_scale,
        }
        return update, {"opt": opt, "roles": roles, "info": info}

    default_update, default_parts = library_update(Zero3CpuOffloadConfig(optimizer=cfg))
    bf16_update, bf16_parts = library_update(
        Zero3CpuOffloadConfig(optimizer=cfg, compute_dtype=torch.bfloat16)
    )

    def sequential() -> None:
        for name, grad in zip(names, grads, strict=True):
            ours.step(name, grad, LR)

    async def parallel(wrap: Callable = lambda fn: fn) -> None:
        steps = (functools.partial(ours.step, n, g, LR) for n, g in zip(names, grads, strict=True))
        await asyncio.gather(
            *(
                workers.run("cpu-optimizer", n, "step", wrap(s))
                for n, s in zip(names, steps, strict=True)
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
    state = {"ours": ours.state_bytes()}
    for label, parts in ((FULL_UPDATE, default_parts), (FULL_UPDATE_BF16, bf16_parts)):
        state[label] = parts["opt"].state_bytes()
    for kernel_name, opt in torch_opts.items():  # every system keeps its own moments
        tensors = [v for st in opt.state.values() for v in st.values()]
        state[f"torch AdamW {kernel_name}"] = sum(v.numel() * v.element_size() for v in tensors)
    assert min(state.values()) >= 8 * n, f"a system kept no moments: {state}"
    param_bytes = sum(t.numel() * t.element_size() for t in params)
    moved: dict[str, dict[str, Any]] = {}
    for name, tr in traffic.items():
        rows = tr.table()
        read, written = (sum(r[k] for r in rows) for k in ("read_bytes", "written_bytes"))
        on_params = [r for r in rows if r["tensor"] == "param"]
        assert sum(r["read_bytes"] for r in on_params) >= param_bytes, (name, rows)
        assert sum(r["written_bytes"] for r in on_params) >= param_bytes, (name, rows)
        moved[name] = {"rows": rows, "read_bytes": read, "written_bytes": written}
    nbytes = src.numel() * src.element_size()

    def bandwidth(case: str, per_call: int) -> dict[str, Any]:
        """A reference case's bytes moved per second (``per_call`` bytes a call)."""
        rate = per_call / timings[case]["median_s"]
        return {"elements": args.copy_elements, "timing": timings[case], "bytes_per_s": rate}

    copy = {**bandwidth("copy", 2 * nbytes), "bytes_moved_per_copy": 2 * nbytes}
    add = {**bandwidth("add_", 3 * nbytes), "bytes_moved_per_add": 3 * nbytes}
    fused = moved["torch AdamW fused"]
    bound_bytes_per_param = (fused["read_bytes"] + fused["written_bytes"]) / n
    bound = copy["bytes_per_s"] / bound_bytes_per_param
    fused_s = timings["torch AdamW fused"]["median_s"]
    results = []
    for name in systems:
        step_s = timings[name]["median_s"]
        total = moved[name]["read_bytes"] + moved[name]["written_bytes"]
        results.append(
            {
                "system": name,
                "timing": timings[name],
                "params_per_s": n / step_s,
                "ratio_vs_torch_fused": fused_s / step_s,
                "fraction_of_bandwidth_bound": n / step_s / bound,
                "bytes_moved": total,
                "bytes_per_param": total / n,
                "memory_passes": total / (FP32_BYTES * n),
                "achieved_bytes_per_s": total / step_s,
                "fraction_of_copy_bandwidth": total / step_s / copy["bytes_per_s"],
                "fraction_of_add_bandwidth": total / step_s / add["bytes_per_s"],
            }
        )
    config = {
        "params": n,
        "layers": args.layers,
        "shard_sizes": sizes,
        "worker_threads": args.worker_threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "lr": LR,
        "ours_fused": ours.fused,
        "optimizer": {**hyper, "kind": cfg.kind, "amsgrad": cfg.amsgrad},
        "full_layer_update": {
            FULL_UPDATE: default_parts["info"],
            FULL_UPDATE_BF16: bf16_parts["info"],
        },
    }
    seen = sorted({e.worker for e in timeline.events() if e.kind == "cpu-optimizer"})
    return {
        "config": config,
        "copy_bandwidth": copy,
        "inplace_add_bandwidth": add,
        "traffic": moved,
        "bound_bytes_per_param": bound_bytes_per_param,
        "bandwidth_bound_params_per_s": bound,
        "state_bytes": state,
        "results": results,
        "parallel_worker_threads_seen": seen,
    }


def _per_param(nbytes: float, n: int) -> str:
    return fmt(nbytes / n) if nbytes else "0"


def passes_table(payload: dict[str, Any]) -> str:
    """Bytes per parameter each op reads and writes, by tensor; systems with the same
    traffic share one block."""
    n = payload["config"]["params"]
    groups: dict[str, list[str]] = {}
    for name, t in payload["traffic"].items():
        key = repr([(r["op"], r["tensor"], r["read_bytes"], r["written_bytes"]) for r in t["rows"]])
        groups.setdefault(key, []).append(name)
    rows = []
    for members in groups.values():
        t = payload["traffic"][members[0]]
        label = " / ".join(m.split(" (")[0] for m in members)
        for r in t["rows"]:
            read, written = _per_param(r["read_bytes"], n), _per_param(r["written_bytes"], n)
            rows.append([label, r["op"], r["tensor"], read, written])
            label = ""
        total = t["read_bytes"] + t["written_bytes"]
        read, written = _per_param(t["read_bytes"], n), _per_param(t["written_bytes"], n)
        rows.append(["", "**all**", f"**{fmt(total / n)} B/param**", read, written])
    headers = cols("systems; aten op; tensor; read B/param; written B/param")
    return markdown_table(headers, rows)


def report(payload: dict[str, Any]) -> Report:
    cfg, copy = payload["config"], payload["copy_bandwidth"]
    bound, sizes = payload["bandwidth_bound_params_per_s"], cfg["shard_sizes"]
    per = payload["bound_bytes_per_param"]
    rows = []
    for r in payload["results"]:
        step, ratio = f"{r['timing']['median_s']:.4f}", f"{r['ratio_vs_torch_fused']:.2f}x"
        rows.append(
            [
                *(r["system"], step, fmt_rate(r["params_per_s"]), ratio),
                *(f"{r['fraction_of_bandwidth_bound']:.2f}", fmt(r["bytes_per_param"])),
                *(f"{r['memory_passes']:.2f}", fmt(r["achieved_bytes_per_s"] / 1e9)),
                f"{r['fraction_of_copy_bandwidth']:.2f}",
                f"{r['fraction_of_add_bandwidth']:.2f}",
            ]
        )
    copy_gbs = fmt(copy["bytes_per_s"] / 1e9)
    bound_label = f"bandwidth bound (copy / {fmt(per)} B counted for torch fused)"
    add_bw = payload["inplace_add_bandwidth"]["bytes_per_s"]
    bound_add = f"{copy['bytes_per_s'] / add_bw:.2f}"
    rows.append(
        [bound_label, "-", fmt_rate(bound), "-", "1.00", fmt(per), "-", copy_gbs, "1.00", bound_add]
    )
    headers = cols(
        "system; median step s; params/s; ratio vs fused torch; fraction of bandwidth bound; "
        "B/param moved; memory passes; achieved GB/s; fraction of copy bandwidth; "
        "fraction of add_ bandwidth"
    )
    full = cfg["full_layer_update"]
    refresh = "; ".join(
        f"{name.split(' (')[0]}: compute dtype {i['compute_dtype']}, cpu_compression "
        f"{i['cpu_compression']}, compute copy {i['compute_copy_dtype']}"
        + (
            ", the master itself (refresh moves nothing)"
            if i["compute_copy_aliases_master"]
            else ""
        )
        + f", grad scale {i['grad_scale']:g}"
        for name, i in full.items()
    )
    notes = [
        f"{cfg['layers']} shards, {cfg['params']:,} fp32 params (sizes proportional to "
        f"1..{cfg['layers']}: {min(sizes):,} to {max(sizes):,}); median of {cfg['repeats']} "
        f"repeats after {cfg['warmup']} warm-up, cases interleaved.",
        "B/param moved: bytes the step's aten ops read and write, counted from the tensors of "
        "one traced step (numel x element_size; table below); memory passes = B/param / 4 "
        "(fp32 arrays' worth of traffic per parameter); achieved GB/s = counted bytes / median "
        "step time; fraction of copy (add_) bandwidth = achieved / copy (add_) GB/s.",
        f"copy bandwidth {copy_gbs} GB/s (dst.copy_(src), {copy['elements']:,} fp32 elements, "
        f"2 x nbytes counted; median {copy['timing']['median_s'] * 1e3:.1f} ms) -> bound "
        f"{fmt_rate(bound)} params/s at the {fmt(per)} B/param counted for torch fused.",
        f"in-place add_ bandwidth {fmt(add_bw / 1e9)} GB/s (3 x nbytes counted) -> "
        f"{fmt_rate(add_bw / per)} params/s at {fmt(per)} B/param.",
        "ratio vs fused torch = torch-fused step time / system step time (>1 is faster).",
        f"full layer update = per layer what StepRunner.update_layer does (grad scale mul_ "
        f"when not 1, ShardOptimizers.step, ParameterStore.refresh_compute_copy) on a "
        f"ParameterStore built as engine.build_engine builds it, run in turn. {refresh}.",
        f"ours picked fused={cfg['ours_fused']}; 'ours, parallel' ran its steps on "
        f"{len(payload['parallel_worker_threads_seen'])} distinct worker threads.",
    ]
    tables = markdown_table(headers, rows) + "\n\nMemory traffic per step, counted:\n\n"
    return Report("CPU AdamW optimizer step", tables + passes_table(payload), notes)
