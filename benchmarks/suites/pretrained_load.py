"""Peak memory and wall time of loading a ~350M-parameter transformers Llama on 2 ranks.

The model is saved once as one fp32 model.safetensors in a temporary directory; then each case
runs on 2 fresh processes: zero3_offload's ``Zero3CpuOffloadManager.from_pretrained`` (each rank
reads only its shard's slices), and plain ``AutoModelForCausalLM.from_pretrained`` in each of the
2 processes (what every rank does without the library). Rounds interleave the cases.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

from harness.render import Col
from harness.runner import launch, plan, progress, run_plan, work_directory
from harness.sampler import proc_status
from harness.workload import llama_config

WORLD, SAMPLE_S, SEED = 2, 0.002, 0
FULL = dict(d=1024, ffn=2816, n_layers=24, heads=16, kv_heads=8, vocab=32000)
TINY = dict(d=64, ffn=176, n_layers=2, heads=4, kv_heads=2, vocab=1000)
OURS, PLAIN = "zero3_offload from_pretrained", "transformers from_pretrained (each rank)"
CASES = {OURS: "ours", PLAIN: "plain"}
IMPORTS = ["transformers", "zero3_offload"]  # in every rank before the "imported" mark
TAKES = ["timeout", "keep", "mmap_threshold"]
OPTIONS = {"--workdir": {"type": Path, "help": "where the saved model goes (default: a temp dir)"}}
DEFAULTS = {"repeats": 2, "warmup": 0, "threads": 1, "timeout": 900.0}  # repeats: rounds
QUICK = {"repeats": 1, "timeout": 120.0}
TITLE = (
    "Loading a pretrained Llama ({model[params]:,} parameters, {model[fp32_bytes]:mib1} MiB fp32) "
    "on {config[world_size]} ranks: peak RSS per rank"
)
FIGURES = ("loaded", "rss_loaded", "read", "written", "peak")
# fmt: off
LAYOUT = [([
    Col("case", "case"), Col("rank", "rank", "d"), Col("load s", "load", ".2f", missing="FAILED"),
    Col("peak RSS at load MiB", "loaded", "mib"), Col("RSS at load MiB", "rss_loaded", "mib"),
    Col("peak, weights read MiB", "read", "mib"),
    Col("peak, weights written MiB", "written", "mib"),
    Col("peak RSS MiB", "peak", "mib"),
    Col("/ plain's", "vs_plain", ".2f"), Col("peak - after import MiB", "more", "mib"),
    Col("/ model fp32", "vs_model", ".2f"), Col("/ rank's shard", "vs_shard", ".2f"),
    Col("peak anon MiB", "anon", "mib"), Col("rank's shard MiB", "shard", "mib1"),
    Col("read MiB", "bytes_read", "mib1"),
], "rows")]
# fmt: on


def check(args: Any) -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers (pip install transformers)"
    return "--warmup must be >= 0" if args.warmup < 0 else None


def save(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target: build the Llama (seeded) and save it as fp32 safetensors."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(llama_config(spec["dims"], use_cache=True))
    built = time.perf_counter()
    model.save_pretrained(spec["model_dir"], max_shard_size="100GB")
    files = {p.name: p.stat().st_size for p in sorted(Path(spec["model_dir"]).iterdir())}
    return {"build_s": built - t0, "save_s": time.perf_counter() - built, "files": files}


async def ours(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target (a rank): the manager from the directory, default config (offload on);
    the bytes it read from its ``pretrained_loaded`` log event."""
    import structlog

    import zero3_offload as z

    group = await z.init_process_group_from_env("gloo")
    ctx.mark("group")
    t0 = time.perf_counter()
    with structlog.testing.capture_logs() as logs:
        manager = z.Zero3CpuOffloadManager.from_pretrained(
            z.Zero3CpuOffloadConfig(), group, spec["model_dir"]
        )
    load_s = time.perf_counter() - t0
    ctx.mark("loaded")
    after_load, stats = proc_status(), manager.get_memory_stats()  # RssAnon / RssFile at load
    read = [e["bytes_read"] for e in logs if e["event"] == "pretrained_loaded"]
    await manager.close()
    z.destroy_process_group()
    shard = stats.master_param_bytes + stats.compute_copy_bytes
    out = {
        "load_s": load_s,
        "status_after_load": after_load,
        "bytes_read": read[0] if read else None,
    }
    return {**out, "shard_bytes": shard, "model_state_bytes": stats.model_state_bytes()}


