"""The training runs of every training suite, and their summary.

``train(spec, rank)`` (a launcher target): join the group, build the model, set the system up,
train ``warmup + steps`` steps on this rank's share of each global batch, then count the model
state (and, on CUDA, the peak GPU memory). A suite adds to it with the class its spec's ``hooks``
names (``module:Class``, made with ``(spec, rank)``), which may have ``setup(system)``,
``step(i, clock, system)`` (inside step ``i``'s time; False stops the loop), an async
``end(system, result)`` and a ``sampler`` for the clocks. :func:`train_runs` runs a suite's table
of systems and sizes, each on fresh ranks; :func:`summarize` gives the figures of its tables.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from harness import workload
from harness.launcher import launch, load, work_directory
from harness.plan import plan, progress, run_plan
from harness.report import MIB
from harness.sampler import StepClock
from harness.systems import SYSTEMS, System

LR, WEIGHT_DECAY = 3e-4, 0.01  # AdamW's, unless a suite's spec says otherwise
LOSS_STEPS, LOSS_TOLERANCE = 5, 1e-3  # the first steps' losses of every system agree this well
RANK_OPTIONS = {  # of the suites that run ranks from the command line
    "--mmap-threshold": {
        "type": int,
        "metavar": "BYTES",
        "help": "MALLOC_MMAP_THRESHOLD_ in every rank (glibc returns freed blocks this large to "
        "the OS; `zero3-offload train` sets 1048576); the name gets -mmap",
    },
    "--keep": {"action": "store_true", "help": "keep the work directory (rank logs)"},
}


async def train(spec: dict[str, Any], rank: Any) -> dict[str, Any]:
    hooks = load(spec["hooks"])(spec, rank) if spec.get("hooks") else None
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
    if hasattr(hooks, "setup"):
        hooks.setup(system)
    steps = []
    batches = workload.batches(spec["warmup"] + spec["steps"], spec["dims"], spec["seed"] + 1)
    for i, batch in enumerate(batches):
        per = batch[0].shape[0] // rank.world  # this rank's contiguous share of the batch
        x, y = (t[rank.rank * per : (rank.rank + 1) * per].to(device) for t in batch)
        clock = StepClock(getattr(hooks, "sampler", None), i)
        loss = await system.step(x, y, clock)
        clock.phase("sync")
        value = loss.item()
        if cuda:
            torch.cuda.synchronize()
        go_on = hooks.step(i, clock, system) if hasattr(hooks, "step") else True
        steps.append(clock.stop(loss=value))
        if go_on is False:
            break
    result = {"steps": steps, "model_state": system.model_state(), **system.info()}
    if cuda:
        result["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if hasattr(hooks, "end"):
        await hooks.end(system, result)
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
    ``spec`` added to its spec (AdamW's ``lr`` and ``weight_decay`` unless it has them); from
    ``args``: ``rounds``, ``seed``, ``timeout`` and, if present, ``mmap_threshold`` and ``keep``."""
    get = args.__dict__.get

    def one(e: dict[str, Any]) -> dict[str, Any]:
        system, size = systems[e["key"]], sizes[e.get("size", "")]
        hf = ["transformers"] if size.get("model") == "llama" else []
        run_spec = {
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            **(spec or {}),
            "kind": system.kind,
            "options": system.options,
            "seed": args.seed,
            "warmup": size["warmup"],
            "steps": size["timed_steps"],
            "dims": {k: size[k] for k in workload.DIMS if k in size},
            "imports": [*(["deepspeed"] if system.kind == "deepspeed" else []), *hf],
            "threads": threads[e["key"]],
            "mmap_threshold": get("mmap_threshold"),
        }
        run_dir = workdir / f"{e.get('size', 'run')}-{e['key']}-{e['round']}"
        kw = {"world": system.world, "torchrun": system.kind != "torch", "timeout_s": args.timeout}
        run = launch("harness.train:train", run_spec, run_dir, **kw)
        return {**run, "warmup": size["warmup"]}

    with work_directory("train-", bool(get("keep"))) as workdir:
        entries = plan(list(systems), args.rounds, list(sizes))
        return run_plan(entries, one, describe or describe_run)


