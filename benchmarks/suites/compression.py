"""ShardCodec throughput per compute-copy format (NONE, FP16, BF16, INT8) vs a plain fp32 copy_.

Encode and decode of one fp32 shard, interleaved with the copy; stored bytes and round-trip error.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from harness.plan import check_timing, time_interleaved
from harness.report import Report, cols, fmt, markdown_table

BASELINE = "fp32 copy_"

check = check_timing


OPTIONS = {
    "--elements": {"type": int, "help": "fp32 elements in the shard (64M; quick 1M)"},
    "--block-size": {"type": int, "default": 256, "help": "INT8 elements per scale (256)"},
    "--std": {"type": float, "default": 0.02, "help": "std of the normal data (0.02)"},
}
DEFAULTS = {"repeats": 15, "warmup": 2, "elements": 64 * 2**20}
QUICK, EPILOG = {"repeats": 5, "warmup": 1, "elements": 2**20}, None


def block_error(x: torch.Tensor, xhat: torch.Tensor, block: int) -> float:
    """Worst (max |x - xhat| in a block) / (the block's absmax) over the blocks."""
    pad = -x.numel() % block  # zeros: they change neither a block's error nor its absmax
    a, b = (torch.nn.functional.pad(t, (0, pad)).view(-1, block) for t in (x, xhat))
    err, absmax = (a - b).abs().amax(dim=1), a.abs().amax(dim=1)
    assert float(err[absmax == 0].sum()) == 0.0, "an all-zero block must round-trip exactly"
    return float((err[absmax > 0] / absmax[absmax > 0]).max())


def run(args: Any) -> dict[str, Any]:
    from zero3_offload.config import CpuCompressionMethod
    from zero3_offload.parameter.codec import ShardCodec

    numel = args.elements
    master = torch.randn(numel, generator=torch.Generator().manual_seed(0)).mul_(args.std)
    out = torch.empty_like(master)
    nbytes = numel * 4  # fp32
    block = args.block_size
    codecs = {m: ShardCodec(m, torch.float32, block_size=block) for m in CpuCompressionMethod}
    shards = {m: c.empty(numel, device=torch.device("cpu")) for m, c in codecs.items()}
    cases = {BASELINE: lambda: out.copy_(master)}
    for m, codec in codecs.items():
        cases[f"{m.name} encode"] = functools.partial(codec.encode_, master, shards[m])
        cases[f"{m.name} decode"] = functools.partial(codec.decode_, shards[m], out)
    timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)
    copy_s, absmax = timings[BASELINE]["median_s"], float(master.abs().max())
    results = []
    for m, codec in codecs.items():
        shard, (enc, dec) = shards[m], (timings[f"{m.name} {op}"] for op in ("encode", "decode"))
        codec.encode_(master, shard)  # the round trip, untimed
        codec.decode_(shard, out)
        err, payload_bytes = float((out - master).abs().max()), shard.payload.nbytes
        block_err = block_error(master, out, block) if m.name == "INT8" else None
        results.append(
            {
                "format": m.name,
                "storage_dtype": str(codec.storage_dtype),
                "stored_bytes": shard.nbytes(),
                "payload_bytes": payload_bytes,
                "scale_bytes": shard.nbytes() - payload_bytes,
                "ratio_to_fp32": shard.nbytes() / nbytes,
                "encode": {"timing": enc, "fp32_gb_per_s": nbytes / enc["median_s"] / 1e9},
                "decode": {"timing": dec, "fp32_gb_per_s": nbytes / dec["median_s"] / 1e9},
                "encode_vs_copy": copy_s / enc["median_s"],
                "decode_vs_copy": copy_s / dec["median_s"],
                "max_abs_err": err,
                "max_abs_err_over_absmax": err / absmax if absmax > 0 else 0.0,
                "max_block_err_over_block_absmax": block_err,
            }
        )
    config = {
        "elements": numel,
        "fp32_bytes": nbytes,
        "block_size": args.block_size,
        "data_std": args.std,
        "absmax": absmax,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "compute_dtype": "torch.float32",
    }
    copy_gbs = nbytes / copy_s / 1e9
    baseline = {"name": BASELINE, "timing": timings[BASELINE], "fp32_gb_per_s": copy_gbs}
    return {"config": config, "baseline": baseline, "results": results}


def report(payload: dict[str, Any]) -> Report:
    cfg, base = payload["config"], payload["baseline"]
    copy_gbs, n = base["fp32_gb_per_s"], cfg["fp32_bytes"]
    copy = fmt(copy_gbs)
    rows = [[f"{BASELINE} (baseline)", f"{n:,}", "1.000", copy, "1.00x", copy, "1.00x", "0"]]
    for r in payload["results"]:
        size = [f"{r['stored_bytes']:,}", f"{r['ratio_to_fp32']:.3f}"]
        encode = [fmt(r["encode"]["fp32_gb_per_s"]), f"{r['encode_vs_copy']:.2f}x"]
        decode = [fmt(r["decode"]["fp32_gb_per_s"]), f"{r['decode_vs_copy']:.2f}x"]
        rows.append([r["format"], *size, *encode, *decode, f"{r['max_abs_err_over_absmax']:.2e}"])
    headers = cols(
        "format; stored bytes; ratio to fp32; compress GB/s; vs copy; decompress GB/s; "
        "vs copy; max abs err / absmax"
    )
    int8 = next(r for r in payload["results"] if r["format"] == "INT8")
    notes = [
        f"{cfg['elements']:,} fp32 elements ({n / 2**20:.0f} MiB), N(0, {cfg['data_std']}^2) "
        f"data, absmax {cfg['absmax']:.4g}; median of {cfg['repeats']} repeats after "
        f"{cfg['warmup']} warm-up, cases interleaved.",
        "GB/s = fp32 input bytes (numel x 4) per second, both directions; 'vs copy' = copy_ "
        "time / codec time (>1 is faster than the copy).",
        f"baseline copy_ median {base['timing']['median_s'] * 1e3:.1f} ms = {fmt(copy_gbs)} "
        f"GB/s of input ({fmt(2 * copy_gbs)} GB/s read+write).",
        f"INT8 block {cfg['block_size']}: worst per-block error / block absmax "
        f"{int8['max_block_err_over_block_absmax']:.3e} (bound 1/254 = {1 / 254:.3e}).",
    ]
    return Report("ShardCodec compression", markdown_table(headers, rows), notes)
