"""zero3_offload side by side with the peers users would pick instead, in one run.

Every system trains the same GPT (``_peers_model.py``: children are the
layers), from the same seed (so the same initial weights on every rank and
system), on the same byte-level corpus (the bytes of the Python standard
library's top-level ``*.py`` files, windows drawn by a seeded generator), with
AdamW (lr, betas, eps and weight decay alike), fp32:

- ``torch``: plain single-process PyTorch, 2 torch threads, whole global
  batch, ``torch.optim.AdamW(fused=True)``;
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every child and on the
  root, 2 gloo ranks x 1 thread, ``torch.optim.AdamW(fused=True)`` on the
  sharded parameters;
- ``fsdp2_offload``: the same with ``CPUOffloadPolicy(pin_memory=False)``;
- ``deepspeed``: DeepSpeed ZeRO-3 with ``offload_optimizer`` and
  ``offload_param`` on ``cpu`` (``DS_ACCELERATOR=cpu``, its ``DeepSpeedCPUAdam``,
  ``deepspeed.init_distributed(dist_backend="gloo")``), 2 ranks x 1 thread;
  skipped with a message when deepspeed is not importable (an optional
  extra, never a dependency);
- ``ours_default``: ``Zero3CpuOffloadManager`` with the default config
  (AdamW), 2 ranks x 1 thread;
- ``ours_fast`` ("zero3_offload tuned"): the best of the configurations that
  ``--sweep-ours`` compares: the learning rate passed to ``backward_pass`` (each
  layer's update overlaps the backward of the layers before it) and
  ``prefetch_buffer_size=1``. On the small model it differed from the default
  by less than the machine's noise (see ``benchmarks/README.md``).

Each run of a system is a fresh set of processes (one interpreter per rank,
torchrun's environment variables, ``OMP_NUM_THREADS`` = threads per rank),
``--warmup`` untimed steps, then ``--repeats`` timed steps. Rounds run every
system once, in an order rotated by one each round, so drift of the shared
machine shows in the per-round table and hits every system alike.

Per system: median step time over every timed step of every rank and run,
its phases (forward + loss, backward, optimizer step), per-rank peak RSS
(``VmHWM`` of ``/proc/self/status`` at the end of the run; max over ranks,
median over runs), model-state bytes per rank counted from the tensors each
system exposes, the loss of every step (mean of the ranks' local means, which
is the global-batch mean), and ratios to FSDP2 and to plain torch.

Run ``python benchmarks/compare_peers.py`` (small model, ~10 minutes here),
``--quick`` (tiny model, smoke test, ~2.5 minutes), ``--large`` (303M
parameters, for the memory comparison, ~17 minutes per round),
``--sweep-ours`` (configurations of ours only), ``--mmap-threshold 1048576``
(glibc returns freed blocks >= 1 MiB to the OS in every rank, as
``zero3-offload train`` does). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_model import corpus_info, count_params, make_model

try:
    from _common import (
        RESULTS_DIR,
        add_common_args,
        load_average,
        machine_info,
        machine_line,
        markdown_table,
        write_results,
    )
except ModuleNotFoundError:  # run as ``python -m benchmarks.compare_peers``
    from benchmarks._common import (
        RESULTS_DIR,
        add_common_args,
        load_average,
        machine_info,
        machine_line,
        markdown_table,
        write_results,
    )

WORKER = Path(__file__).resolve().parent / "_peers_worker.py"
WORLD = 2
LR = 3e-4
WEIGHT_DECAY = 0.01
LOSS_CHECK_STEPS = 5
LOSS_TOLERANCE = 1e-3
MIB = 2**20

SIZES = {
    "quick": {"d": 128, "heads": 4, "n_layers": 2, "seq": 64, "global_batch": 8},
    "small": {"d": 512, "heads": 8, "n_layers": 6, "seq": 128, "global_batch": 8},
    "large": {"d": 1024, "heads": 16, "n_layers": 24, "seq": 128, "global_batch": 8},
}

# key -> (label, kind, world size, options)
SYSTEMS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "torch": ("plain torch (1 process)", "torch", 1, {"fused": True}),
    "fsdp2": ("FSDP2", "fsdp2", WORLD, {"fused": True}),
    "fsdp2_offload": (
        "FSDP2 + CPUOffloadPolicy",
        "fsdp2",
        WORLD,
        {"fused": True, "cpu_offload": True},
    ),
    "deepspeed": ("DeepSpeed ZeRO-3 offload", "deepspeed", WORLD, {}),
    "ours_default": ("zero3_offload default", "zero3_offload", WORLD, {}),
    "ours_fast": (
        "zero3_offload tuned",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "prefetch_buffer_size": 1},
    ),
    "ours_ckpt": (
        "zero3_offload tuned + activation ckpt",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "prefetch_buffer_size": 1, "activation_checkpointing": True},
    ),
}
DEFAULT_SYSTEMS = list(SYSTEMS)

# Candidates for ours' fastest configuration (``--sweep-ours``).
_NO_OFFLOAD = {"offload_params": False, "offload_grads": False, "offload_optimizer_states": False}
SWEEP: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "ours_default": SYSTEMS["ours_default"],
    "lr_bwd": ("lr in backward_pass", "zero3_offload", WORLD, {"lr_in_backward": True}),
    "lr_bwd_nooffload": (
        "lr in backward, offload off",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, **_NO_OFFLOAD},
    ),
    "lr_bwd_1worker": (
        "lr in backward, cpu_worker_threads=1",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "cpu_worker_threads": 1},
    ),
    "lr_bwd_depth1": (
        "lr in backward, prefetch_buffer_size=1",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "prefetch_buffer_size": 1},
    ),
    "lr_bwd_persist": (
        "lr in backward, small layers persistent",
        "zero3_offload",
        WORLD,
        {"lr_in_backward": True, "param_persistence_threshold": 300_000},
    ),
    "no_prefetch": ("async_prefetch=False", "zero3_offload", WORLD, {"async_prefetch": False}),
}


# ---------------------------------------------------------------- launching


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deepspeed_status() -> tuple[bool, str]:
    """Whether ``import deepspeed`` works here (in a child, with DS_ACCELERATOR=cpu)."""
    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed is not installed (pip install deepspeed to include it)"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return False, "import deepspeed failed: " + " | ".join(tail)
    return True, proc.stdout.strip().splitlines()[-1]


def launch(
    key: str,
    system: tuple[str, str, int, dict[str, Any]],
    common: dict[str, Any],
    run_dir: Path,
    *,
    threads: int,
    timeout_s: float,
    py_spy_out: Path | None = None,
    log_dir: Path | None = None,
    mmap_threshold: int | None = None,
    rank_threads: int | None = None,
) -> dict[str, Any]:
    """Run one system once: ``world`` fresh processes; their results, or the error.

    Every rank runs ``rank_threads`` torch threads when given; otherwise
    ``threads``, and plain torch (one process) ``threads * WORLD``. Every
    system but plain torch gets torchrun's environment, also with one rank.
    With ``py_spy_out``, rank 0 runs under ``py-spy record`` (collapsed stacks
    written there); with ``log_dir``, zero3_offload ranks write JSON-lines logs
    there for ``zero3-offload analyze``.
    """
    _label, kind, world, options = system
    if log_dir is not None and kind == "zero3_offload":
        log_dir.mkdir(parents=True, exist_ok=True)
        options = {**options, "log_dir": str(log_dir)}
    run_dir.mkdir(parents=True)
    distributed = kind != "torch"
    if rank_threads is not None:
        per_rank_threads = rank_threads
    else:
        per_rank_threads = threads if distributed else threads * WORLD
    spec = {
        **common,
        "key": key,
        "kind": kind,
        "options": options,
        "threads": per_rank_threads,
        "out_dir": str(run_dir),
    }
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    base_env = {
        **os.environ,
        "OMP_NUM_THREADS": str(per_rank_threads),
        "MKL_NUM_THREADS": str(per_rank_threads),
        "DS_ACCELERATOR": "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    base_env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/zero3_offload_peers_torch_extensions")
    if mmap_threshold is not None:
        # glibc: allocations of this size or more are mmapped and returned on free
        # (what zero3_offload.memory_management.set_mmap_threshold sets).
        base_env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if distributed:
        base_env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "GROUP_RANK": "0",
            }
        )
    procs = []
    logs = []
    load = load_average()
    t0 = time.perf_counter()
    try:
        for rank in range(world):
            env = dict(base_env)
            if distributed:
                env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)})
            log = (run_dir / f"rank{rank}.log").open("w", encoding="utf-8")
            logs.append(log)
            cmd = [sys.executable, str(WORKER), str(spec_path)]
            if py_spy_out is not None and rank == 0:
                cmd = ["py-spy", "record", "--format", "raw", "--rate", "50", "--threads",
                       "--output", str(py_spy_out), "--", *cmd]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout_s
        error = None
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                error = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                error = f"did not finish within {timeout_s:g} s"
                break
            time.sleep(0.2)
        if error is None:
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                error = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
    finally:
        for p in procs:  # only the processes started here, by their own handle
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - t0
    if error is not None:
        tails = {}
        for rank in range(len(procs)):
            lines = (run_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
            tails[rank] = [ln for ln in lines if ln.strip()][-15:]
        return {
            "key": key,
            "ok": False,
            "error": error,
            "log_tails": tails,
            "wall_s": wall,
            "load_average_at_start": load,
        }
    ranks = [
        json.loads((run_dir / f"result-rank{r}.json").read_text(encoding="utf-8"))
        for r in range(world)
    ]
    return {"key": key, "ok": True, "ranks": ranks, "wall_s": wall, "load_average_at_start": load}


# ---------------------------------------------------------------- summaries


def _global_losses(run: dict[str, Any]) -> list[float]:
    """Per step, the mean of the ranks' local mean losses (= the global-batch mean)."""
    per_rank = [[s["loss"] for s in rk["steps"]] for rk in run["ranks"]]
    return [statistics.fmean(v) for v in zip(*per_rank, strict=True)]


