"""ShardCodec throughput per compute-copy format (NONE, FP16, BF16, INT8) vs a plain fp32 copy_.

Encode and decode of one fp32 shard, interleaved; stored bytes and round-trip error."""

from __future__ import annotations

import functools
from typing import Any

import torch
from harness.render import Col
from harness.sampler import check_timing, time_interleaved

from zero3_offload.config import CpuCompressionMethod
from zero3_offload.parameter.codec import ShardCodec

check = check_timing
OPTIONS = {
    "--elements": {"type": int, "help": "fp32 elements in the shard (64M; quick 1M)"},
    "--block-size": {"type": int, "default": 256, "help": "INT8 elements per scale (256)"},
    "--std": {"type": float, "default": 0.02, "help": "std of the normal data (0.02)"},
}
DEFAULTS = {"repeats": 15, "warmup": 2, "elements": 64 * 2**20}
QUICK = {"repeats": 5, "warmup": 1, "elements": 2**20}
TITLE = "ShardCodec compression"
# fmt: off
LAYOUT = [([
    Col("format", "format"), Col("stored bytes", "stored_bytes", ","),
    Col("ratio to fp32", "ratio_to_fp32", ".3f"), Col("compress GB/s", "encode_gbs", "sig"),
    Col("vs copy", "{encode_vs_copy:.2f}x"), Col("decompress GB/s", "decode_gbs", "sig"),
    Col("vs copy", "{decode_vs_copy:.2f}x"), Col("max abs err / absmax", "err", ".2e"),
], "rows")]
NOTES = [
    "{config[elements]:,} fp32 elements ({mib:.0f} MiB), N(0, {config[data_std]}^2) data, absmax "
    "{config[absmax]:.4g}; median of {config[repeats]} repeats after {config[warmup]} warm-up, "
    "cases interleaved.",
    "baseline copy_ median {copy_ms:.1f} ms = {copy_gbs:sig} GB/s of input ({copy_gbs2:sig} GB/s "
    "read+write).",
    "INT8 block {config[block_size]}: worst per-block error / block absmax {int8_block_err:.3e} "
    "(bound 1/254 = {bound:.3e}).",
]
# fmt: on


def block_error(x: torch.Tensor, xhat: torch.Tensor, block: int) -> float:
    """Worst (max |x - xhat| in a block) / (the block's absmax) over the blocks."""
    pad = -x.numel() % block  # zeros: they change neither a block's error nor its absmax
    a, b = (torch.nn.functional.pad(t, (0, pad)).view(-1, block) for t in (x, xhat))
    err, absmax = (a - b).abs().amax(dim=1), a.abs().amax(dim=1)
    assert float(err[absmax == 0].sum()) == 0.0, "an all-zero block must round-trip exactly"
    return float((err[absmax > 0] / absmax[absmax > 0]).max())


def run(args: Any) -> dict[str, Any]:
    numel, block = args.elements, args.block_size
    master = torch.randn(numel, generator=torch.Generator().manual_seed(0)).mul_(args.std)
    out, nbytes = torch.empty_like(master), numel * 4  # fp32
    codecs = {m: ShardCodec(m, torch.float32, block_size=block) for m in CpuCompressionMethod}
    shards = {m: c.empty(numel, device=torch.device("cpu")) for m, c in codecs.items()}
    cases = {"copy": lambda: out.copy_(master)}
    for m, codec in codecs.items():
        cases[f"{m.name} encode"] = functools.partial(codec.encode_, master, shards[m])
        cases[f"{m.name} decode"] = functools.partial(codec.decode_, shards[m], out)
    timings = time_interleaved(cases, warmup=args.warmup, repeats=args.repeats)
    copy_s, absmax = timings["copy"], float(master.abs().max())
    rows = [{"format": "fp32 copy_ (baseline)", "stored_bytes": nbytes, "ratio_to_fp32": 1.0}]
    gbs, payload = nbytes / copy_s / 1e9, {}
    rows[0].update(encode_vs_copy=1.0, decode_vs_copy=1.0, err="0", encode_gbs=gbs, decode_gbs=gbs)
    for m, codec in codecs.items():
        codec.encode_(master, shards[m])  # the round trip, untimed
        codec.decode_(shards[m], out)
        enc, dec = (timings[f"{m.name} {op}"] for op in ("encode", "decode"))
        stored = shards[m].nbytes()
        rows.append({"format": m.name, "stored_bytes": stored, "ratio_to_fp32": stored / nbytes})
        rows[-1].update(encode_gbs=nbytes / enc / 1e9, decode_gbs=nbytes / dec / 1e9)
        rows[-1].update(encode_vs_copy=copy_s / enc, decode_vs_copy=copy_s / dec)
        rows[-1]["err"] = float((out - master).abs().max()) / absmax
        if m.name == "INT8":
            payload["int8_block_err"] = block_error(master, out, block)
    config = {"elements": numel, "block_size": block, "data_std": args.std, "absmax": absmax}
    config.update(repeats=args.repeats, warmup=args.warmup, compute_dtype="torch.float32")
    payload.update(mib=nbytes / 2**20, copy_ms=1e3 * copy_s, copy_gbs=gbs, copy_gbs2=2 * gbs)
    payload["bound"] = 1 / 254
    return {"config": config, "rows": rows, **payload}
