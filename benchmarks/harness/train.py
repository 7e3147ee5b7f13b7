"""The training run of one rank (:func:`train`; with ``stats`` in its spec, the change of
``get_performance_stats()`` over each step), the runs of a suite's systems x sizes on fresh ranks
(:func:`train_runs`, :func:`compare`) and their summary, the figures of the tables."""

from __future__ import annotations

import gc
import importlib.util
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from harness import workload
from harness.runner import launch, plan, progress, run_plan, work_directory
from harness.sampler import StepClock
from harness.systems import SYSTEMS
from zero3_offload.stats.performance import OperationStats

LR, WEIGHT_DECAY = 3e-4, 0.01  # AdamW's, unless a suite's spec says otherwise
LOSS_STEPS, LOSS_TOLERANCE = 5, 1e-3  # the first steps' losses of every system agree this well


def check_loss_steps(args: Any) -> str | None:
    if args.warmup + args.repeats < LOSS_STEPS:
        return f"--warmup + --repeats must be >= {LOSS_STEPS} (the loss check)"
    return None


def stats_delta(prev: Any, now: Any) -> dict[str, Any]:
    """What ``get_performance_stats()`` counted between two snapshots, new timeline spans too."""

    def since(a: dict, b: dict) -> dict:
        return {k: attrs.asdict(v.since(b.get(k, OperationStats()))) for k, v in a.items()}

    seen, spans = set(prev.timeline), {}
    for e in (e for e in now.timeline if e not in seen):
        spans[f"{e.kind} {e.phase}"] = spans.get(f"{e.kind} {e.phase}", 0.0) + e.end - e.start
    return {
        "communication": since(now.communication, prev.communication),
        "transfers": since(now.transfers, prev.transfers),
        "prefetch": {k: v - prev.prefetch.get(k, 0) for k, v in now.prefetch.items()},
        "optimizer_s": now.total_optimizer_time - prev.total_optimizer_time,
        "spans": spans,
    }


