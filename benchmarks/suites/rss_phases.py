"""Where a zero3_offload step's resident memory peaks: per phase, and per layer of the backward.

A diagnostic: RSS sampled every 2 ms on 2 gloo ranks in several configurations, and at the start
of each layer's last backward RSS next to the bytes the library counts.
"""

from __future__ import annotations

from typing import Any

from harness import train
from harness.report import Report, markdown_table, mib
from harness.sampler import Sampler, proc_status
from harness.systems import System

TUNED = {"lr_in_backward": True, "prefetch_buffer_size": 1}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "lr-in-backward": {"lr_in_backward": True},
    "lr-in-backward+depth1": TUNED,
    "ckpt+lr-in-backward+depth1": {**TUNED, "activation_checkpointing": True},
}


OPTIONS = {
    "--blocks": {"type": int, "default": 8, "help": "transformer blocks (8; 24 = the 303M model)"},
    "--configs": {"default": ",".join(CONFIGS), "help": f"subset of {', '.join(CONFIGS)}"},
}
DEFAULTS = dict(repeats=3, warmup=0, threads=1, rounds=1, seed=0, timeout=3600)
DEFAULTS["mmap_threshold"] = 2**20  # glibc's threshold as `zero3-offload train` sets it
EPILOG = "--repeats: training steps (3); the trace is of the last one's backward"


def check(args: Any) -> str | None:
    args.warmup, args.repeats = 0, args.warmup + args.repeats  # every step is sampled
    args.config_list = args.configs.split(",")
    if unknown := [c for c in args.config_list if c not in CONFIGS]:
        return f"unknown configs {unknown}"
    return "--blocks must be >= 1" if args.blocks < 1 else None


class Hooks:
    """RSS sampled every 2 ms per phase, and a trace at each layer's start in the last backward."""

    def __init__(self, spec: dict[str, Any], rank: Any) -> None:
        self.sampler, self.last, self.trace = Sampler(interval_s=0.002), spec["steps"] - 1, []
        self.sampler.phase = "setup"

    def setup(self, system: Any) -> None:
        manager = system.manager
        prepare = manager.engine.reducer.prepare

        async def traced(layer: str, module: Any) -> Any:  # before the layer's gradient buffer
            if self.sampler.phase == f"backward {self.last}":
                st = manager.get_memory_stats()
                self.trace.append(
                    {
                        "layer": layer,
                        "rss": proc_status()["VmRSS"],
                        "activations": st.activation_bytes,
                        "gathered": st.gathered_param_bytes,
                        "in flight": st.inflight_param_bytes,
                        "pool": st.gather_pool_bytes,
                        "grad shards": st.gradient_bytes,
                        "state": st.model_state_bytes() - st.gradient_bytes,
                    }
                )
            return await prepare(layer, module)

        manager.engine.reducer.prepare = traced

    async def end(self, system: Any, result: dict[str, Any]) -> None:
        self.sampler.phase = "after"
        stats = system.manager.get_memory_stats()
        peaks = {k: v["VmRSS"] for k, v in self.sampler.stop().peaks.items()}
        result.update(peaks=peaks, trace=self.trace, gradient_buffers=stats.gradient_buffer_bytes)


def run(args: Any) -> dict[str, Any] | None:
    dims = dict(d=1024, heads=16, n_layers=args.blocks, seq=128, global_batch=8)
    if args.quick:
        dims.update(d=128, heads=4, n_layers=2, seq=32)
    systems = {name: System(name, "zero3_offload", 2, CONFIGS[name]) for name in args.config_list}
    hooks = {"hooks": "suites.rss_phases:Hooks"}
    result = train.compare(args, systems, dims, threads=dict.fromkeys(systems, 1), spec=hooks)
    if result["skipped"]:  # a run failed
        return None
    result["config"].update(ranks=2, malloc_mmap_threshold=args.mmap_threshold)
    name = "rss-phases-quick" if args.quick else f"rss-phases-{args.blocks}blocks"
    return {"benchmark": name, **result}


def report(payload: dict[str, Any]) -> Report:
    parts = []
    for r in payload["runs"]:
        rank0, buffers = r["ranks"][0], r["ranks"][0]["gradient_buffers"]
        peaks = ", ".join(f"{phase} {mib(peak)}" for phase, peak in rank0["peaks"].items())
        parts.append(
            f"{r['key']} ({r['wall_s']:.0f} s): peak RSS MiB per phase: {peaks}; model state "
            f"{mib(rank0['model_state']['total'])} MiB; flat gradient buffers {mib(buffers)} MiB."
        )
        if rank0["trace"]:
            keys = [k for k in rank0["trace"][0] if k not in ("layer", "rss")]
            rows = []
            for row in rank0["trace"]:
                uncounted = row["rss"] - sum(row[k] for k in keys) - buffers
                rows.append([row["layer"], *(mib(row[k]) for k in ["rss", *keys]), mib(uncounted)])
            headers = ["layer", "RSS", *keys, "RSS - counted - grad buffers"]
            parts.append(markdown_table(headers, rows))
    dims = payload["config"]["dims"]
    notes = [
        f"GPT d={dims['d']}, {dims['heads']} heads, {dims['n_layers']} blocks, seq {dims['seq']}, "
        f"global batch {dims['global_batch']}; 2 gloo ranks x 1 thread, "
        f"MALLOC_MMAP_THRESHOLD_={payload['config']['malloc_mmap_threshold']}; rank 0's figures; "
        f"{payload['config']['steps']} steps. Phases, trace and the last column as "
        "docs/benchmarks.md (rss-phases) describes them."
    ]
    return Report("RSS by phase (zero3_offload, rank 0)", "\n\n".join(parts), notes)
