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

from harness import train
from harness.launcher import launch, work_directory
from harness.plan import plan, progress, run_plan
from harness.report import Report, cols, markdown_table, mib
from harness.sampler import proc_status
from harness.workload import llama_config

WORLD, SAMPLE_S, SEED = 2, 0.002, 0
FULL = dict(d=1024, ffn=2816, n_layers=24, heads=16, kv_heads=8, vocab=32000)
TINY = dict(d=64, ffn=176, n_layers=2, heads=4, kv_heads=2, vocab=1000)
OURS, PLAIN = "zero3_offload from_pretrained", "transformers from_pretrained (each rank)"
CASES = {OURS: "ours", PLAIN: "plain"}
IMPORTS = ["transformers", "zero3_offload"]  # in every rank before the "imported" mark

OPTIONS = {
    "--workdir": {"type": Path, "help": "where the saved model goes (default: the temp dir)"},
    "--timeout": {"type": float, "help": "seconds per run (900; quick 120)"},
    **train.RANK_OPTIONS,
}
DEFAULTS = {"repeats": 2, "warmup": 0, "threads": 1, "timeout": 900.0}
QUICK = {"repeats": 1, "timeout": 120.0}
EPILOG = "--repeats/--warmup: measured/unmeasured rounds of both cases (2/0); --threads: per rank"


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
    numel = sum(p.numel() for p in model.parameters())
    files = {p.name: p.stat().st_size for p in sorted(Path(spec["model_dir"]).iterdir())}
    return {
        "params": numel,
        "build_s": built - t0,
        "save_s": time.perf_counter() - built,
        "files": files,
    }


