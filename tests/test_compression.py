"""Compression formats: real dtypes, real byte counts, bounded round-trip error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero3_offload.config import CpuCompressionMethod as M
from zero3_offload.parameter.codec import ShardCodec

CPU = torch.device("cpu")


def roundtrip(method: M, x: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, int]:
    codec = ShardCodec(method, torch.float32, block_size=block)
    shard = codec.empty(x.numel(), device=CPU)
    codec.encode_(x, shard)
    return codec.decode(shard), shard.nbytes()


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 3000),
    block=st.sampled_from([1, 7, 64, 256]),
    scale=st.floats(1e-6, 1e4),
    seed=st.integers(0, 2**31),
)
def test_int8_error_within_absmax_over_254(numel: int, block: int, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * scale
    x[:: max(1, numel // 5)] = 0.0  # zeros, and with block 1 all-zero blocks
    y, nbytes = roundtrip(M.INT8, x, block)
    blocks = -(-numel // block)
    assert nbytes == numel * 1 + blocks * 4
    padded = torch.nn.functional.pad(x, (0, blocks * block - numel))
    absmax = padded.view(blocks, block).abs().amax(1).repeat_interleave(block)[:numel]
    # absmax/254 is the bound in exact arithmetic; computing scale = absmax/127,
    # x/scale and q*scale in float32 adds a few ulps of absmax (2**-24 each).
    assert torch.all((x - y).abs() <= absmax / 254 + absmax * 2**-22)
    assert torch.all(y[x == 0] == 0)


@pytest.mark.parametrize(
    ("method", "dtype", "rel"), [(M.FP16, torch.float16, 2**-11), (M.BF16, torch.bfloat16, 2**-8)]
)
def test_half_formats(method: M, dtype: torch.dtype, rel: float) -> None:
    x = torch.randn(1001) * 3
    codec = ShardCodec(method, torch.float32)
    shard = codec.empty(x.numel(), device=CPU)
    assert shard.payload.dtype == dtype and shard.scales is None
    codec.encode_(x, shard)
    assert shard.nbytes() == 2 * x.numel()
    y = codec.decode(shard)
    # Round to nearest: relative error at most half an ulp of the format.
    assert torch.all((x - y).abs() <= x.abs() * rel)
    assert not torch.equal(x, y), "a lossy format that changed nothing tests nothing"


def test_none_keeps_compute_dtype() -> None:
    x = torch.randn(100)
    assert ShardCodec(M.NONE, torch.float32).is_identity
    codec = ShardCodec(M.NONE, torch.bfloat16)
    shard = codec.empty(100, device=CPU)
    codec.encode_(x, shard)
    assert shard.payload.dtype == torch.bfloat16 and shard.nbytes() == 200
    assert torch.equal(codec.decode(shard), x.to(torch.bfloat16))


def test_int8_decodes_into_bf16_compute() -> None:
    x = torch.randn(300)
    codec = ShardCodec(M.INT8, torch.bfloat16, block_size=64)
    shard = codec.empty(300, device=CPU)
    codec.encode_(x, shard)
    y = codec.decode(shard)
    assert y.dtype == torch.bfloat16
    assert (y.float() - x).abs().max() <= x.abs().max() / 254 + x.abs().max() * 2**-8
