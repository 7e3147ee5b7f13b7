"""What ``scaling.py`` runs: the model sizes, the systems, the plan and its time estimate.

:func:`run_all` launches every planned run with ``_peers_run.launch()``
(fresh interpreters running ``_peers_worker.py``, one per rank) and reports
progress and an updated time left on stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _peers_model import GPT, count_params
from _peers_report import MIB
from _peers_run import LR, SYSTEMS, WEIGHT_DECAY, System, launch

DEFAULT_WORLDS = (1, 2, 4)
TORCH_KEY = "torch"


@dataclass(frozen=True)
class Size:
    """One model size: GPT dimensions, global batch and default step counts."""

    name: str
    d: int
    heads: int
    n_layers: int
    seq: int = 128
    global_batch: int = 8
    warmup: int = 1
    repeats: int = 4

    @property
    def dims(self) -> dict[str, int]:
        return {
            "d": self.d,
            "heads": self.heads,
            "n_layers": self.n_layers,
            "seq": self.seq,
            "global_batch": self.global_batch,
        }

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq


# Blocks hold 12 d^2 + 10 d parameters. 300M is compare_peers' large model and
# 20M its small one, so those rows can be checked against results/peers*.md.
SIZES = {
    s.name: s
    for s in (
        Size("5M", d=256, heads=4, n_layers=6, warmup=2, repeats=8),
        Size("20M", d=512, heads=8, n_layers=6, warmup=2, repeats=6),
        Size("80M", d=768, heads=12, n_layers=11, warmup=1, repeats=5),
        Size("300M", d=1024, heads=16, n_layers=24, warmup=1, repeats=4),
    )
}
QUICK_SIZES = {
    s.name: s
    for s in (
        Size("q20k", d=32, heads=2, n_layers=1, seq=32),
        Size("q60k", d=64, heads=2, n_layers=1, seq=32),
        Size("q120k", d=64, heads=2, n_layers=2, seq=32),
        Size("q400k", d=128, heads=4, n_layers=2, seq=32),
    )
}

# Cost model for the time estimate only (nothing reported is estimated). CPU
# seconds per parameter and token of one step, from this machine's
# `compare_peers.py --large --mmap-threshold 1048576` (results/peers-large-mmap.json,
# 303M params, 1,024 tokens): plain torch 24.8 CPU s / step, zero3_offload on
# 2 ranks 39.2 CPU s / step (both ranks). Start-up: interpreter + imports per
# rank, and building (and, for ours, sharding) the model in every rank.
CPU_S_PER_PARAM_TOKEN = {"torch": 8.0e-11, "zero3_offload": 1.26e-10}
START_S = 3.0
BUILD_S_PER_PARAM = 3e-8


# ---------------------------------------------------------------- plan


def systems_for(worlds: list[int]) -> dict[str, System]:
    """Plain torch plus zero3_offload (compare_peers' default config) at every world size."""
    torch_label, torch_kind, _, torch_opts = SYSTEMS["torch"]
    _, ours_kind, _, ours_opts = SYSTEMS["ours_default"]
    systems: dict[str, System] = {TORCH_KEY: (torch_label, torch_kind, 1, torch_opts)}
    for n in worlds:
        systems[f"ours_n{n}"] = (f"zero3_offload N={n}", ours_kind, n, ours_opts)
    return systems


def schedule(sizes: list[Size], keys: list[str], rounds: int) -> list[tuple[int, Size, str]]:
    """(round, size, system) in run order: sizes in turn, systems rotated by size + round."""
    plan = []
    for r in range(rounds):
        for i, size in enumerate(sizes):
            k = (i + r) % len(keys)
            plan += [(r, size, key) for key in keys[k:] + keys[:k]]
    return plan


def param_count(size: Size) -> tuple[int, dict[str, int]]:
    """Parameters of the GPT at ``size`` (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        model = GPT(d=size.d, heads=size.heads, n_layers=size.n_layers, seq=size.seq)
    return count_params(model)


def estimate_run_s(
    system: System, rank_threads: int, n_params: int, size: Size, steps: int, cores: int
) -> float:
    """Predicted wall seconds of one run (for the progress estimate only)."""
    _, kind, world, _ = system
    busy = max(1, min(world * rank_threads, cores))
    parallel_ranks = max(1, min(world, cores))
    start = START_S * math.ceil(world / cores) + BUILD_S_PER_PARAM * n_params * world / (
        parallel_ranks
    )
    step_cpu = CPU_S_PER_PARAM_TOKEN[kind] * n_params * size.tokens
    return start + steps * step_cpu / busy


def predict(
    plan: list[tuple[int, Size, str]],
    systems: dict[str, System],
    args: argparse.Namespace,
    params: dict[str, int],
    cores: int,
) -> list[float]:
    """Predicted wall seconds of every planned run, in plan order."""
    return [
        estimate_run_s(
            systems[key],
            rank_threads(key, args),
            params[size.name],
            size,
            sum(steps_of(size, args)),
            cores,
        )
        for _, size, key in plan
    ]


def fmt_duration(seconds: float) -> str:
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes}m{sec:02d}s" if minutes else f"{sec}s"


# ---------------------------------------------------------------- running


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_median_step(run: dict[str, Any]) -> float:
    w = run["warmup"]
    return statistics.median(x["step_s"] for rk in run["ranks"] for x in rk["steps"][w:])


def run_all(
    plan: list[tuple[int, Size, str]],
    systems: dict[str, System],
    args: argparse.Namespace,
    predicted: list[float],
    workdir: Path,
) -> list[dict[str, Any]]:
    """Launch every planned run (fresh processes each); progress and an ETA on stderr.

    The ETA scales the predicted time of the remaining runs by how the runs so
    far compared with their prediction.
    """
    runs: list[dict[str, Any]] = []
    failed: set[tuple[str, str]] = set()
    started = time.perf_counter()
    for i, (r, size, key) in enumerate(plan):
        tag = f"[{i + 1}/{len(plan)}] round {r} {size.name:>5} {systems[key][0]}"
        if (size.name, key) in failed:
            progress(f"{tag}: skipped (failed before)")
            continue
        warmup, repeats = steps_of(size, args)
        progress(f"{tag}: running ({warmup} warm-up + {repeats} timed steps) ...")
        run = launch(
            key,
            systems[key],
            common_spec(size, args, warmup, repeats),
            workdir / f"round{r}-{size.name}-{key}",
            threads=args.threads,
            timeout_s=args.timeout,
            mmap_threshold=args.mmap_threshold,
            rank_threads=rank_threads(key, args),
        )
        run.update({"round": r, "size": size.name, "warmup": warmup, "index": i})
        runs.append(run)
        elapsed = time.perf_counter() - started
        scale = elapsed / max(sum(predicted[: i + 1]), 1e-9)
        eta = fmt_duration(scale * sum(predicted[i + 1 :]))
        if run["ok"]:
            rss = max(rk["peak_rss_bytes"] for rk in run["ranks"]) / MIB
            progress(
                f"{tag}: median step {run_median_step(run):.3f} s, peak RSS/rank {rss:,.0f} MiB, "
                f"run {run['wall_s']:.1f} s; elapsed {fmt_duration(elapsed)}, ~{eta} left"
            )
        else:
            failed.add((size.name, key))
            progress(f"{tag}: FAILED: {run['error']} (run {run['wall_s']:.1f} s)")
            for rank, tail in run["log_tails"].items():
                progress("\n    ".join([f"  rank {rank} log tail:", *tail]))
    return runs


def steps_of(size: Size, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up, timed) steps of a run at ``size``: the options, else the size's defaults."""
    warmup = size.warmup if args.warmup is None else args.warmup
    repeats = size.repeats if args.repeats is None else args.repeats
    return warmup, repeats


def rank_threads(key: str, args: argparse.Namespace) -> int:
    return args.torch_threads if key == TORCH_KEY else args.threads


def common_spec(size: Size, args: argparse.Namespace, warmup: int, repeats: int) -> dict[str, Any]:
    """The worker spec fields every system of one size shares."""
    return {
        "dims": size.dims,
        "global_batch": size.global_batch,
        "seed": args.seed,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "warmup": warmup,
        "steps": repeats,
    }


def size_config(size: Size, args: argparse.Namespace) -> dict[str, Any]:
    """A size's dimensions, parameter counts (total and per layer) and step counts."""
    total, per_layer = param_count(size)
    warmup, repeats = steps_of(size, args)
    return {
        **size.dims,
        "params": total,
        "layer_params": per_layer,
        "warmup": warmup,
        "timed_steps": repeats,
    }