async def generate(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target (a rank): greedy decoding under ZeRO-3, units kept gathered between
    decoding steps within the budget, and gathered at every step; tokens/s of each."""
    import torch

    import zero3_offload as z

    group = await z.init_process_group_from_env("gloo")
    manager = z.Zero3CpuOffloadManager.from_pretrained(
        z.Zero3CpuOffloadConfig(), group, spec["model_dir"]
    )
    prompt, out, tokens = torch.arange(16).view(1, 16), {}, {}
    out["budget_bytes"] = manager.config.gpu_param_memory_budget
    for keep in (True, False, True):  # the first run warms up
        t0 = time.perf_counter()
        ids = await manager.generate(prompt, max_new_tokens=16, do_sample=False, keep_gathered=keep)
        out[f"keep_gathered={keep}"] = 16 / (time.perf_counter() - t0)
        tokens[keep] = ids[0].tolist()
    await manager.close()
    z.destroy_process_group()
    return {**out, "same_tokens": tokens[True] == tokens[False]}


def plain(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target (one of 2 processes): the whole model, as every rank loads it alone;
    then every weight read once and written once in place (marks ``read``, ``written``)."""
    import torch
    from transformers import AutoModelForCausalLM

    ctx.mark("group")  # no group: the same mark as ours, for the table
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"])
    load_s = time.perf_counter() - t0
    ctx.mark("loaded")
    # transformers maps the file: parameters are its (copy-on-write) pages, read on first use.
    params = list(model.parameters())
    with torch.no_grad():
        sum(float(p.sum()) for p in params)  # a forward reads every weight
        ctx.mark("read")
        for p in params:  # the first optimizer step writes every weight
            p.mul_(1.0)
        ctx.mark("written")
    return {"load_s": load_s}


def rows(measured: list[dict[str, dict]], world: int, model_bytes: int) -> list[dict[str, Any]]:
    """Per case and rank: the medians over the measured rounds, and the peak over the plain
    case's, the model's fp32 bytes and the rank's shard."""

    def med(case: str, rank: int, get: Any) -> float | None:
        runs = [c[case]["ranks"][rank] for c in measured if c.get(case, {}).get("ok")]
        values = [v for v in map(get, runs) if v is not None]
        return statistics.median(values) if values else None

    def at(mark: str, key: str = "hwm_bytes") -> Any:
        return lambda r: r["marks"][mark][key] if mark in r["marks"] else None

    marks = dict(
        zip(
            FIGURES,
            (at("loaded"), at("loaded", "rss_bytes"), at("read"), at("written")),
            strict=False,
        )
    )
    get = {**marks, "peak": lambda r: r["peak_rss_bytes"], "imported": at("imported", "rss_bytes")}
    get.update(load=lambda r: r["load_s"], anon=lambda r: r["sampled_peak_bytes"].get("RssAnon"))
    out = []
    for case in CASES:
        for rank in range(world):
            row: dict[str, Any] = {
                "case": case,
                "rank": rank,
                **{k: med(case, rank, g) for k, g in get.items()},
            }
            shard, plain_peak = (
                med(OURS, rank, lambda r: r["shard_bytes"]),
                med(PLAIN, rank, get["peak"]),
            )
            if row["peak"] is not None:
                row["more"] = row["peak"] - row["imported"]
                row.update(
                    vs_plain=plain_peak and row["peak"] / plain_peak,
                    vs_model=row["more"] / model_bytes,
                )
                row["vs_shard"] = shard and row["more"] / shard
            if case == OURS:
                row.update(shard=shard, bytes_read=med(case, rank, lambda r: r.get("bytes_read")))
            out.append({k: v for k, v in row.items() if v or k == "rank"})  # a zero shows "-"
    return out


def run(args: Any) -> dict[str, Any] | None:
    import torch
    import transformers

    dims, n_rounds, started = (
        TINY if args.quick else FULL,
        args.warmup + args.repeats,
        time.perf_counter(),
    )
    with torch.device("meta"):
        params = sum(
            p.numel() for p in transformers.LlamaForCausalLM(llama_config(dims)).parameters()
        )
    progress(f"Llama of {params:,} parameters ({4 * params / 2**20:,.0f} MiB fp32)")
    with work_directory("pretrained-load-", args.keep, args.workdir) as work:
        base = {"dims": dims, "model_dir": str(work / "model"), "threads": args.threads}
        base.update(imports=IMPORTS, mmap_threshold=args.mmap_threshold)
        saved = launch("suites.pretrained_load:save", base, work / "save", torchrun=False)
        if not saved["ok"]:
            progress(f"saving failed: {saved['error']}\n" + "\n".join(saved["log_tails"][0]))
            return None

        def one(e: dict[str, Any]) -> dict[str, Any]:
            case = CASES[e["key"]]
            kw = {"world": WORLD, "timeout_s": args.timeout, "sample_s": SAMPLE_S}
            return launch(
                f"suites.pretrained_load:{case}", base, work / f"round{e['round']}-{case}", **kw
            )

        runs = run_plan(
            plan(list(CASES), n_rounds), one, lambda r: f"load {r['ranks'][0]['load_s']:.1f} s"
        )
        decoded = launch(
            "suites.pretrained_load:generate", base, work / "generate", world=WORLD, timeout_s=900
        )
    if not any(r["ok"] for r in runs):
        return None
    measured = [
        {r["key"]: r for r in runs if r["round"] == i} for i in range(args.warmup, n_rounds)
    ]
    config = {
        "world_size": WORLD,
        "dims": dims,
        "threads_per_rank": args.threads,
        "repeats": args.repeats,
    }
    config.update(
        warmup=args.warmup, sample_ms=SAMPLE_S * 1000, malloc_mmap_threshold=args.mmap_threshold
    )
    config.update(transformers_version=transformers.__version__)
    model = {"params": params, "fp32_bytes": 4 * params, **saved["ranks"][0]}
    first = next((c[OURS]["ranks"][0] for c in measured if c.get(OURS, {}).get("ok")), {})
    name = (
        "pretrained-load"
        + ("-quick" if args.quick else "")
        + ("-mmap" if args.mmap_threshold is not None else "")
    )
    return {
        "benchmark": name,
        "config": config,
        "model": model,
        "rows": rows(measured, WORLD, 4 * params),
        "model_state_bytes": first.get("model_state_bytes"),
        "generate": decoded["ranks"][0] if decoded["ok"] else None,
        "failed": [f"{r['key']} (round {r['round']}): {r['error']}" for r in runs if not r["ok"]],
        "total_wall_s": time.perf_counter() - started,
    }


def notes(p: dict[str, Any]) -> list[str]:
    cfg, model, dims, gen = p["config"], p["model"], p["config"]["dims"], p.get("generate")
    files = ", ".join(f"{n} {size:,} B" for n, size in model["files"].items())
    mmap = cfg["malloc_mmap_threshold"] or "default"
    out = [
        f"model: transformers LlamaForCausalLM, hidden {dims['d']}, MLP {dims['ffn']}, "
        f"{dims['n_layers']} decoder layers, {dims['heads']} heads, {dims['kv_heads']} KV heads, "
        f"vocabulary {dims['vocab']}, untied head: {model['params']:,} parameters, "
        f"{model['fp32_bytes']:,} bytes fp32 ({model['fp32_bytes'] / 2**20:,.1f} MiB); saved once "
        f"(seed {SEED}, built in {model['build_s']:.0f} s, saved in {model['save_s']:.0f} s) as "
        f"{files}, read from the page cache.",
        f"{cfg['world_size']} fresh processes per case, {cfg['threads_per_rank']} torch thread(s) "
        f"each; medians of {cfg['repeats']} round(s) after {cfg['warmup']} unmeasured, cases "
        f"interleaved; glibc mmap threshold {mmap}; peak anon sampled every {cfg['sample_ms']:g} "
        "ms from outside. Cases and columns as docs/benchmarks.md (pretrained-load) defines them.",
    ]
    if ms := p.get("model_state_bytes"):
        out.append(f"{OURS}: model state counted after loading: {ms / 2**20:,.0f} MiB.")
    if gen:
        on, off = gen["keep_gathered=True"], gen["keep_gathered=False"]
        out.append(
            f"generate (rank 0, 2 ranks, the loaded model, default config: budget "
            f"{gen['budget_bytes'] / 2**20:,.0f} MiB): greedy, 16 new tokens after 16, {on:.2f} "
            f"tokens/s with units kept gathered between decoding steps vs {off:.2f} tokens/s "
            f"gathering them at every step ({on / off:.2f}x); same tokens: {gen['same_tokens']}."
        )
    return out + (["FAILED: " + "; ".join(p["failed"])] if p.get("failed") else [])


NOTES = [notes]
