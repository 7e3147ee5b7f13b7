"""Peak memory and wall time of consolidating a sharded checkpoint into one file.

A ~285 MB model's checkpoint (saved on 2 gloo ranks) is consolidated to safetensors and to
``.pt``, and the result naively loaded, each case in a fresh process, rounds interleaved.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import resource
import statistics
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from harness.launcher import launch, work_directory
from harness.plan import plan, progress, run_plan
from harness.report import Report, cols, markdown_table, mib
from torch import nn

from zero3_offload.checkpoint.consolidate import consolidate_checkpoint

WORLD, SEED, SAMPLE_S, LN_AFTER = 2, 0, 0.002, (2, 5)  # a LayerNorm after fc2 and fc5
FULL_WIDTHS = [2048, 3072, 4096, 4096, 3072, 2048, 2048, 3072, 2048]
QUICK_WIDTHS = [64, 128, 256, 256, 128, 64, 64, 128, 64]
ST_FILE, PT_FILE = "model.safetensors", "model.pt"
BASELINE, STREAM = "baseline", "consolidate -> safetensors"
CASES = {
    BASELINE: "baseline",
    STREAM: "stream",
    "consolidate -> pt": "pt",
    "naive load_file (mmap) + read all": "naive",
    "naive load_file (pread)": "naive-pread",
}
if "backend" not in inspect.signature(safetensors.torch.load_file).parameters:
    del CASES["naive load_file (pread)"]  # safetensors < 0.8 has no choice of backend


OPTIONS = {
    "--workdir": {"type": Path, "help": "where the checkpoint goes (default: a temp dir)"},
    "--keep": {"action": "store_true", "help": "keep the checkpoint and outputs"},
}
DEFAULTS, QUICK = {"repeats": 5, "warmup": 1}, {"repeats": 1, "warmup": 0}
EPILOG = "--repeats/--warmup: measured/untimed rounds (5/1; quick 1/0); --threads: each case's"


def check(args: Any) -> str | None:
    return "--warmup must be >= 0" if args.warmup < 0 else None


def make_model(widths: list[int], seed: int) -> nn.Sequential:
    """Linear layers ``widths[i] -> widths[i+1]``, LayerNorms after :data:`LN_AFTER`; each layer
    seeded on its own, so the same call builds the same model anywhere."""
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
    out = {}
    for name, t in state.items():
        data = t.detach().contiguous().reshape(-1).numpy().data
        out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()]
    return out


async def save(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: build the model, construct the manager and save a checkpoint at once."""
    import zero3_offload as z

    group = await z.init_process_group_from_env("gloo")
    model = make_model(spec["widths"], SEED)
    ref = digests(model.state_dict()) if ctx.rank == 0 else None
    config = z.Zero3CpuOffloadConfig(optimizer=z.OptimizerConfig(kind="adamw"))
    t0 = time.perf_counter()
    async with z.Zero3CpuOffloadManager(config, group, model) as manager:
        t1 = time.perf_counter()
        path = await manager.save_checkpoint(spec["root"])
    z.destroy_process_group()
    took = {"construct_s": t1 - t0, "save_s": time.perf_counter() - t1}
    return {"path": str(path), **took, "digests": ref, "config": config.to_dict()}