async def train(spec: dict[str, Any], rank: Any) -> dict[str, Any]:
    device = torch.device(spec.get("device", "cpu"))
    if cuda := device.type == "cuda":
        torch.cuda.set_device(0)
    system = SYSTEMS[spec["kind"]](spec, rank)
    await system.start()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(spec["seed"])  # the same initial weights in every system
    model = await system.build(spec)
    rank.mark("model_built")
    await system.setup(model)
    gc.collect()  # what setup left for the collector goes before the steps' peak
    rank.mark("set_up")
    rank.reset_peak()
    stats = system.manager.get_performance_stats if spec.get("stats") else None
    prev, steps = stats() if stats else None, []
    for batch in workload.batches(spec["warmup"] + spec["steps"], spec["dims"], spec["seed"] + 1):
        sp = spec["options"].get("sequence_parallel_size", 1)  # a group's ranks: the same rows
        per = batch[0].shape[0] * sp // rank.world  # this rank's contiguous share of the batch
        x, y = (t[rank.rank // sp * per : (rank.rank // sp + 1) * per].to(device) for t in batch)
        clock = StepClock()
        loss = await system.step(x, y, clock)
        clock.phase("sync")
        value = loss.item()
        if cuda:
            torch.cuda.synchronize()
        if stats:  # inside the step's time: prefetches launched at its end get no head start
            clock.phase("snapshot")
            now = stats()
        steps.append(clock.stop(loss=value))
        if stats:
            steps[-1]["stats"], prev = stats_delta(prev, now), now
    result = {"steps": steps, "model_state": system.model_state(), **system.info()}
    if cuda:
        result["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
    await system.close()
    return result


def train_runs(args: Any, systems: dict, sizes: dict, threads: dict, **kw: Any) -> list[dict]:
    """Every run of ``systems`` x ``sizes`` on fresh ranks running :func:`train`."""
    get = args.__dict__.get

    def one(e: dict[str, Any]) -> dict[str, Any]:
        system, size = systems[e["key"]], sizes[e.get("size", "")]
        spec = {"lr": LR, "weight_decay": WEIGHT_DECAY, **kw.get("spec", {}), "seed": args.seed}
        spec.update(kind=system.kind, options=system.options, threads=threads[e["key"]])
        spec.update(warmup=size["warmup"], steps=size["timed_steps"])
        spec["dims"] = {**{k: size[k] for k in workload.DIMS if k in size}, **system.dims}
        spec["imports"] = ["deepspeed"] * system.kind.startswith("deepspeed")
        spec["imports"] += ["transformers"] * (size.get("model") == "llama")
        spec["mmap_threshold"] = get("mmap_threshold")
        spec["pretrained"] = spec.get("pretrained") and str(workdir / f"weights{e.get('size', '')}")
        run_dir = workdir / f"{e.get('size', 'run')}-{e['key']}-{e['round']}"
        ranks = {"world": system.world, "torchrun": system.kind != "torch"}
        run = launch("harness.train:train", spec, run_dir, **ranks, timeout_s=args.timeout)
        return {**run, "warmup": size["warmup"]}

    with work_directory("train-", bool(get("keep"))) as workdir:
        for name, size in sizes.items() if kw.get("spec", {}).get("pretrained") else ():
            spec = {"dims": size, "seed": args.seed, "model_dir": str(workdir / f"weights{name}")}
            if not (saved := launch("harness.workload:save", spec, workdir / "save"))["ok"]:
                raise RuntimeError(f"saving the weights failed: {saved['error']}")
        entries = plan(list(systems), args.rounds, list(sizes))
        return run_plan(entries, one)


def compare(args: Any, systems: dict, dims: dict, threads: dict, **kw: Any) -> tuple[dict, list]:
    """Train ``systems`` on ``dims``: the compact results (``kw``: config) and the runs."""
    skipped, missing = {}, importlib.util.find_spec("deepspeed") is None  # an optional extra
    for key in [k for k, s in systems.items() if s.kind == "deepspeed" and missing]:
        why = "deepspeed is not installed (pip install deepspeed to include it)"
        skipped[key] = {"label": systems.pop(key).label, "why": why, "failed": False}
        progress(f"SKIPPED {skipped[key]['label']}: {why}")
    per_layer, reference = workload.layer_params(dims), kw.pop("reference", "torch")
    model = workload.LLAMA if dims.get("model") == "llama" else workload.MODEL
    progress(f"{model} {dims}: {sum(per_layer.values()):,} params in {len(per_layer)} layers")
    started, spec = time.perf_counter(), kw.pop("spec", {})
    size = {**dims, "warmup": args.warmup, "timed_steps": args.repeats}
    runs = train_runs(args, systems, {"": size}, threads, spec=spec)
    for r in (r for r in runs if not r["ok"]):  # a failed run: the launcher's error and the ranks'
        errors = [rk["error"] for rk in r["ranks"] if "error" in rk]
        why = "; ".join(dict.fromkeys([r["error"], *errors]))
        skipped.setdefault(r["key"], {"label": systems[r["key"]].label, "why": why, "failed": True})
    spec = {"lr": LR, "weight_decay": WEIGHT_DECAY, **spec}
    config = {"dims": dims, "seed": args.seed, "warmup": args.warmup, "steps": args.repeats}
    config.update(model=model, params=sum(per_layer.values()), layers=len(per_layer))
    config.update(largest_layer=max(per_layer.values()), lr=spec["lr"], rounds=args.rounds)
    config.update(weight_decay=spec["weight_decay"], corpus=workload.corpus_info(), **kw)
    summary = summarize(runs, {k: s._asdict() for k, s in systems.items()}, reference=reference)
    out = {"config": config, **summary, "runs": [run_row(r) for r in runs], "skipped": skipped}
    return {**out, "total_wall_s": time.perf_counter() - started}, runs


def global_losses(run: dict[str, Any]) -> list[float]:
    """Per step, the mean of the ranks' local mean losses (= the global-batch mean)."""
    per_rank = [[s["loss"] for s in rk["steps"]] for rk in run["ranks"]]
    return [statistics.fmean(v) for v in zip(*per_rank, strict=True)]


def timed(run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [rk["steps"][run["warmup"] :] for rk in run["ranks"]]


def step_cpu(run: dict[str, Any]) -> list[float]:
    """Per timed step, the CPU seconds of all ranks' processes together."""
    return [sum(s["cpu_s"] for s in steps) for steps in zip(*timed(run), strict=True)]


def run_median(run: dict[str, Any]) -> float:
    return statistics.median(s["step_s"] for steps in timed(run) for s in steps)


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("index", "round", "key", "size", "ok", "wall_s", "error")
    row = {k: run[k] for k in keys if k in run} | {"load": run["load_average_at_start"][0]}
    if run["ok"]:
        row.update(median_step_s=run_median(run), cpu_s=statistics.median(step_cpu(run)))
        row["peak_rss_bytes"] = max(rk["peak_rss_bytes"] for rk in run["ranks"])
    return row


def summarize(
    runs: list[dict], systems: dict, size: str | None = None, reference: str = "torch"
) -> dict:
    """Per system the figures of the tables, its losses checked against ``reference``'s."""
    median, out, all_losses = statistics.median, {}, {}
    runs = [r for r in runs if r["ok"] and size in (None, r.get("size"))]
    for key, system in systems.items():
        if not (ok := [r for r in runs if r["key"] == key]):
            continue
        steps, ranks = [s for r in ok for rank in timed(r) for s in rank], [r["ranks"] for r in ok]
        all_losses[key] = losses = [global_losses(r) for r in ok]
        spread = [abs(a - b) for ls in losses[1:] for a, b in zip(ls, losses[0], strict=True)]
        out[key] = row = {"label": system["label"], "world_size": system["world"], "runs": len(ok)}
        row["threads_per_rank"] = ranks[0][0]["torch_threads"]
        row["median_step_s"] = median(x["step_s"] for x in steps)
        row["median_forward_s"] = median(x["forward_s"] + x["loss_s"] for x in steps)
        for phase in ("backward", "optimizer"):
            row[f"median_{phase}_s"] = median(x[f"{phase}_s"] for x in steps)
        row["best_run_step_s"] = min(run_median(r) for r in ok)
        row["median_cpu_s"] = median(c for r in ok for c in step_cpu(r))

        def per_run(get: Callable, over: Callable = max, ranks: list = ranks) -> float:
            """The median over the runs of the max (or ``over``) over each run's ranks."""
            return median(over(map(get, rs)) for rs in ranks)

        row["peak_rss_bytes"] = per_run(lambda rk: rk["peak_rss_bytes"])
        row["sum_peak_rss_bytes"] = per_run(lambda rk: rk["peak_rss_bytes"], sum)
        row["step_peak_rss_bytes"] = per_run(lambda rk: rk["step_peak_rss_bytes"])
        row["import_rss_bytes"] = per_run(lambda rk: rk["marks"]["imported"]["rss_bytes"])
        row["built_rss_bytes"] = per_run(lambda rk: rk["marks"]["model_built"]["rss_bytes"])
        if "peak_gpu_allocated_bytes" in ranks[0][0]:
            row["peak_gpu_bytes"] = per_run(lambda rk: rk["peak_gpu_allocated_bytes"])
        row["model_state_bytes"] = max(rk["model_state"] for rk in ranks[0])
        row.update(losses=losses[0], loss_spread=max(spread, default=0.0))
    if not out:
        return {"systems": {}, "agreement": None}
    ref = reference if reference in out else next(iter(out))
    base, diffs = out[ref]["losses"], []
    n = min(LOSS_STEPS, len(base))
    for key, row in out.items():
        if systems[key]["kind"] == "split":  # a bound: its losses leave the others' after step 0
            continue
        pairs = [(a, b) for ls in all_losses[key] for a, b in zip(ls[:n], base[:n], strict=True)]
        row["loss_max_diff"] = max(abs(a - b) for a, b in pairs)
        row["loss_finite"] = all(math.isfinite(v) for ls in all_losses[key] for v in ls)
        diffs.append((row["loss_max_diff"], row["loss_finite"]))
    agree = all(f and d <= LOSS_TOLERANCE for d, f in diffs)
    worst = max((d for d, _ in diffs), default=0.0)
    agreement = {"agree": agree, "max_diff": worst, "reference": out[ref]["label"]}
    return {"systems": out, "agreement": agreement}
