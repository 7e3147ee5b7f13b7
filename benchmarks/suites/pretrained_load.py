"""Peak memory and wall time of loading a ~350M-parameter transformers Llama on 2 ranks.

Zero3CpuOffloadManager.from_pretrained vs AutoModelForCausalLM.from_pretrained per process."""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import structlog
import torch
from harness import workload
from harness.render import Col
from harness.runner import cases, progress, work_directory
from harness.workload import llama_config

import zero3_offload as z

WORLD, SAMPLE_S, SEED = 2, 0.002, 0
FULL = dict(d=1024, ffn=2816, n_layers=24, heads=16, kv_heads=8, vocab=32000)
TINY = dict(d=64, ffn=176, n_layers=2, heads=4, kv_heads=2, vocab=1000)
OURS, PLAIN = "zero3_offload from_pretrained", "transformers from_pretrained (each rank)"
CASES = {OURS: "ours", PLAIN: "plain"}
save = workload.save  # the launcher's target: the model saved once
TAKES = ["timeout", "keep", "mmap_threshold"]
OPTIONS = {"--workdir": {"type": Path, "help": "where the saved model goes (default: a temp dir)"}}
DEFAULTS = {"repeats": 2, "warmup": 0, "threads": 1, "timeout": 900.0}  # repeats: rounds
QUICK = {"repeats": 1, "timeout": 120.0}
TITLE = (
    "Loading a pretrained Llama ({model[params]:,} parameters, {model[fp32_bytes]:mib1} MiB fp32) "
    "on {config[world_size]} ranks: peak RSS per rank"
)
# fmt: off
LAYOUT = [([
    Col("case", "case"), Col("rank", "rank", "d"), Col("load s", "load", ".2f", missing="FAILED"),
    Col("peak RSS at load MiB", "loaded", "mib"), Col("RSS at load MiB", "rss_loaded", "mib"),
    Col("peak, weights read MiB", "read", "mib"),
    Col("peak, weights written MiB", "written", "mib"), Col("peak RSS MiB", "peak", "mib"),
    Col("/ plain's", "vs_plain", ".2f"), Col("peak - after import MiB", "more", "mib"),
    Col("/ model fp32", "vs_model", ".2f"), Col("/ rank's shard", "vs_shard", ".2f"),
    Col("peak anon MiB", "anon", "mib"), Col("rank's shard MiB", "shard", "mib1"),
    Col("read MiB", "bytes_read", "mib1"),
], "rows")]
# fmt: on


def check(args: Any) -> str | None:
    return None if importlib.util.find_spec("transformers") else "needs transformers (pip install)"