def case(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Rank target: one measured case in this fresh process."""
    name, work, result = spec["case"], Path(spec["work"]), {"case": spec["case"]}
    fsync_s, real_fsync = [0.0], os.fsync

    def timed_fsync(fd: int) -> None:  # the safetensors path ends with an fsync: timed apart
        start = time.perf_counter()
        real_fsync(fd)
        fsync_s[0] += time.perf_counter() - start

    os.fsync = timed_fsync
    t0 = time.perf_counter()
    if name in ("stream", "pt"):
        out, fmt = (ST_FILE, "safetensors") if name == "stream" else (PT_FILE, "pt")
        consolidate_checkpoint(spec["root"], work / out, fmt=fmt)
    elif name.startswith("naive"):
        kwargs = {"backend": "pread"} if name == "naive-pread" else {}
        state = safetensors.torch.load_file(str(work / ST_FILE), **kwargs)
        result["load_s"] = time.perf_counter() - t0
        if name == "naive":  # mapped tensors are read lazily: read every byte once
            result["checksum"] = sum(float(t.sum()) for t in state.values())
        result["loaded_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    result.update(wall_s=time.perf_counter() - t0, fsync_s=fsync_s[0])
    # The peak is this process's VmHWM (the launcher's "end" mark). ru_maxrss is kept but not
    # used: Linux carries the high-water mark from before exec over into the child.
    result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def run(args: Any) -> dict[str, Any] | None:
    import zero3_offload

    threads, n_rounds = args.threads or torch.get_num_threads(), args.warmup + args.repeats
    widths = QUICK_WIDTHS if args.quick else FULL_WIDTHS
    with torch.device("meta"):
        state = make_model(widths, SEED).state_dict()
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    started = time.perf_counter()
    with work_directory("consolidate-", args.keep, args.workdir) as work:
        spec = {"widths": widths, "root": str(work / "ckpt"), "work": str(work)}
        saved = launch("suites.consolidate:save", spec, work / "save", world=WORLD)
        if not saved["ok"]:
            progress(f"saving failed: {saved['error']}\n" + "\n".join(saved["log_tails"][0]))
            return None
        ckpt = Path(saved["ranks"][0]["path"])
        files = {p.name: p.stat().st_size for p in sorted(ckpt.iterdir())}

        def one(e: dict[str, Any]) -> dict[str, Any]:
            case, run_dir = CASES[e["key"]], work / f"round{e['round']}-{CASES[e['key']]}"
            case_spec = {**spec, "case": case, "threads": threads}
            return launch(
                "suites.consolidate:case", case_spec, run_dir, torchrun=False, sample_s=SAMPLE_S
            )

        def describe(r: dict[str, Any]) -> str:
            case = r["ranks"][0]
            return f"{case['wall_s']:.2f} s, {mib(case['peak_rss_bytes'], 1)} MiB"

        runs = run_plan(plan(list(CASES), n_rounds, rotate=False), one, describe)
        if not all(r["ok"] for r in runs):
            return None
        outputs = {f: (work / f).stat().st_size for f in (ST_FILE, PT_FILE)}
        checks, ref = {}, saved["ranks"][0]["digests"]  # each output, loaded strictly, vs the model
        for label, load in (
            ("safetensors", lambda: safetensors.torch.load_file(str(work / ST_FILE))),
            ("pt", lambda: torch.load(work / PT_FILE, weights_only=True)),
        ):
            state = load()
            with torch.device("meta"):
                make_model(widths, SEED + 1).load_state_dict(state, strict=True, assign=True)
            got = digests(state)
            same, equal = sorted(got) == sorted(ref), sum(got.get(n) == d for n, d in ref.items())
            checks[label] = {"same_names": same, "tensors": len(ref), "tensors_equal": equal}
    progress(f"verify: {checks}")
    if not all(c["same_names"] and c["tensors_equal"] == c["tensors"] for c in checks.values()):
        progress("consolidated output differs from the model: no results written")
        return None
    rounds = [{"round": r, "warmup": r < args.warmup, "cases": {}} for r in range(n_rounds)]
    for x in runs:
        rounds[x["round"]]["cases"][x["key"]] = {**x["ranks"][0], "process_s": x["wall_s"]}
    largest = max(sizes, key=sizes.__getitem__)
    return {
        "config": {
            "world_size": WORLD,
            "widths": widths,
            "layernorm_after": list(LN_AFTER),
            "seed": SEED,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": threads,
            "sample_interval_s": SAMPLE_S,
            "zero3_offload_version": zero3_offload.__version__,
            "safetensors_version": safetensors.__version__,
            "manager_config": saved["ranks"][0]["config"],
        },
        "model": {
            "layers": len(widths) - 1 + len(LN_AFTER),
            "tensors": len(sizes),
            "model_bytes": sum(sizes.values()),
            "largest_tensor": largest,
            "largest_tensor_bytes": sizes[largest],
            "tensor_bytes": sizes,
        },
        "checkpoint": {
            "files": files,
            "build_s": saved["wall_s"],
            "per_rank": [{k: v for k, v in r.items() if k != "digests"} for r in saved["ranks"]],
        },
        "outputs_bytes": outputs,
        "rounds": rounds,
        "verification": checks,
        "total_wall_s": time.perf_counter() - started,
    }


def report(payload: dict[str, Any]) -> Report:
    measured = [rd["cases"] for rd in payload["rounds"] if not rd["warmup"]]
    cfg, model, files = payload["config"], payload["model"], payload["checkpoint"]["files"]
    nbytes, largest = model["model_bytes"], model["largest_tensor_bytes"]

    def med(label: str, key: str) -> float:  # over the measured rounds
        return statistics.median(
            c[label]["sampled_peak_bytes"][key] if key.startswith("Rss") else c[label][key]
            for c in measured
        )

    base = {key: med(BASELINE, key) for key in ("peak_rss_bytes", "RssAnon")}
    rows = []
    for label in measured[0]:
        wall, fsync = med(label, "wall_s"), med(label, "fsync_s")
        row = [label, "-" if label == BASELINE else f"{wall:.3f}", f"{fsync:.3f}" if fsync else "-"]
        for key in ("peak_rss_bytes", "RssAnon"):
            peak, more = med(label, key), med(label, key) - base[key]
            rel = [mib(more, 1), f"{more / nbytes:.2f}", f"{more / largest:.2f}"]
            row += [mib(peak, 1), *(["-"] * 3 if label == BASELINE else rel)]
        rows.append(row)
    headers = cols(
        "case; wall s; of which fsync s; peak RSS MiB; - baseline MiB; / model; "
        "/ largest; peak anon MiB; - baseline MiB; / model; / largest"
    )
    threads = measured[0][STREAM]["torch_threads"]
    widths, out = " -> ".join(map(str, cfg["widths"])), payload["outputs_bytes"]
    notes = [
        f"model: {model['layers']} layers (nn.Linear widths {widths}, LayerNorm after "
        f"fc{', fc'.join(map(str, cfg['layernorm_after']))}), {model['tensors']} tensors, "
        f"{nbytes:,} bytes fp32 ({mib(nbytes, 1)} MiB); largest tensor {model['largest_tensor']}: "
        f"{largest:,} bytes ({mib(largest, 1)} MiB).",
        f"checkpoint: saved by Zero3CpuOffloadManager on {cfg['world_size']} gloo ranks right "
        f"after construction (no optimizer state yet), {sum(files.values()):,} bytes in "
        f"{len(files)} files; outputs {out[ST_FILE]:,} bytes (.safetensors) and {out[PT_FILE]:,} "
        "bytes (.pt). Read from the page cache (just written).",
        f"each case a fresh process ({threads} torch threads); medians of {cfg['repeats']} "
        f"round(s) after {cfg['warmup']} warm-up round(s), cases interleaved.",
        "peak RSS = the child's VmHWM (includes mapped file pages; ru_maxrss would include the "
        "parent's peak, see the script); peak anon = RssAnon of /proc/<pid>/status sampled every "
        f"{cfg['sample_interval_s'] * 1000:g} ms by the parent; '- baseline' subtracts the "
        "baseline process's median (imports only); '/ model' and '/ largest' divide that by the "
        "model's and the largest tensor's bytes.",
        "wall s = time.perf_counter around the call only (no interpreter start or imports); the "
        "safetensors path fsyncs its output (timed apart by wrapping os.fsync in the child), "
        "torch.save does not.",
        "verified: both outputs hold exactly the model's state-dict names, load strict=True, and "
        "every tensor's SHA-256 equals the original model's.",
    ]
    title = f"Checkpoint consolidation ({mib(nbytes, 1)} MiB fp32 model, {cfg['world_size']} ranks)"
    return Report(title, markdown_table(headers, rows), notes)
