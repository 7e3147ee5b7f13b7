"""The training run of one rank that every training suite uses (:func:`train`), the runs of a
suite's table of systems x sizes on fresh ranks (:func:`train_runs`, :func:`compare`), and their
summary, the compact figures the tables show (:func:`summarize`).

A rank may also (from its spec): write the library's JSON log (``log``; read back with
``zero3_offload.analyze``), take the change of ``get_performance_stats()`` over every step as a
phase of it (``stats``), stop its timed steps early near its deadline (``pace``), and end with
one ``finish`` function of the suite (``module:function``), which uses the public API only.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from harness import workload
from harness.render import MIB
from harness.runner import launch, load, plan, progress, run_plan, work_directory
from harness.sampler import StepClock
from harness.systems import SYSTEMS, System

LR, WEIGHT_DECAY = 3e-4, 0.01  # AdamW's, unless a suite's spec says otherwise
LOSS_STEPS, LOSS_TOLERANCE = 5, 1e-3  # the first steps' losses of every system agree this well
MIN_TIMED = 2  # timed steps a paced run keeps


def check_loss_steps(args: Any) -> str | None:
    if args.warmup + args.repeats < LOSS_STEPS:
        return f"--warmup + --repeats must be >= {LOSS_STEPS} (the loss check)"
    return None


def stats_delta(prev: Any, now: Any) -> dict[str, Any]:
    """What ``get_performance_stats()`` counted between two snapshots: collectives and transfers
    (the fields of each record), prefetch counters, optimizer seconds, the seconds of the new
    timeline intervals by kind and phase, and the layers gathered."""

    def diff(a: dict, b: dict) -> dict:
        out = {}
        for k, record in a.items():
            before = attrs.asdict(b[k]) if k in b else {}
            out[k] = {f: v - before.get(f, 0) for f, v in attrs.asdict(record).items()}
        return out

    seen, spans = set(prev.timeline), {}
    events = [e for e in now.timeline if e not in seen]
    for e in events:
        spans[f"{e.kind} {e.phase}"] = spans.get(f"{e.kind} {e.phase}", 0.0) + e.end - e.start
    return {
        "communication": diff(now.communication, prev.communication),
        "transfers": diff(now.transfers, prev.transfers),
        "prefetch": {k: v - prev.prefetch.get(k, 0) for k, v in now.prefetch.items()},
        "optimizer_s": now.total_optimizer_time - prev.total_optimizer_time,
        "spans": spans,
        "gathered": [e.layer for e in events if e.kind == "gather"],
    }


async def train(spec: dict[str, Any], rank: Any) -> dict[str, Any]:
    if spec.get("log"):
        from zero3_offload.logging import configure

        configure(json_path=Path(spec["out_dir"]) / f"rank{rank.rank}.jsonl")
    device = torch.device(spec.get("device", "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    system = SYSTEMS[spec["kind"]](spec, rank)
    await system.start()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(spec["seed"])  # the same initial weights in every system
    model = workload.build(spec["dims"])
    rank.mark("model_built")
    await system.setup(model)
    rank.mark("setup_done")
    manager = getattr(system, "manager", None)  # the library's (the peers have no stats)
    stats = manager.get_performance_stats if spec.get("stats") and manager else None
    prev, steps, notes = stats() if stats else None, [], []
    batches = workload.batches(spec["warmup"] + spec["steps"], spec["dims"], spec["seed"] + 1)
    for batch in batches:
        per = batch[0].shape[0] // rank.world  # this rank's contiguous share of the batch
        x, y = (t[rank.rank * per : (rank.rank + 1) * per].to(device) for t in batch)
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
        timed = [s["step_s"] for s in steps[spec["warmup"] :]]
        left = spec["deadline"] - 5.0 - time.time()
        if (
            spec.get("pace")
            and MIN_TIMED <= len(timed) < spec["steps"]
            and left < 1.5 * max(timed) + 5
        ):
            notes.append(
                f"stopped after {len(timed)} of {spec['steps']} timed steps: {left:.0f} s left"
            )
            break
    result = {"steps": steps, "model_state": system.model_state(), **system.info(), "notes": notes}
    if cuda:
        result["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if spec.get("finish"):
        rank.save(result)  # kept if the finish crashes the process
        await load(spec["finish"])(spec, system, result)
    await system.close()
    return result


def train_runs(
    args: Any,
    systems: dict[str, System],
    sizes: dict[str, dict],
    threads: dict[str, int],
    *,
    spec: dict[str, Any] | None = None,
    describe: Callable[[dict], str] | None = None,
) -> list[dict[str, Any]]:
    """Every run of the plan of ``systems`` x ``sizes`` (name -> dims, ``warmup`` and
    ``timed_steps``; one size may be named ""), each on fresh ranks running :func:`train` with
    ``spec`` added to its spec; from ``args``: ``rounds``, ``seed``, ``timeout`` and, if present,
    ``mmap_threshold`` and ``keep``."""
    get = args.__dict__.get

    def one(e: dict[str, Any]) -> dict[str, Any]:
        system, size = systems[e["key"]], sizes[e.get("size", "")]
        run_spec = {"lr": LR, "weight_decay": WEIGHT_DECAY, **(spec or {})}
        run_spec.update(kind=system.kind, options=system.options, seed=args.seed)
        run_spec.update(warmup=size["warmup"], steps=size["timed_steps"], threads=threads[e["key"]])
        run_spec["dims"] = {k: size[k] for k in workload.DIMS if k in size}
        run_spec["imports"] = ["deepspeed"] * (system.kind == "deepspeed")
        run_spec["imports"] += ["transformers"] * (size.get("model") == "llama")
        run_spec["mmap_threshold"] = get("mmap_threshold")
        run_dir = workdir / f"{e.get('size', 'run')}-{e['key']}-{e['round']}"
        kw = {"world": system.world, "torchrun": system.kind != "torch", "timeout_s": args.timeout}
        sample = {"sample_s": 0.002, "keep_samples": True} if (spec or {}).get("log") else {}
        run = launch("harness.train:train", run_spec, run_dir, **kw, **sample)
        if (spec or {}).get("log"):  # the ranks' JSON logs, read before the directory goes
            for r, rk in enumerate(run["ranks"]):
                rk["log"] = str(run_dir / f"rank{r}.jsonl")
                rk.update(load(spec["read"])(rk) if spec.get("read") else {})
        return {**run, "warmup": size["warmup"]}

    with work_directory("train-", bool(get("keep"))) as workdir:
        entries = plan(list(systems), args.rounds, list(sizes))
        return run_plan(entries, one, describe or describe_run)


def compare(args: Any, systems: dict[str, System], dims: dict[str, int], **kw: Any) -> dict:
    """Train each of ``systems`` on the model of ``dims`` with :func:`train_runs` (``kw`` goes to
    it; from ``args`` also ``warmup`` and ``repeats``): the config, the raw runs, the systems
    skipped (DeepSpeed when it is not installed, and systems whose runs failed) with why, and the
    time it took."""
    skipped, missing = {}, importlib.util.find_spec("deepspeed") is None  # an optional extra
    for key in [k for k, s in systems.items() if s.kind == "deepspeed" and missing]:
        why = "deepspeed is not installed (pip install deepspeed to include it)"
        skipped[key] = {"label": systems.pop(key).label, "why": why, "failed": False}
        progress(f"SKIPPED {skipped[key]['label']}: {why}")
    per_layer = workload.layer_params(dims)
    model = workload.LLAMA if dims.get("model") == "llama" else workload.MODEL
    progress(f"{model} {dims}: {sum(per_layer.values()):,} params in {len(per_layer)} layers")
    started = time.perf_counter()
    size = {**dims, "warmup": args.warmup, "timed_steps": args.repeats}
    runs = train_runs(args, systems, {"": size}, **kw)
    for r in runs:  # a failed run: the launcher's error and the ranks' own
        if not r["ok"]:
            errors = dict.fromkeys(rk["error"] for rk in r["ranks"] if "error" in rk)
            why = "; ".join([r["error"], *errors])
            skipped.setdefault(
                r["key"], {"label": systems[r["key"]].label, "why": why, "failed": True}
            )
    config = {
        "dims": dims,
        "seed": args.seed,
        "warmup": args.warmup,
        "steps": args.repeats,
        "model": model,
        "params": sum(per_layer.values()),
        "layers": len(per_layer),
        "largest_layer": max(per_layer.values()),
        "lr": (kw.get("spec") or {}).get("lr", LR),
        "weight_decay": (kw.get("spec") or {}).get("weight_decay", WEIGHT_DECAY),
        "rounds": args.rounds,
        "corpus": workload.corpus_info(),
    }
    took = time.perf_counter() - started
    return {
        "config": config,
        "skipped": skipped,
        "runs": runs,
        "total_wall_s": took,
        "systems": systems,
    }


def describe_run(run: dict[str, Any]) -> str:
    """A finished run in one line of progress."""
    rss = max(rk["peak_rss_bytes"] for rk in run["ranks"]) / MIB
    losses = [round(v, 4) for v in global_losses(run)[:5]]
    return f"median step {run_median(run):.3f} s, peak RSS/rank {rss:,.0f} MiB, losses {losses}"


def global_losses(run: dict[str, Any]) -> list[float]:
    """Per step, the mean of the ranks' local mean losses (= the global-batch mean)."""
    per_rank = [[s["loss"] for s in rk["steps"]] for rk in run["ranks"]]
    return [statistics.fmean(v) for v in zip(*per_rank, strict=True)]