async def ours(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: the manager from the directory (default config); what it read and holds."""
    group, t0 = await z.init_process_group_from_env("gloo"), time.perf_counter()
    with structlog.testing.capture_logs() as logs:
        config, path = z.Zero3CpuOffloadConfig(), spec["model_dir"]
        manager = z.Zero3CpuOffloadManager.from_pretrained(config, group, path)
    load_s = time.perf_counter() - t0
    ctx.mark("loaded")
    stats = manager.get_memory_stats()
    await manager.close()
    z.destroy_process_group()
    read = next(e["bytes_read"] for e in logs if e["event"] == "pretrained_loaded")
    out = {"load_s": load_s, "bytes_read": read, "model_state_bytes": stats.model_state_bytes()}
    return {**out, "shard_bytes": stats.master_param_bytes + stats.compute_copy_bytes}


def plain(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: transformers' load, then every weight read once and written once in place."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"])
    load_s = time.perf_counter() - t0
    ctx.mark("loaded")
    # transformers maps the file: parameters are its (copy-on-write) pages, read on first use.
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())  # a forward reads every weight
        ctx.mark("read")
        for p in model.parameters():  # the first optimizer step writes every weight
            p.mul_(1.0)
        ctx.mark("written")
    return {"load_s": load_s}


def at(mark: str, key: str = "hwm_bytes") -> Any:
    return lambda r: r["marks"][mark][key] if mark in r["marks"] else None


FIGURES = {"loaded": at("loaded"), "rss_loaded": at("loaded", "rss_bytes"), "read": at("read")}
FIGURES.update(written=at("written"), peak=at("end"), imported=at("imported", "rss_bytes"))
FIGURES.update(load=lambda r: r["load_s"], anon=lambda r: r["sampled_peak_bytes"].get("RssAnon"))
FIGURES.update(shard=lambda r: r.get("shard_bytes"), bytes_read=lambda r: r.get("bytes_read"))


def rows(measured: list[dict[str, dict]], model_bytes: int) -> list[dict[str, Any]]:
    """Per case and rank: the medians over the rounds, and the peak against plain, model, shard."""

    def med(case: str, rank: int, get: Any) -> float | None:
        runs = [c[case]["ranks"][rank] for c in measured if c.get(case, {}).get("ok")]
        values = [v for v in map(get, runs) if v is not None]
        return statistics.median(values) if values else None

    out = []
    for case, rank in ((case, rank) for case in CASES for rank in range(WORLD)):
        row = {"case": case, "rank": rank, **{k: med(case, rank, g) for k, g in FIGURES.items()}}
        shard, plain = med(OURS, rank, FIGURES["shard"]), med(PLAIN, rank, FIGURES["peak"])
        if row["peak"] is not None:
            row["more"] = row["peak"] - row["imported"]
            row.update(vs_plain=plain and row["peak"] / plain, vs_model=row["more"] / model_bytes)
            row["vs_shard"] = shard and row["more"] / shard
        out.append({k: v for k, v in row.items() if v or k == "rank"})  # a zero shows "-"
    return out


def run(args: Any) -> dict[str, Any] | None:
    import transformers

    dims, started = TINY if args.quick else FULL, time.time()
    with torch.device("meta"):
        params = transformers.LlamaForCausalLM(llama_config(dims)).num_parameters()
    progress(f"Llama of {params:,} parameters ({4 * params / 2**20:,.0f} MiB fp32)")
    with work_directory("pretrained-load-", args.keep, args.workdir) as work:
        spec = {"dims": dims, "model_dir": str(work / "model"), "threads": args.threads}
        spec["seed"] = SEED
        spec.update(imports=["transformers", "zero3_offload"], mmap_threshold=args.mmap_threshold)
        kw = {"save": {"torchrun": False}, "case": {"world": WORLD, "timeout_s": args.timeout}}
        kw["case"]["sample_s"] = SAMPLE_S
        saved, runs, measured = cases(__name__, CASES, spec, work, args, **kw)
    if not any(r["ok"] for r in runs):
        return None
    config = {"world_size": WORLD, "dims": dims, "threads_per_rank": args.threads}
    config.update(repeats=args.repeats, warmup=args.warmup, sample_ms=SAMPLE_S * 1000)
    config["malloc_mmap_threshold"] = args.mmap_threshold
    config["transformers_version"] = transformers.__version__
    first = next((c[OURS]["ranks"][0] for c in measured if c.get(OURS, {}).get("ok")), {})
    out = {"config": config, "model": {"params": params, "fp32_bytes": 4 * params}}
    out["model"].update(saved["ranks"][0])
    out.update(rows=rows(measured, 4 * params), model_state_bytes=first.get("model_state_bytes"))
    out["failed"] = [f"{r['key']} (round {r['round']}): {r['error']}" for r in runs if not r["ok"]]
    return {**out, "total_wall_s": time.time() - started}


def model_note(p: dict[str, Any]) -> str:
    model, dims = p["model"], p["config"]["dims"]
    files = ", ".join(f"{n} {size:,} B" for n, size in model["files"].items())
    return (
        f"model: transformers LlamaForCausalLM, hidden {dims['d']}, MLP {dims['ffn']}, "
        f"{dims['n_layers']} decoder layers, {dims['heads']} heads, {dims['kv_heads']} KV heads, "
        f"vocabulary {dims['vocab']}, untied head: {model['params']:,} parameters, "
        f"{model['fp32_bytes']:,} bytes fp32 ({model['fp32_bytes'] / 2**20:,.1f} MiB); saved once "
        f"(seed {SEED}, built in {model['build_s']:.0f} s, saved in {model['save_s']:.0f} s) as "
        f"{files}, read from the page cache."
    )


NOTES = [
    model_note,
    "{config[world_size]} fresh processes per case, {config[threads_per_rank]} torch thread(s) "
    "each; medians of {config[repeats]} round(s) after {config[warmup]} unmeasured, cases "
    "interleaved; glibc mmap threshold {config[malloc_mmap_threshold]:or_default}; peak anon "
    "sampled every {config[sample_ms]:g} ms from outside. Cases and columns as "
    "docs/benchmarks.md (pretrained-load) defines them.",
    OURS + ": model state counted after loading: {model_state_bytes:mib} MiB.",
    lambda p: "FAILED: " + "; ".join(p["failed"]) if p["failed"] else None,
]
