"""Peak memory and wall time of consolidating a sharded checkpoint into one file.

To safetensors and ``.pt``, and naive loads, each in a fresh process sampled from outside."""

from __future__ import annotations

import hashlib
import inspect
import itertools
import statistics
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from harness.render import Col
from harness.runner import cases, progress, work_directory
from torch import nn

import zero3_offload as z

WORLD, SEED, SAMPLE_S, LN_AFTER = 2, 0, 0.002, (2, 5)  # a LayerNorm after fc2 and fc5
FULL_WIDTHS = [2048, 3072, 4096, 4096, 3072, 2048, 2048, 3072, 2048]
QUICK_WIDTHS = [64, 128, 256, 256, 128, 64, 64, 128, 64]
ST_FILE, PT_FILE, BASELINE = "model.safetensors", "model.pt", "baseline"
CASES = {
    BASELINE: "baseline",
    "consolidate -> safetensors": "stream",
    "consolidate -> pt": "pt",
    "naive load_file (mmap) + read all": "naive",
    "naive load_file (pread)": "naive_pread",
}
if "backend" not in inspect.signature(safetensors.torch.load_file).parameters:
    del CASES["naive load_file (pread)"]  # safetensors < 0.8 has no choice of backend
TAKES = ["keep"]
OPTIONS = {"--workdir": {"type": Path, "help": "where the checkpoint goes (default: a temp dir)"}}
DEFAULTS, QUICK = {"repeats": 5, "warmup": 1}, {"repeats": 1, "warmup": 0}
TITLE = "Checkpoint consolidation ({model[mib]:.1f} MiB fp32 model, {config[world_size]} ranks)"
# fmt: off
LAYOUT = [([
    Col("case", "case"), Col("wall s", "wall_s", ".3f"), Col("of which fsync s", "fsync_s", ".3f"),
    *(c for key, name in (("rss", "peak RSS"), ("anon", "peak anon")) for c in (
        Col(f"{name} MiB", key, "mib1"), Col("- baseline MiB", f"{key}_more", "mib1"),
        Col("/ model", f"{key}_model", ".2f"), Col("/ largest", f"{key}_largest", ".2f"))),
], "rows")]
NOTES = [
    "model: {model[layers]} layers (nn.Linear widths {model[widths]}, LayerNorm after "
    "{model[norms]}), {model[tensors]} tensors, {model[bytes]:,} bytes fp32 ({model[mib]:.1f} "
    "MiB); largest tensor {model[largest]}: {model[largest_bytes]:,} bytes "
    "({model[largest_bytes]:mib1} MiB).",
    "checkpoint: saved by Zero3CpuOffloadManager on {config[world_size]} gloo ranks right after "
    "construction (no optimizer state yet), {checkpoint[bytes]:,} bytes in {checkpoint[files]} "
    "files; outputs {outputs[safetensors]:,} bytes (.safetensors) and {outputs[pt]:,} bytes (.pt). "
    "Read from the page cache (just written).",
    "each case a fresh process ({threads} torch threads), peaks sampled from outside every "
    "{config[sample_ms]:g} ms; medians of {config[repeats]} round(s) after {config[warmup]} "
    "warm-up round(s), cases interleaved; columns: docs/benchmarks.md (consolidate).",
    "verified: both outputs hold exactly the model's state-dict names, load strict=True, and "
    "every tensor's SHA-256 equals the original model's.",
]
# fmt: on


def make_model(widths: list[int], seed: int) -> nn.Sequential:
    """Linear layers between ``widths``, LayerNorms after :data:`LN_AFTER`, each seeded alone."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        torch.manual_seed(seed + i)
        layers[f"fc{i}"] = nn.Linear(fan_in, fan_out)
        if i in LN_AFTER:
            layers[f"ln{i}"] = ln = nn.LayerNorm(fan_out)
            with torch.no_grad():
                ln.weight.normal_(1.0, 0.02)
                ln.bias.normal_(0.0, 0.02)
    return nn.Sequential(layers)


def digests(state: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """name -> [dtype, shape, sha256 of the bytes]."""

    def sha256(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().contiguous().reshape(-1).numpy().data).hexdigest()

    return {n: [str(t.dtype), list(t.shape), sha256(t)] for n, t in state.items()}


async def save(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: build the model, construct the manager and save a checkpoint at once."""
    group = await z.init_process_group_from_env("gloo")
    model = make_model(spec["widths"], SEED)
    ref = digests(model.state_dict()) if ctx.rank == 0 else None
    config = z.Zero3CpuOffloadConfig(optimizer=z.OptimizerConfig(kind="adamw"))
    async with z.Zero3CpuOffloadManager(config, group, model) as manager:
        path = await manager.save_checkpoint(spec["root"])
    z.destroy_process_group()
    return {"path": str(path), "digests": ref}