def timed(run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per rank, the timed steps of a run (after its warm-up)."""
    return [rk["steps"][run["warmup"] :] for rk in run["ranks"]]


def step_cpu(run: dict[str, Any]) -> list[float]:
    """Per timed step, the CPU seconds of all ranks' processes together."""
    return [sum(s["cpu_s"] for s in steps) for steps in zip(*timed(run), strict=True)]


def run_median(run: dict[str, Any]) -> float:
    return statistics.median(s["step_s"] for steps in timed(run) for s in steps)


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """A run's line in the per-round and per-run tables."""
    row = {
        k: run[k] for k in ("index", "round", "key", "size", "ok", "wall_s", "error") if k in run
    }
    if load := run.get("load_average_at_start"):
        row["load"] = load[0]
    if run["ok"]:
        row.update(median_step_s=run_median(run), cpu_s=statistics.median(step_cpu(run)))
        row["peak_rss_bytes"] = max(rk["peak_rss_bytes"] for rk in run["ranks"])
    return row


def summarize(
    runs: list[dict], systems: dict[str, dict], size: str | None = None, reference: str = "torch"
) -> dict[str, Any]:
    """Per system with a successful run (at ``size``, if given) the figures of the tables, with
    its losses' check against the first run of ``reference`` (or of the first system): all
    finite and the first :data:`LOSS_STEPS` within :data:`LOSS_TOLERANCE` (a bound, which trains
    nothing together, is not checked); and the agreement of all."""
    median, out = statistics.median, {}
    runs = [r for r in runs if r["ok"] and size in (None, r.get("size"))]
    all_losses = {}
    for key, system in systems.items():
        if not (ok := [r for r in runs if r["key"] == key]):
            continue
        steps = [s for r in ok for rank_steps in timed(r) for s in rank_steps]
        all_losses[key] = losses = [global_losses(r) for r in ok]
        spread = [abs(a - b) for ls in losses[1:] for a, b in zip(ls, losses[0], strict=True)]

        def per_run(get: Callable, over_ranks: Callable = max, ok: list = ok) -> float:
            """The median over runs of the max (or ``over_ranks``) over ranks of ``get(rank)``."""
            return median(over_ranks(get(rk) for rk in r["ranks"]) for r in ok)

        out[key] = {
            "label": system["label"],
            "world_size": system["world"],
            "threads_per_rank": ok[0]["ranks"][0]["torch_threads"],
            "runs": len(ok),
            "median_step_s": median(x["step_s"] for x in steps),
            "best_run_step_s": min(run_median(r) for r in ok),
            "median_cpu_s": median(c for r in ok for c in step_cpu(r)),
            # forward_s held forward + loss in runs recorded before loss_s had a phase of its own
            "median_forward_s": median(x["forward_s"] + x.get("loss_s", 0.0) for x in steps),
            "median_backward_s": median(x["backward_s"] for x in steps),
            "median_optimizer_s": median(x["optimizer_s"] for x in steps),
            "peak_rss_bytes": per_run(lambda rk: rk["peak_rss_bytes"]),
            "sum_peak_rss_bytes": per_run(lambda rk: rk["peak_rss_bytes"], sum),
            "import_rss_bytes": per_run(lambda rk: rk["marks"]["imported"]["rss_bytes"]),
            "built_rss_bytes": per_run(lambda rk: rk["marks"]["model_built"]["rss_bytes"]),
            "model_state_bytes": max(rk["model_state"]["total"] for rk in ok[0]["ranks"]),
            "losses": losses[0],
            "loss_spread": max(spread, default=0.0),
        }
        if "peak_gpu_allocated_bytes" in ok[0]["ranks"][0]:
            out[key]["peak_gpu_bytes"] = per_run(lambda rk: rk["peak_gpu_allocated_bytes"])
    if not out:
        return {"systems": {}, "agreement": None}
    ref = reference if reference in out else next(iter(out))
    base = out[ref]["losses"]
    n, diffs = min(LOSS_STEPS, len(base)), []
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


def part(compared: dict[str, Any], reference: str = "torch", **config: Any) -> dict[str, Any]:
    """The compact results of :func:`compare` (``config`` added to its config): the summary (the
    losses checked against ``reference``'s), the runs' lines, the systems skipped and the time it
    took."""
    systems = {k: s._asdict() for k, s in compared["systems"].items()}
    return {
        "config": {**compared["config"], **config},
        **summarize(compared["runs"], systems, reference=reference),
        "runs": [run_row(r) for r in compared["runs"]],
        "skipped": compared["skipped"],
        "total_wall_s": compared["total_wall_s"],
    }