def compare(args: Any, systems: dict[str, System], dims: dict[str, int], **kw: Any) -> dict:
    """Train each of ``systems`` on the model of ``dims`` with :func:`train_runs` (``kw`` goes to
    it; from ``args`` also ``warmup`` and ``repeats``): the payload's config, the runs, the
    systems skipped (DeepSpeed when it is not installed, and systems whose runs failed) with why,
    and the time it took."""
    skipped, missing = {}, importlib.util.find_spec("deepspeed") is None  # an optional extra
    for key in [k for k, s in systems.items() if s.kind == "deepspeed" and missing]:
        skipped[key] = "deepspeed is not installed (pip install deepspeed to include it)"
        progress(f"SKIPPED {systems.pop(key).label}: {skipped[key]}")
    per_layer = workload.layer_params(dims)
    model = workload.LLAMA if dims.get("model") == "llama" else workload.MODEL
    progress(f"{model} {dims}: {sum(per_layer.values()):,} params in {len(per_layer)} layers")
    started = time.perf_counter()
    size = {**dims, "warmup": args.warmup, "timed_steps": args.repeats}
    runs = train_runs(args, systems, {"": size}, **kw)
    spec = {"lr": LR, "weight_decay": WEIGHT_DECAY, **(kw.get("spec") or {})}
    for r in runs:  # a failed run: the launcher's error and the ranks' own
        if not r["ok"]:
            errors = dict.fromkeys(rk["error"] for rk in r["ranks"] if "error" in rk)
            skipped.setdefault(r["key"], "; ".join([r["error"], *errors]))
    config = {
        "dims": dims,
        "seed": args.seed,
        "warmup": args.warmup,
        "steps": args.repeats,
        "model": model,
        "params": sum(per_layer.values()),
        "layer_params": per_layer,
        "lr": spec["lr"],
        "weight_decay": spec["weight_decay"],
        "rounds": args.rounds,
        "corpus": workload.corpus_info(),
        "systems": {k: s._asdict() for k, s in systems.items()},
    }
    took = time.perf_counter() - started
    return {"config": config, "skipped": skipped, "runs": runs, "total_wall_s": took}


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


def summarize(payload: dict[str, Any], size: str | None = None) -> dict[str, dict[str, Any]]:
    """Per system with a successful run (at ``size``, if given): the figures of the tables."""
    median, out = statistics.median, {}
    runs = [r for r in payload["runs"] if r["ok"] and size in (None, r.get("size"))]
    for key, system in payload["config"]["systems"].items():
        if not (ok := [r for r in runs if r["key"] == key]):
            continue
        steps = [s for r in ok for rank_steps in timed(r) for s in rank_steps]
        losses = [global_losses(r) for r in ok]
        spread = [abs(a - b) for ls in losses[1:] for a, b in zip(ls, losses[0], strict=True)]

        def per_run(get: Callable, over_ranks: Callable = max, ok: list = ok) -> float:
            """The median over runs of the max (or ``over_ranks``) over ranks of ``get(rank)``."""
            return median(over_ranks(get(rk) for rk in r["ranks"]) for r in ok)

        out[key] = {
            "label": system["label"],
            "world_size": system["world"],
            "bound": system["kind"] == "split",
            "runs": len(ok),
            "threads_per_rank": ok[0]["ranks"][0]["torch_threads"],
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
            "all_losses": losses,
            "losses_max_run_spread": max(spread, default=0.0),
        }
        if "peak_gpu_allocated_bytes" in ok[0]["ranks"][0]:
            out[key]["peak_gpu_bytes"] = per_run(lambda rk: rk["peak_gpu_allocated_bytes"])
    return out


def loss_agreement(summary: dict[str, dict[str, Any]], reference: str = "torch") -> dict[str, Any]:
    """Per system, all its losses finite and the max |diff| of every run's first losses from the
    first run of ``reference`` (or of the first system); ``agree`` when all are within tolerance."""
    base = (summary.get(reference) or next(iter(summary.values())))["losses"]
    n, out = min(LOSS_STEPS, len(base)), {}
    for key, s in summary.items():
        if s["bound"]:  # trains nothing together: its losses leave the others' after step 0
            continue
        pairs = [(a, b) for ls in s["all_losses"] for a, b in zip(ls[:n], base[:n], strict=True)]
        diff = max(abs(a - b) for a, b in pairs)
        finite = all(math.isfinite(v) for ls in s["all_losses"] for v in ls)
        out[key] = {"max_diff": diff, "finite": finite, "agree": finite and diff <= LOSS_TOLERANCE}
    agree = all(v["agree"] for v in out.values())
    return {"systems": out, "max_diff": max(v["max_diff"] for v in out.values()), "agree": agree}
