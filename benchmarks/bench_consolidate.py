"""Peak memory and wall time of consolidating a sharded checkpoint into one file.

A model of ~285 MB fp32 (8 ``nn.Linear`` of widths 2048..4096 and 2
``nn.LayerNorm``, 10 layers; the largest parameter is one 4096 x 4096 weight,
64 MiB) is saved with ``Zero3CpuOffloadManager.save_checkpoint`` on 2 gloo
ranks (``zero3_offload.testing.run_ranks``) right after construction. Then
each case runs in its own fresh interpreter, so every peak is one process's:

- **baseline**: the process only imports torch, safetensors and zero3_offload
  (what every other case pays before it starts);
- **consolidate -> safetensors**: ``consolidate_checkpoint(ckpt, out.safetensors)``,
  streamed tensor by tensor;
- **consolidate -> pt**: ``consolidate_checkpoint(ckpt, out.pt, fmt="pt")``,
  which assembles the whole state dict before ``torch.save``;
- **naive load_file (mmap) + read all**: ``safetensors.torch.load_file`` of
  the consolidated file, then every tensor summed once (a full load, for
  reference). safetensors 0.8 maps the file (``backend="mmap"``, its default)
  and hands out tensors over the mapping, so ``load_file`` alone reads
  nothing (~1 ms, +3 MiB); summing makes every page resident;
- **naive load_file (pread)**: ``load_file(..., backend="pread")``, which
  reads the file into ordinary (anonymous) memory (skipped with a safetensors
  that has no ``backend`` argument).

Memory, per process:

- peak RSS: ``VmHWM`` of ``/proc/self/status``, read by the child at its end
  (the kernel's high-water mark of this process's resident memory). Not
  ``ru_maxrss``: Linux carries the high-water mark of the image before
  ``exec`` into it, so a child's ``ru_maxrss`` is never below the parent's peak
  at the fork (it read 305.7 MiB for every case of a tiny model, the parent's
  figure; the JSON keeps it as ``ru_maxrss_bytes``). Resident memory counts
  file pages mapped into the process as well as anonymous memory;
- peak anonymous RSS: ``RssAnon`` of ``/proc/<pid>/status``, sampled by the
  parent every ~2 ms while the child runs (there is no kernel high-water mark
  for it, so a spike shorter than that could be missed). This is the memory
  that has to exist; mapped clean file pages can be dropped under pressure.

Both are reported minus the baseline's (the median over its runs) and divided
by the model's bytes and by the largest tensor's bytes. Wall time is
``time.perf_counter`` around the call alone (interpreter start and imports are
not in it); the safetensors path ends with an ``fsync`` of its output (timed
on its own too, by wrapping ``os.fsync`` in the child), ``torch.save`` does
not fsync. The checkpoint and outputs were just written,
so they are read from the page cache.

Cases run interleaved (baseline, safetensors, pt, naive, naive pread, baseline, ...):
``--warmup`` untimed rounds, then ``--repeats`` rounds; medians are reported
(every sample is in the JSON). Correctness is checked in separate processes
afterwards: the consolidated safetensors file (via ``load_file``) and the
``.pt`` file (via ``torch.load(weights_only=True)``) must hold exactly the
model's state-dict names, shapes and dtypes, load ``strict=True`` into the
model class, and every tensor's SHA-256 must equal that of the model the
ranks were built from (hashed on rank 0 before the manager took it over).

Run: ``python benchmarks/bench_consolidate.py`` (about a minute and a half here) or with
``--quick`` (a tiny model, seconds). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import safetensors
import torch

import zero3_offload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _consolidate_cases import (
    CASES,
    FULL_WIDTHS,
    LN_AFTER,
    PT_FILE,
    QUICK_WIDTHS,
    SAMPLE_INTERVAL_S,
    SEED,
    ST_FILE,
    WORLD,
    child_main,
    make_model,
    run_child,
    save_rank,
    verify_main,
)

NAME = "consolidate"
MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model (~0.4 MB), finishes in seconds"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="measured rounds of all cases (default 5; 1)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds first (default 1; quick 0)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads in the measured processes (default: torch's setting)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/consolidate.json, consolidate-quick.json "
        "with --quick); a .md table is written beside it",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the checkpoint and outputs go (a fresh temporary directory under it; "
        "default: the system's temp dir); removed at the end",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    # Internal: the measured child processes.
    parser.add_argument("--child", choices=sorted(CASES.values()), help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--widths", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.ckpt, args.work, args.threads)
        return 0
    if args.verify:
        verify_main(args.work, json.loads(args.widths))
        return 0

    import asyncio
    import shutil
    import tempfile

    from _common import default_out, machine_info, machine_line, write_results
    from _consolidate_report import make_notes, summarize

    from zero3_offload.testing import run_ranks

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # machine info then shows the children's setting
    info = machine_info()
    print(f"machine: {machine_line(info)}", flush=True)
    widths = QUICK_WIDTHS if args.quick else FULL_WIDTHS
    started = time.perf_counter()

    with torch.device("meta"):  # sizes only
        meta_model = make_model(widths, SEED)
    sizes = {n: p.numel() * p.element_size() for n, p in meta_model.state_dict().items()}
    model_bytes = sum(sizes.values())
    largest_name = max(sizes, key=sizes.__getitem__)
    largest = sizes[largest_name]
    n_layers = len(list(meta_model.children()))
    print(
        f"model: {n_layers} layers, {len(sizes)} tensors, {model_bytes:,} bytes "
        f"({_mib(model_bytes)} MiB) fp32; largest {largest_name} {largest:,} bytes "
        f"({_mib(largest)} MiB)",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="bench-consolidate-", dir=args.workdir))
    try:
        root = work / "ckpt"
        t0 = time.perf_counter()
        ranks = asyncio.run(
            run_ranks(save_rank, WORLD, {"widths": list(widths), "seed": SEED, "root": str(root)})
        )
        build_s = time.perf_counter() - t0
        ckpt_dir = Path(ranks[0]["path"])
        ckpt_files = {p.name: p.stat().st_size for p in sorted(ckpt_dir.iterdir())}
        ref = ranks[0]["digests"]
        print(
            f"checkpoint: {ckpt_dir.name}, {sum(ckpt_files.values()):,} bytes in "
            f"{len(ckpt_files)} files; built in {build_s:.1f} s (save "
            f"{max(r['save_s'] for r in ranks):.2f} s)",
            flush=True,
        )

        rounds = []
        for r in range(args.warmup + args.repeats):
            measured = r >= args.warmup
            row = {}
            for label, case in CASES.items():
                row[label] = run_child(
                    ["--child", case, "--ckpt", str(root), "--work", str(work)]
                    + (["--threads", str(args.threads)] if args.threads else [])
                )
            rounds.append({"round": r, "warmup": not measured, "cases": row})
            print(
                f"round {r}{' (warm-up)' if not measured else ''}: "
                + ", ".join(
                    f"{label} {res['wall_s']:.2f} s / {_mib(res['peak_rss_bytes'])} MiB"
                    for label, res in row.items()
                ),
                flush=True,
            )

        out_sizes = {
            ST_FILE: (work / ST_FILE).stat().st_size,
            PT_FILE: (work / PT_FILE).stat().st_size,
        }
        verified = run_child(["--verify", "--work", str(work), "--widths", json.dumps(widths)])
        checks = {}
        for label in ("safetensors", "pt"):
            got = verified[label]
            checks[label] = {
                "same_names": sorted(got) == sorted(ref),
                "tensors_equal": sum(got.get(n) == d for n, d in ref.items()),
                "tensors": len(ref),
            }
        ok = all(c["same_names"] and c["tensors_equal"] == c["tensors"] for c in checks.values())
        print(f"verify: {checks} -> {'OK' if ok else 'MISMATCH'}", flush=True)
    finally:
        if args.keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    total_s = time.perf_counter() - started
    if not ok:
        print("consolidated output differs from the model: no results written", file=sys.stderr)
        return 1

    summary, table, base_rss, base_anon = summarize(rounds, model_bytes, largest)
    notes = make_notes(args, rounds, widths, n_layers, sizes, largest_name, ckpt_files, out_sizes)
    for note in notes:
        print(f"- {note}")
    print()
    print(table)

    payload = {
        "benchmark": NAME,
        "machine": info,
        "config": {
            "quick": args.quick,
            "world_size": WORLD,
            "widths": list(widths),
            "layernorm_after": list(LN_AFTER),
            "seed": SEED,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads": args.threads,
            "sample_interval_s": SAMPLE_INTERVAL_S,
            "zero3_offload_version": zero3_offload.__version__,
            "safetensors_version": safetensors.__version__,
            "manager_config": ranks[0]["config"],
        },
        "model": {
            "layers": n_layers,
            "tensors": len(sizes),
            "model_bytes": model_bytes,
            "largest_tensor": largest_name,
            "largest_tensor_bytes": largest,
            "tensor_bytes": sizes,
        },
        "checkpoint": {
            "files": ckpt_files,
            "build_s": build_s,
            "per_rank": [{k: v for k, v in r.items() if k != "digests"} for r in ranks],
        },
        "outputs_bytes": out_sizes,
        "baseline": {"peak_rss_bytes": base_rss, "peak_anon_bytes": base_anon},
        "summary": summary,
        "rounds": rounds,
        "verification": checks,
        "total_wall_s": total_s,
    }
    out = args.out or default_out(NAME, args.quick)
    json_path, md_path = write_results(
        out,
        payload,
        table,
        title=f"Checkpoint consolidation ({_mib(model_bytes)} MiB fp32 model, {WORLD} ranks)",
        notes=notes,
    )
    print(f"\nwrote {json_path} and {md_path} (total {total_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