async def ours(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target (a rank): the manager from the directory, default config (offload on)."""
    import attrs
    import structlog

    import zero3_offload as z

    group = await z.init_process_group_from_env("gloo")
    config = z.Zero3CpuOffloadConfig()
    ctx.mark("group")
    t0 = time.perf_counter()
    with structlog.testing.capture_logs() as logs:
        manager = z.Zero3CpuOffloadManager.from_pretrained(config, group, spec["model_dir"])
    load_s = time.perf_counter() - t0
    ctx.mark("loaded")
    after_load = proc_status()  # RssAnon / RssFile: what the RSS at load is made of
    stats = manager.get_memory_stats()
    read = [e["bytes_read"] for e in logs if e["event"] == "pretrained_loaded"]
    shard = stats.master_param_bytes + stats.compute_copy_bytes
    memory = {k: v for k, v in attrs.asdict(stats).items() if k.endswith("_bytes")}
    await manager.close()
    z.destroy_process_group()
    return {
        "load_s": load_s,
        "status_after_load": after_load,
        "bytes_read": read[0] if read else None,
        "shard_bytes": shard,
        "model_state_bytes": stats.model_state_bytes(),
        "memory_stats": memory,
        "params": sum(lay.numel for lay in manager.engine.layouts.values()),
        "owned_params": sum(lay.shard_numel for lay in manager.engine.layouts.values()),
        "config": config.to_dict(),
    }


async def generate(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Launcher target (a rank): greedy decoding under ZeRO-3, units kept gathered between
    decoding steps within the budget, and gathered at every step; tokens/s of each."""
    import torch

    import zero3_offload as z

    group = await z.init_process_group_from_env("gloo")
    manager = z.Zero3CpuOffloadManager.from_pretrained(
        z.Zero3CpuOffloadConfig(), group, spec["model_dir"]
    )
    prompt = torch.arange(16).view(1, 16)
    out: dict[str, Any] = {"budget_bytes": manager.config.gpu_param_memory_budget}
    tokens = {}
    for keep in (True, False, True):  # the first run warms up
        t0 = time.perf_counter()
        ids = await manager.generate(prompt, max_new_tokens=16, do_sample=False, keep_gathered=keep)
        out[f"keep_gathered={keep}"] = 16 / (time.perf_counter() - t0)
        tokens[keep] = ids[0].tolist()
    out["same_tokens"] = tokens[True] == tokens[False]
    await manager.close()
    z.destroy_process_group()
    return out


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
        checksum = sum(float(p.sum()) for p in params)  # a forward reads every weight
        ctx.mark("read")
        for p in params:  # the first optimizer step writes every weight
            p.mul_(1.0)
        ctx.mark("written")
    nbytes = sum(p.numel() * p.element_size() for p in params)
    dtypes = sorted({str(p.dtype) for p in params})
    return {
        "load_s": load_s,
        "param_bytes": nbytes,
        "dtypes": dtypes,
        "checksum": checksum,
        "model": type(model).__name__,
    }


def run(args: Any) -> dict[str, Any] | None:
    import torch
    import transformers

    import zero3_offload

    dims = TINY if args.quick else FULL
    n_rounds, started = args.warmup + args.repeats, time.perf_counter()
    with torch.device("meta"):
        params = sum(
            p.numel() for p in transformers.LlamaForCausalLM(llama_config(dims)).parameters()
        )
    progress(f"Llama of {params:,} parameters ({mib(4 * params)} MiB fp32)")
    with work_directory("pretrained-load-", args.keep, args.workdir) as work:
        base = {"dims": dims, "model_dir": str(work / "model"), "threads": args.threads}
        base.update(imports=IMPORTS, mmap_threshold=args.mmap_threshold)
        saved = launch("suites.pretrained_load:save", base, work / "save", torchrun=False)
        if not saved["ok"]:
            progress(f"saving failed: {saved['error']}\n" + "\n".join(saved["log_tails"][0]))
            return None
        progress(f"saved in {saved['wall_s']:.0f} s: {saved['ranks'][0]['files']}")

        def one(e: dict[str, Any]) -> dict[str, Any]:
            case = CASES[e["key"]]
            target, run_dir = f"suites.pretrained_load:{case}", work / f"round{e['round']}-{case}"
            return launch(
                target, base, run_dir, world=WORLD, timeout_s=args.timeout, sample_s=SAMPLE_S
            )

        def describe(r: dict[str, Any]) -> str:
            peaks = ", ".join(mib(rank["peak_rss_bytes"]) for rank in r["ranks"])
            loads = ", ".join(f"{rank['load_s']:.1f}" for rank in r["ranks"])
            return f"load {loads} s, peak RSS {peaks} MiB"

        runs = run_plan(plan(list(CASES), n_rounds), one, describe)
        decoded = launch(
            "suites.pretrained_load:generate", base, work / "generate", world=WORLD, timeout_s=900
        )
        progress(f"generate: {decoded['ranks'][0] if decoded['ok'] else decoded['error']}")
    failed = [f"{r['key']} (round {r['round']}): {r['error']}" for r in runs if not r["ok"]]
    if not any(r["ok"] for r in runs):
        progress("no case produced a result")
        return None
    rounds = [{"round": r, "warmup": r < args.warmup, "cases": {}} for r in range(n_rounds)]
    for r in runs:
        rounds[r["round"]]["cases"][r["key"]] = r
    name = "pretrained-load" + ("-quick" if args.quick else "")
    name += "-mmap" if args.mmap_threshold is not None else ""
    return {
        "benchmark": name,
        "config": {
            "world_size": WORLD,
            "dims": dims,
            "threads_per_rank": args.threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "sample_interval_s": SAMPLE_S,
            "malloc_mmap_threshold": args.mmap_threshold,
            "zero3_offload_version": zero3_offload.__version__,
            "transformers_version": transformers.__version__,
        },
        "model": {"params": params, "fp32_bytes": 4 * params, "saved": saved["ranks"][0]},
        "rounds": rounds,
        "generate": decoded["ranks"][0] if decoded["ok"] else None,
        "failed": failed,
        "total_wall_s": time.perf_counter() - started,
    }


def report(payload: dict[str, Any]) -> Report:
    cfg, model = payload["config"], payload["model"]
    model_bytes = model["fp32_bytes"]
    measured = [rd["cases"] for rd in payload["rounds"] if not rd["warmup"]]

    def med(case: str, rank: int, get: Any) -> float | None:
        values = [get(c[case]["ranks"][rank]) for c in measured if c.get(case, {}).get("ok")]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def at(mark: str, key: str = "hwm_bytes") -> Any:
        return lambda r: r["marks"][mark][key] if mark in r["marks"] else None

    figures = {
        "load": lambda r: r["load_s"],
        "loaded": at("loaded"),
        "rss_loaded": at("loaded", "rss_bytes"),
        "read": at("read"),
        "written": at("written"),
        "peak": lambda r: r["peak_rss_bytes"],
        "imported": at("imported", "rss_bytes"),
        "anon": lambda r: r["sampled_peak_bytes"].get("RssAnon"),
    }
    shard = {rank: med(OURS, rank, lambda r: r["shard_bytes"]) for rank in range(cfg["world_size"])}
    rows = []
    for case in CASES:
        for rank in range(cfg["world_size"]):
            f = {k: med(case, rank, get) for k, get in figures.items()}
            if f["peak"] is None:
                rows.append([case, str(rank), "FAILED", *["-"] * 12])
                continue
            plain_peak, more = med(PLAIN, rank, figures["peak"]), f["peak"] - f["imported"]
            read = med(case, rank, lambda r: r.get("bytes_read")) if case == OURS else None
            rows.append(
                [
                    case,
                    str(rank),
                    f"{f['load']:.2f}",
                    *(mib(f[k]) if f[k] else "-" for k in ("loaded", "rss_loaded", "read")),
                    *(mib(f[k]) if f[k] else "-" for k in ("written", "peak")),
                    f"{f['peak'] / plain_peak:.2f}" if plain_peak else "-",
                    mib(more),
                    f"{more / model_bytes:.2f}",
                    f"{more / shard[rank]:.2f}" if shard[rank] else "-",
                    mib(f["anon"]) if f["anon"] else "-",
                    mib(shard[rank], 1) if case == OURS and shard[rank] else "-",
                    mib(read, 1) if read else "-",
                ]
            )
    headers = cols(
        "case; rank; load s; peak RSS at load MiB; RSS at load MiB; peak, weights read MiB; "
        "peak, weights written MiB; peak RSS MiB; / plain's; peak - after import MiB; "
        "/ model fp32; / rank's shard; peak anon MiB; rank's shard MiB; read MiB"
    )
    saved = model["saved"]
    files = ", ".join(f"{n} {size:,} B" for n, size in saved["files"].items())
    dims = cfg["dims"]
    ours_cfg = next((c[OURS]["ranks"][0] for c in measured if c.get(OURS, {}).get("ok")), None)
    notes = [
        f"model: transformers LlamaForCausalLM, hidden {dims['d']}, MLP {dims['ffn']}, "
        f"{dims['n_layers']} decoder layers, {dims['heads']} heads, {dims['kv_heads']} KV heads, "
        f"vocabulary {dims['vocab']}, untied head: {model['params']:,} parameters, "
        f"{model_bytes:,} bytes fp32 ({mib(model_bytes, 1)} MiB); saved once (seed {SEED}, "
        f"built in {saved['build_s']:.0f} s, saved in {saved['save_s']:.0f} s) as {files}, in "
        "a temporary directory removed afterwards. Read from the page cache (just written).",
        f"{cfg['world_size']} fresh processes per case, {cfg['threads_per_rank']} torch "
        f"thread(s) each; medians of {cfg['repeats']} round(s) after {cfg['warmup']} "
        "unmeasured, cases interleaved; glibc mmap threshold "
        + (f"{cfg['malloc_mmap_threshold']}" if cfg["malloc_mmap_threshold"] else "default")
        + ".",
        f"{OURS}: Zero3CpuOffloadManager.from_pretrained(Zero3CpuOffloadConfig(), group, dir) "
        "on 2 gloo ranks (default config: parameters and optimizer state offloaded to the CPU); "
        "load s around that call only (the group already joined). rank's shard = "
        "master_param_bytes + compute_copy_bytes of get_memory_stats() (fp32 master and compute "
        "copy of the rank's 1/2 of every unit), read = bytes_read of its pretrained_loaded log "
        "event (the slices it read from the file)."
        + (
            f" Model state counted after loading: {mib(ours_cfg['model_state_bytes'])} MiB."
            if ours_cfg
            else ""
        ),
        f"{PLAIN}: AutoModelForCausalLM.from_pretrained(dir) in each of 2 processes (no group); "
        "load s around that call only. transformers maps the weight file copy-on-write and reads "
        "nothing until used, so the process then reads every parameter once (sum: what a forward "
        "does) and writes it once in place (mul_(1.0): what the first optimizer step does).",
        "peak RSS = each process's VmHWM at its end (file-backed pages of the mapped weight file "
        "included); at load: VmHWM and VmRSS right after the from_pretrained call; weights "
        "read / written: VmHWM after reading / writing every parameter (plain only); after "
        "import = VmRSS once torch, transformers and zero3_offload are imported; "
        f"peak anon = RssAnon sampled every {cfg['sample_interval_s'] * 1000:g} ms by the parent "
        "(memory that must really exist: clean mapped file pages can be dropped). / plain's "
        "divides peak RSS by the plain case's on the same rank; / model fp32 and / rank's shard "
        "divide peak - after import by the model's fp32 bytes and by the rank's shard bytes.",
    ]
    if gen := payload.get("generate"):
        notes.append(
            "generate (rank 0, 2 ranks, the loaded model, default config: budget "
            f"{mib(gen['budget_bytes'])} MiB): greedy, 16 new tokens after 16, "
            f"{gen['keep_gathered=True']:.2f} tokens/s with units kept gathered between decoding "
            f"steps vs {gen['keep_gathered=False']:.2f} tokens/s gathering them at every step "
            f"({gen['keep_gathered=True'] / gen['keep_gathered=False']:.2f}x); same tokens: "
            f"{gen['same_tokens']}."
        )
    if payload.get("failed"):
        notes.append("FAILED: " + "; ".join(payload["failed"]))
    title = (
        f"Loading a pretrained Llama ({model['params']:,} parameters, "
        f"{mib(model_bytes, 1)} MiB fp32) on {cfg['world_size']} ranks: peak RSS per rank"
    )
    return Report(title, markdown_table(headers, rows), notes)