def _step_cpu(run: dict[str, Any], warmup: int) -> list[float]:
    """Per timed step, the CPU seconds of all ranks' processes together."""
    per_rank = [[s["cpu_s"] for s in rk["steps"][warmup:]] for rk in run["ranks"]]
    return [sum(v) for v in zip(*per_rank, strict=True)]


def summarize(
    systems: dict[str, tuple[str, str, int, dict[str, Any]]],
    runs: list[dict[str, Any]],
    warmup: int,
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, (label, kind, world, options) in systems.items():
        ok = [r for r in runs if r["key"] == key and r["ok"]]
        if not ok:
            continue
        timed = [s for r in ok for rk in r["ranks"] for s in rk["steps"][warmup:]]
        losses = [_global_losses(r) for r in ok]
        s: dict[str, Any] = {
            "label": label,
            "kind": kind,
            "world_size": world,
            "threads_per_rank": ok[0]["ranks"][0]["torch_threads"],
            "options": options,
            "runs": len(ok),
            "samples": len(timed),
            "median_step_s": statistics.median(x["step_s"] for x in timed),
            "min_step_s": min(x["step_s"] for x in timed),
            "max_step_s": max(x["step_s"] for x in timed),
            "run_median_step_s": [
                statistics.median(x["step_s"] for rk in r["ranks"] for x in rk["steps"][warmup:])
                for r in ok
            ],
            "peak_rss_bytes": statistics.median(
                max(rk["peak_rss_bytes"] for rk in r["ranks"]) for r in ok
            ),
            "peak_rss_per_rank_bytes": [[rk["peak_rss_bytes"] for rk in r["ranks"]] for r in ok],
            "import_rss_bytes": statistics.median(
                max(rk["marks"]["imported"]["rss_bytes"] for rk in r["ranks"]) for r in ok
            ),
            "model_state_bytes": max(rk["model_state"]["total"] for rk in ok[0]["ranks"]),
            "model_state": ok[0]["ranks"][0]["model_state"],
            "losses": losses[0],
            "losses_max_run_spread": max(
                abs(a - b) for ls in losses[1:] for a, b in zip(ls, losses[0], strict=True)
            )
            if len(losses) > 1
            else 0.0,
        }
        s["median_cpu_s"] = statistics.median(c for r in ok for c in _step_cpu(r, warmup))
        s["run_median_cpu_s"] = [statistics.median(_step_cpu(r, warmup)) for r in ok]
        for phase in ("forward_s", "backward_s", "optimizer_s"):
            s[f"median_{phase}"] = statistics.median(x[phase] for x in timed)
        for extra in ("optimizer", "deepspeed_version", "persistent_params"):
            if extra in ok[0]["ranks"][0]:
                s[extra] = ok[0]["ranks"][0][extra]
        out[key] = s
    return out


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render(
    summary: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    rounds: int,
    loss_steps: int,
) -> tuple[str, dict[str, Any]]:
    """The markdown tables and the loss-agreement verdict."""
    fsdp = summary.get("fsdp2")
    ref = summary.get("torch")
    headers = [
        "system",
        "ranks x threads",
        "median step s",
        "vs FSDP2",
        "vs torch",
        "best run step s",
        "CPU s / step",
        "vs FSDP2",
        "fwd+loss s",
        "backward s",
        "optimizer s",
        "peak RSS / rank MiB",
        "vs FSDP2",
        "vs torch",
        "RSS after import MiB",
        "model state / rank MiB",
    ]
    rows = []
    for s in summary.values():
        rows.append(
            [
                s["label"],
                f"{s['world_size']} x {s['threads_per_rank']}",
                f"{s['median_step_s']:.3f}",
                _ratio(s["median_step_s"], fsdp and fsdp["median_step_s"]),
                _ratio(s["median_step_s"], ref and ref["median_step_s"]),
                f"{min(s['run_median_step_s']):.3f}",
                f"{s['median_cpu_s']:.3f}",
                _ratio(s["median_cpu_s"], fsdp and fsdp["median_cpu_s"]),
                f"{s['median_forward_s']:.3f}",
                f"{s['median_backward_s']:.3f}",
                f"{s['median_optimizer_s']:.3f}",
                f"{s['peak_rss_bytes'] / MIB:,.0f}",
                _ratio(s["peak_rss_bytes"], fsdp and fsdp["peak_rss_bytes"]),
                _ratio(s["peak_rss_bytes"], ref and ref["peak_rss_bytes"]),
                f"{s['import_rss_bytes'] / MIB:,.0f}",
                f"{s['model_state_bytes'] / MIB:,.1f}",
            ]
        )
    main_table = markdown_table(headers, rows)

    # Loss agreement: every system against plain torch (or the first system).
    base = ref or next(iter(summary.values()))
    k = min(loss_steps, len(base["losses"]))
    l_headers = [
        "system",
        *[f"step {i}" for i in range(k)],
        f"max |diff| vs {base['label']} (first {LOSS_CHECK_STEPS})",
        "max spread between runs",
    ]
    l_rows = []
    agreement: dict[str, Any] = {"reference": base["label"], "tolerance": LOSS_TOLERANCE}
    worst = 0.0
    for key, s in summary.items():
        n = min(LOSS_CHECK_STEPS, len(s["losses"]), len(base["losses"]))
        diff = max(abs(a - b) for a, b in zip(s["losses"][:n], base["losses"][:n], strict=True))
        worst = max(worst, diff)
        agreement[key] = diff
        l_rows.append(
            [
                s["label"],
                *[f"{v:.5f}" for v in s["losses"][:k]],
                f"{diff:.2e}",
                f"{s['losses_max_run_spread']:.1e}",
            ]
        )
    agreement["max_diff"] = worst
    agreement["agree"] = worst <= LOSS_TOLERANCE
    loss_table = markdown_table(l_headers, l_rows)

    # Per round: each run's median step (machine drift shows here).
    keys = list(summary)
    r_rows = []
    for r in range(rounds):
        in_round = [run for run in runs if run["round"] == r]
        by = {run["key"]: run for run in in_round if run["ok"]}
        order = " > ".join(run["key"] for run in in_round)
        cells = []
        for key in keys:
            run = by.get(key)
            if run is None:
                cells.append("-")
                continue
            w = run["warmup"]
            wall = statistics.median(x["step_s"] for rk in run["ranks"] for x in rk["steps"][w:])
            cells.append(f"{wall:.3f} ({statistics.median(_step_cpu(run, w)):.2f})")
        loads = [
            f"{run['load_average_at_start'][0]:.1f}"
            for run in in_round
            if run.get("load_average_at_start")
        ]
        r_rows.append([str(r), order, f"{min(loads)}-{max(loads)}" if loads else "-", *cells])
    rounds_table = markdown_table(
        ["round", "order", "load avg", *[summary[k]["label"] for k in keys]], r_rows
    )
    md = "\n\n".join(
        [
            main_table,
            f"Loss per step (global-batch mean; the first {k} steps of the first run; "
            "same initial weights and data for every system):",
            loss_table,
            "Per round: median step s of each run (CPU s / step of all ranks in parentheses) "
            "and the 1-minute load average at the runs' starts; drift of the machine shows here:",
            rounds_table,
        ]
    )
    return md, agreement


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Step time, per-rank peak RSS, model-state bytes and losses of zero3_offload, "
        "FSDP2 (+CPU offload), DeepSpeed ZeRO-3 offload and plain torch on the same model, data "
        "and seed (2 gloo ranks x 1 thread; plain torch 1 process x 2 threads).",
        epilog="Here --repeats is the number of timed steps per run (default 6; large 4), "
        "--warmup the untimed steps before them (default 2; large 1), --threads the torch "
        "threads per rank (default 1; plain torch gets 2x).",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--large",
        action="store_true",
        help=f"the >= 300M-parameter model ({SIZES['large']}) for the memory comparison",
    )
    parser.add_argument(
        "--sweep-ours",
        action="store_true",
        help="run the candidate configurations of zero3_offload instead of the peers "
        f"({', '.join(SWEEP)}); writes peers-sweep*.json/md",
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {', '.join(SYSTEMS)} (or of the sweep's keys)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of all systems (default 3; quick 2; large 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model seed (default 0)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default 900; large 3600)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs, per-rank results)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set MALLOC_MMAP_THRESHOLD_=BYTES in every rank of every system (glibc then "
        "returns freed blocks of that size or more to the OS; `zero3-offload train` sets "
        "1048576); the output name gets '-mmap'",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="diagnostics: run rank 0 of every run under `py-spy record` (collapsed stacks "
        "in DIR/<system>-round<r>.txt); timings then include its sampling",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="diagnostics: zero3_offload ranks log JSON lines to DIR/<system>-round<r>/ "
        "for `zero3-offload analyze`",
    )
    add_common_args(parser, default_repeats=6)
    parser.set_defaults(warmup=None, repeats=None, threads=1)
    args = parser.parse_args(argv)
    args.size = "quick" if args.quick else "large" if args.large else "small"
    if args.quick and args.large:
        parser.error("--quick and --large exclude each other")
    defaults = {
        "quick": {"rounds": 2, "warmup": 1, "repeats": 5, "timeout": 300},
        "small": {"rounds": 3, "warmup": 2, "repeats": 6, "timeout": 900},
        "large": {"rounds": 1, "warmup": 1, "repeats": 4, "timeout": 3600},
    }[args.size]
    if args.rounds is None:
        args.rounds = defaults["rounds"]
    if args.warmup is None:
        args.warmup = defaults["warmup"]
    if args.timeout is None:
        args.timeout = defaults["timeout"]
    if args.repeats is None:
        args.repeats = defaults["repeats"]
    if args.rounds < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--rounds and --repeats must be >= 1, --warmup >= 0")
    if args.warmup + args.repeats < LOSS_CHECK_STEPS:
        parser.error(f"--warmup + --repeats must be >= {LOSS_CHECK_STEPS} (the loss check)")
    table = SWEEP if args.sweep_ours else SYSTEMS
    keys = args.systems.split(",") if args.systems else list(table)
    unknown = [k for k in keys if k not in table]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(table)}")
    args.system_keys = keys
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    info = machine_info()
    info["threads_per_rank"] = args.threads
    table = SWEEP if args.sweep_ours else SYSTEMS
    systems = {k: table[k] for k in args.system_keys}
    skipped: dict[str, str] = {}
    if any(s[1] == "deepspeed" for s in systems.values()):
        ok, msg = deepspeed_status()
        if ok:
            info["deepspeed_version"] = msg
        else:
            for k in [k for k, s in systems.items() if s[1] == "deepspeed"]:
                skipped[k] = msg
                del systems[k]
                print(f"SKIPPED {table[k][0]}: {msg}", flush=True)
    dims = SIZES[args.size]
    model = make_model(dims, args.seed)
    n_params, per_layer = count_params(model)
    del model
    common = {
        "dims": dims,
        "global_batch": dims["global_batch"],
        "seed": args.seed,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "warmup": args.warmup,
        "steps": args.repeats,
    }
    print(f"machine: {machine_line(info)}", flush=True)
    print(
        f"GPT {dims}: {n_params:,} params in {len(per_layer)} layers; {args.rounds} rounds x "
        f"{len(systems)} systems x ({args.warmup} warm-up + {args.repeats} timed steps)",
        flush=True,
    )
    if args.py_spy:
        if shutil.which("py-spy") is None:
            print("--py-spy needs py-spy on PATH (pip install py-spy)")
            return 1
        args.py_spy.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="compare_peers-"))
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    keys = list(systems)
    failed: set[str] = set()
    try:
        for r in range(args.rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            for key in order:
                if key in failed:
                    continue
                run = launch(
                    key,
                    systems[key],
                    common,
                    workdir / f"round{r}-{key}",
                    threads=args.threads,
                    timeout_s=args.timeout,
                    py_spy_out=args.py_spy / f"{key}-round{r}.txt" if args.py_spy else None,
                    log_dir=args.log_dir / f"{key}-round{r}" if args.log_dir else None,
                    mmap_threshold=args.mmap_threshold,
                )
                run["round"] = r
                run["warmup"] = args.warmup
                runs.append(run)
                if run["ok"]:
                    med = statistics.median(
                        x["step_s"] for rk in run["ranks"] for x in rk["steps"][args.warmup :]
                    )
                    rss = max(rk["peak_rss_bytes"] for rk in run["ranks"]) / MIB
                    print(
                        f"round {r} {key:>14}: median step {med:.3f} s, peak RSS/rank "
                        f"{rss:,.0f} MiB, losses {[round(v, 4) for v in _global_losses(run)[:5]]}"
                        f" (run {run['wall_s']:.0f} s)",
                        flush=True,
                    )
                else:
                    failed.add(key)
                    print(f"round {r} {key:>14}: FAILED: {run['error']}", flush=True)
                    for rank, tail in run["log_tails"].items():
                        print(f"  rank {rank} log tail:", *tail, sep="\n    ", flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    total_wall = time.perf_counter() - started
    for key in failed:
        skipped.setdefault(key, next(r["error"] for r in runs if r["key"] == key and not r["ok"]))
    summary = summarize(systems, runs, args.warmup)
    if not summary:
        print("no system produced a result")
        return 1
    tables_md, agreement = render(summary, runs, args.rounds, args.warmup + args.repeats)

    notes = [
        f"Model: GPT (`benchmarks/_peers_model.py`) d={dims['d']}, {dims['heads']} heads, "
        f"{dims['n_layers']} blocks, seq {dims['seq']}, byte vocabulary 256: {n_params:,} fp32 "
        f"params in {len(per_layer)} layers (largest {max(per_layer.values()):,}); global batch "
        f"{dims['global_batch']}, split evenly over the ranks; seed {args.seed} for every system.",
        "Data: windows of the Python stdlib's top-level *.py bytes (sha256 "
        f"{corpus_info()['sha256'][:12]}), the same batches for every system.",
        f"AdamW lr {LR}, betas (0.9, 0.999), eps 1e-8, weight decay {WEIGHT_DECAY}, fp32. "
        "torch and FSDP2: torch.optim.AdamW(fused=True); DeepSpeed: its DeepSpeedCPUAdam "
        "(gradient_clipping set to 0: DeepSpeed's default is 1.0); zero3_offload: torch's fused "
        "AdamW kernel per layer shard.",
        f"Each run: fresh processes, {args.warmup} warm-up + {args.repeats} timed steps; "
        f"{args.rounds} rounds, the order rotated each round. Median step = median over every "
        "timed step of every rank and run; phases: forward + loss, backward (ours with the lr "
        "passed includes the overlapped updates), optimizer step.",
        "vs FSDP2 / vs torch = this system's figure / that system's (<1: faster or smaller).",
        "best run step s: the smallest per-run median step (the least disturbed run).",
        "CPU s / step: CPU time (time.process_time, all threads) of every rank's process during "
        "a step, summed over the ranks; median over timed steps and runs. Other work on the "
        "machine inflates wall time much more than this.",
        "Peak RSS / rank: VmHWM of /proc/self/status at the end of a run, max over ranks, median "
        "over runs (file-backed and shared pages count). RSS after import: VmRSS once torch and "
        "the system's package are imported, before the model is built.",
        "Model state / rank: bytes of the distinct storages behind parameters (compute copies "
        "and fp32 masters), gradients and optimizer state after the last step, as each system "
        "exposes them (zero3_offload: get_memory_stats().model_state_bytes()).",
        f"Losses agree with {agreement['reference']} within {LOSS_TOLERANCE:g} for the first "
        f"{LOSS_CHECK_STEPS} steps: {agreement['agree']} (max |diff| {agreement['max_diff']:.2e}).",
        "glibc malloc: "
        + (
            f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold} in every rank of every system."
            if args.mmap_threshold is not None
            else "defaults (dynamic mmap threshold, up to 32 MiB) in every process."
        ),
        *[f"SKIPPED {table[k][0]}: {msg}" for k, msg in skipped.items()],
        f"whole benchmark {total_wall:.0f} s wall.",
    ]
    print()
    print(tables_md)
    print()
    for n in notes:
        print(f"- {n}")

    name = "peers-sweep" if args.sweep_ours else "peers"
    if args.size != "small":
        name += f"-{args.size}"
    if args.mmap_threshold is not None:
        name += "-mmap"
    payload = {
        "benchmark": name,
        "size": args.size,
        "machine": info,
        "config": {
            **common,
            "params": n_params,
            "layer_params": per_layer,
            "world_size": WORLD,
            "threads_per_rank": args.threads,
            "rounds": args.rounds,
            "malloc_mmap_threshold": args.mmap_threshold,
            "corpus": corpus_info(),
            "systems": {
                k: {"label": v[0], "kind": v[1], "world": v[2], "options": v[3]}
                for k, v in systems.items()
            },
        },
        "skipped": skipped,
        "loss_agreement": agreement,
        "summary": summary,
        "runs": runs,
        "total_wall_s": total_wall,
    }
    out = args.out or RESULTS_DIR / f"{name}.json"
    json_path, md_path = write_results(
        out,
        payload,
        tables_md,
        title=f"zero3_offload vs peers ({args.size} model, same model, data and seed)",
        notes=notes,
    )
    print(f"\nwrote {json_path} and {md_path}")
    return 0 if agreement["agree"] else 2


if __name__ == "__main__":
    raise SystemExit(main())
