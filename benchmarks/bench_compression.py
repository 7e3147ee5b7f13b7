"""Throughput, size and error of the compute-copy formats of ``ShardCodec``.

For each ``CpuCompressionMethod`` (NONE = fp32 -> fp32, FP16, BF16, INT8 with
per-block absmax scales) on one fp32 shard (64M elements by default, 256 MB):

- **compress**: ``codec.encode_(master, shard)`` into a ``CompressedShard``
  preallocated with ``codec.empty``;
- **decompress**: ``codec.decode_(shard, out)`` into a preallocated fp32 buffer;
- **baseline**: a plain ``out.copy_(master)`` of the same fp32 tensor.

GB/s is counted as fp32 *input* bytes per second (``numel * 4 / seconds``) in
both directions, so every row compares with the copy directly. Stored bytes
come from ``CompressedShard.nbytes()`` (payload + scales, counted from the
tensors). The round-trip error is ``max |x - decode(encode(x))|`` divided by
``max |x|``; for INT8 the per-block figure (error over the block's own absmax,
at most 1/254 by construction) is reported too.

All cases are interleaved round-robin, timed with ``time.perf_counter`` after
warm-up, median of the repeats (see ``_common.py``).

Run: ``python benchmarks/bench_compression.py`` (well under a minute) or with
``--quick`` (seconds). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from zero3_offload.config import CpuCompressionMethod
from zero3_offload.parameter.codec import CompressedShard, ShardCodec

try:
    from _common import (
        add_common_args,
        apply_threads,
        check_common_args,
        default_out,
        fmt,
        machine_info,
        machine_line,
        markdown_table,
        time_interleaved,
        write_results,
    )
except ModuleNotFoundError:  # run as ``python -m benchmarks.bench_compression``
    from benchmarks._common import (
        add_common_args,
        apply_threads,
        check_common_args,
        default_out,
        fmt,
        machine_info,
        machine_line,
        markdown_table,
        time_interleaved,
        write_results,
    )

NAME = "compression"
FORMATS = (
    CpuCompressionMethod.NONE,
    CpuCompressionMethod.FP16,
    CpuCompressionMethod.BF16,
    CpuCompressionMethod.INT8,
)
BASELINE = "fp32 copy_"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="ShardCodec compress/decompress throughput (GB/s of fp32 input) per format "
        "vs a plain fp32 copy_, stored bytes per format and round-trip error.",
    )
    parser.add_argument(
        "--elements",
        type=int,
        default=None,
        help="fp32 elements in the shard (default 64M = 256 MB; 1M with --quick)",
    )
    parser.add_argument(
        "--block-size", type=int, default=256, help="INT8 elements per scale (default 256)"
    )
    parser.add_argument(
        "--std",
        type=float,
        default=0.02,
        help="standard deviation of the normal test data (default 0.02, weight-like)",
    )
    add_common_args(parser, default_repeats=15)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.quick:
        args.elements = args.elements or 2**20
        args.repeats = min(args.repeats, 5)
        args.warmup = 1
    else:
        args.elements = args.elements or 64 * 2**20
    if args.elements < 1 or args.block_size < 1:
        parser.error("--elements and --block-size must be >= 1")
    return args


def _block_relative_error(x: torch.Tensor, xhat: torch.Tensor, block: int) -> float:
    """max over blocks of (max |x - xhat| in the block) / (the block's absmax)."""
    full = x.numel() // block * block
    worst = 0.0
    parts = []
    if full:
        parts.append((x[:full].view(-1, block), xhat[:full].view(-1, block)))
    if full < x.numel():
        parts.append((x[full:].view(1, -1), xhat[full:].view(1, -1)))
    for a, b in parts:
        err = (a - b).abs().amax(dim=1)
        absmax = a.abs().amax(dim=1)
        nz = absmax > 0
        if bool(nz.any()):
            worst = max(worst, float((err[nz] / absmax[nz]).max()))
        if not bool(nz.all()):  # an all-zero block must round-trip exactly
            assert float(err[~nz].max()) == 0.0
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_threads(args.threads)
    info = machine_info()
    print(f"machine: {machine_line(info)}", flush=True)

    numel = args.elements
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen).mul_(args.std)
    out = torch.empty_like(master)
    fp32_bytes = master.numel() * master.element_size()
    print(f"shard: {numel:,} fp32 elements ({fp32_bytes / 2**20:.0f} MiB)", flush=True)

    codecs: dict[CpuCompressionMethod, ShardCodec] = {}
    shards: dict[CpuCompressionMethod, CompressedShard] = {}
    for method in FORMATS:
        codec = ShardCodec(method, torch.float32, block_size=args.block_size)
        codecs[method] = codec
        shards[method] = codec.empty(numel, device=cpu)

    cases = {BASELINE: lambda: out.copy_(master)}
    for method in FORMATS:
        codec, shard = codecs[method], shards[method]
        cases[f"{method.name} encode"] = functools.partial(codec.encode_, master, shard)
        cases[f"{method.name} decode"] = functools.partial(codec.decode_, shard, out)
    timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)

    copy_s = timings[BASELINE].median
    copy_gbs = fp32_bytes / copy_s / 1e9
    absmax = float(master.abs().max())
    headers = [
        "format",
        "stored bytes",
        "ratio to fp32",
        "compress GB/s",
        "vs copy",
        "decompress GB/s",
        "vs copy",
        "max abs err / absmax",
    ]
    rows = [
        [
            f"{BASELINE} (baseline)",
            f"{fp32_bytes:,}",
            "1.000",
            fmt(copy_gbs),
            "1.00x",
            fmt(copy_gbs),
            "1.00x",
            "0",
        ]
    ]
    results = []
    for method in FORMATS:
        codec, shard = codecs[method], shards[method]
        enc, dec = timings[f"{method.name} encode"], timings[f"{method.name} decode"]
        # Round trip, outside the timed region.
        codec.encode_(master, shard)
        codec.decode_(shard, out)
        max_err = float((out - master).abs().max())
        rel_err = max_err / absmax if absmax > 0 else 0.0
        block_err = (
            _block_relative_error(master, out, args.block_size)
            if method is CpuCompressionMethod.INT8
            else None
        )
        stored = shard.nbytes()
        enc_gbs = fp32_bytes / enc.median / 1e9
        dec_gbs = fp32_bytes / dec.median / 1e9
        rows.append(
            [
                method.name,
                f"{stored:,}",
                f"{stored / fp32_bytes:.3f}",
                fmt(enc_gbs),
                f"{copy_s / enc.median:.2f}x",
                fmt(dec_gbs),
                f"{copy_s / dec.median:.2f}x",
                f"{rel_err:.2e}",
            ]
        )
        results.append(
            {
                "format": method.name,
                "storage_dtype": str(codec.storage_dtype),
                "stored_bytes": stored,
                "payload_bytes": shard.payload.numel() * shard.payload.element_size(),
                "scale_bytes": stored - shard.payload.numel() * shard.payload.element_size(),
                "ratio_to_fp32": stored / fp32_bytes,
                "encode": {"timing": enc.as_dict(), "fp32_gb_per_s": enc_gbs},
                "decode": {"timing": dec.as_dict(), "fp32_gb_per_s": dec_gbs},
                "encode_vs_copy": copy_s / enc.median,
                "decode_vs_copy": copy_s / dec.median,
                "max_abs_err": max_err,
                "max_abs_err_over_absmax": rel_err,
                "max_block_err_over_block_absmax": block_err,
            }
        )
    table = markdown_table(headers, rows)
    int8 = next(r for r in results if r["format"] == "INT8")
    notes = [
        f"{numel:,} fp32 elements ({fp32_bytes / 2**20:.0f} MiB), N(0, {args.std}^2) data, "
        f"absmax {absmax:.4g}; median of {args.repeats} repeats after {args.warmup} warm-up, "
        "cases interleaved.",
        "GB/s = fp32 input bytes (numel x 4) per second, both directions; 'vs copy' = copy_ time "
        "/ codec time (>1 is faster than the copy).",
        f"baseline copy_ median {copy_s * 1e3:.1f} ms = {fmt(copy_gbs)} GB/s of input "
        f"({fmt(2 * copy_gbs)} GB/s read+write).",
        f"INT8 block {args.block_size}: worst per-block error / block absmax "
        f"{int8['max_block_err_over_block_absmax']:.3e} (bound 1/254 = {1 / 254:.3e}).",
    ]
    print()
    print(table)
    print()
    for n in notes:
        print(f"- {n}")

    payload = {
        "benchmark": NAME,
        "quick": args.quick,
        "machine": info,
        "config": {
            "elements": numel,
            "fp32_bytes": fp32_bytes,
            "block_size": args.block_size,
            "data_std": args.std,
            "absmax": absmax,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "compute_dtype": "torch.float32",
        },
        "baseline": {
            "name": BASELINE,
            "timing": timings[BASELINE].as_dict(),
            "fp32_gb_per_s": copy_gbs,
        },
        "results": results,
        "table_markdown": table,
    }
    out_path: Path = args.out or default_out(NAME, args.quick)
    json_path, md_path = write_results(
        out_path, payload, table, title="ShardCodec compression", notes=notes
    )
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
