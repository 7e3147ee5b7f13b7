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
  by less than the machine's noise (see ``benchmarks/README.md``);
- ``ours_ckpt``: ``ours_fast`` with ``activation_checkpointing=True`` (only
  layer inputs kept between the passes, each layer's forward recomputed in
  backward): the memory-lean configuration.

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
``zero3-offload train`` does). ``--render JSON`` rebuilds the markdown of an
earlier run from its results JSON without running anything. ``--help`` lists
the options.

The pieces: ``_peers_run.py`` (sizes, the systems, launching one run) and
``_peers_report.py`` (summaries, ratios, tables and notes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_common_args,
    add_rank_run_args,
    machine_info,
    machine_line,
    work_directory,
    write_results,
)
from _peers_model import corpus_info, count_params, make_model
from _peers_report import (
    LOSS_CHECK_STEPS,
    MIB,
    global_losses,
    notes_for,
    render,
    rerender,
    summarize,
    title_for,
)
from _peers_run import (
    LR,
    SIZES,
    SWEEP,
    SYSTEMS,
    WEIGHT_DECAY,
    WORLD,
    deepspeed_status,
    describe_systems,
    launch,
)

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
        "--blocks",
        type=int,
        default=None,
        metavar="N",
        help="transformer blocks instead of the size's own (e.g. --large --blocks 8: the "
        "large model's width at a third of its depth); the output name gets '-<N>blocks'",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default 900; large 3600)"
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
    add_rank_run_args(parser)
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
    if args.blocks is not None and args.blocks < 1:
        parser.error("--blocks must be >= 1")
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


def render_only(path: Path, out: Path | None) -> int:
    """``--render``: the markdown of the results JSON at ``path``, to ``out``'s .md or stdout."""
    payload = json.loads(path.read_text(encoding="utf-8"))
    md = rerender(payload, {k: v[0] for k, v in (SWEEP | SYSTEMS).items()})
    if out is None:
        print(md, end="")
        return 0
    md_path = out.with_suffix(".md")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(md, encoding="utf-8")
    print(f"wrote {md_path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        return render_only(args.render, args.out)
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
    dims = dict(SIZES[args.size])
    if args.blocks is not None:
        dims["n_layers"] = args.blocks
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
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    keys = list(systems)
    failed: set[str] = set()
    with work_directory("compare_peers-", keep=args.keep) as workdir:
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
                        f"{rss:,.0f} MiB, losses {[round(v, 4) for v in global_losses(run)[:5]]}"
                        f" (run {run['wall_s']:.0f} s)",
                        flush=True,
                    )
                else:
                    failed.add(key)
                    print(f"round {r} {key:>14}: FAILED: {run['error']}", flush=True)
                    for rank, tail in run["log_tails"].items():
                        print(f"  rank {rank} log tail:", *tail, sep="\n    ", flush=True)
    total_wall = time.perf_counter() - started
    for key in failed:
        skipped.setdefault(key, next(r["error"] for r in runs if r["key"] == key and not r["ok"]))
    summary = summarize(systems, runs, args.warmup)
    if not summary:
        print("no system produced a result")
        return 1
    tables_md, agreement = render(summary, runs, args.rounds, args.warmup + args.repeats)

    name = "peers-sweep" if args.sweep_ours else "peers"
    if args.size != "small":
        name += f"-{args.size}"
    if args.blocks is not None:
        name += f"-{args.blocks}blocks"
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
            "systems": describe_systems(systems),
        },
        "skipped": skipped,
        "loss_agreement": agreement,
        "summary": summary,
        "runs": runs,
        "total_wall_s": total_wall,
    }
    notes = notes_for(payload, {k: v[0] for k, v in table.items()})
    print()
    print(tables_md)
    print()
    for n in notes:
        print(f"- {n}")

    out = args.out or RESULTS_DIR / f"{name}.json"
    json_path, md_path = write_results(
        out,
        payload,
        tables_md,
        title=title_for(args.size),
        notes=notes,
    )
    print(f"\nwrote {json_path} and {md_path}")
    return 0 if agreement["agree"] else 2


if __name__ == "__main__":
    raise SystemExit(main())