def case(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: one measured case in this fresh process (its peak: the "end" mark's VmHWM)."""
    name, work, t0 = spec["case"], Path(spec["work"]), time.perf_counter()
    if name in ("stream", "pt"):
        out, fmt = (ST_FILE, "safetensors") if name == "stream" else (PT_FILE, "pt")
        z.consolidate_checkpoint(spec["root"], work / out, fmt=fmt)
    elif name.startswith("naive"):
        kwargs = {"backend": "pread"} if name == "naive_pread" else {}
        state = safetensors.torch.load_file(str(work / ST_FILE), **kwargs)
        if name == "naive":  # mapped tensors are read lazily: read every byte once
            sum(float(t.sum()) for t in state.values())
    return {"case": name, "wall_s": time.perf_counter() - t0}


baseline = stream = pt = naive = naive_pread = case  # the targets of the cases


def rows(rounds: list[dict[str, dict]], sizes: dict[str, int]) -> list[dict[str, Any]]:
    """Per case the medians over the rounds, and its peaks above the baseline's, relative too."""
    model, largest, out = sum(sizes.values()), max(sizes.values()), []
    peaks = {"rss": lambda c: c["peak_rss_bytes"]}
    peaks["anon"] = lambda c: c["sampled_peak_bytes"]["RssAnon"]
    for label in rounds[0]:
        runs = [c[label] for c in rounds]
        out.append(row := {"case": label})
        if label != BASELINE:
            row["wall_s"] = statistics.median(c["wall_s"] for c in runs)
        for key, get in peaks.items():
            row[key] = statistics.median(map(get, runs))
            if label != BASELINE:
                row[f"{key}_more"] = more = row[key] - out[0][key]
                row.update({f"{key}_model": more / model, f"{key}_largest": more / largest})
    return out


def run(args: Any) -> dict[str, Any] | None:
    threads = args.threads or torch.get_num_threads()
    widths = QUICK_WIDTHS if args.quick else FULL_WIDTHS
    with torch.device("meta"):
        state = make_model(widths, SEED).state_dict()
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    with work_directory("consolidate-", args.keep, args.workdir) as work:
        spec = {"widths": widths, "root": str(work / "ckpt"), "work": str(work), "threads": threads}
        kw = {"save": {"world": WORLD}, "case": {"torchrun": False, "sample_s": SAMPLE_S}}
        saved, runs, measured = cases(__name__, CASES, spec, work, args, rotate=False, **kw)
        if not saved or not all(r["ok"] for r in runs):
            return None
        files = [f.stat().st_size for f in Path(saved["ranks"][0]["path"]).iterdir()]
        paths = {"safetensors": work / ST_FILE, "pt": work / PT_FILE}
        outputs = {k: path.stat().st_size for k, path in paths.items()}
        loads = [safetensors.torch.load_file(str(paths["safetensors"]))]
        for state in [*loads, torch.load(paths["pt"], weights_only=True)]:
            with torch.device("meta"):  # each output, loaded strictly, equal to the model
                make_model(widths, SEED + 1).load_state_dict(state, strict=True, assign=True)
            if digests(state) != saved["ranks"][0]["digests"]:
                progress("consolidated output differs from the model: no results written")
                return None
    largest = max(sizes, key=sizes.__getitem__)
    model = {"layers": len(widths) - 1 + len(LN_AFTER), "widths": " -> ".join(map(str, widths))}
    model.update(norms=", ".join(f"fc{i}" for i in LN_AFTER), tensors=len(sizes))
    model.update(bytes=sum(sizes.values()), mib=sum(sizes.values()) / 2**20, largest=largest)
    model["largest_bytes"] = sizes[largest]
    config = {"world_size": WORLD, "widths": widths, "seed": SEED, "repeats": args.repeats}
    config.update(warmup=args.warmup, sample_ms=SAMPLE_S * 1000)
    rounds = [{k: r["ranks"][0] for k, r in c.items()} for c in measured]
    out = {"config": config, "model": model, "checkpoint": {"bytes": sum(files)}}
    out["checkpoint"]["files"], out["outputs"], out["threads"] = len(files), outputs, threads
    return {**out, "rows": rows(rounds, sizes)}
