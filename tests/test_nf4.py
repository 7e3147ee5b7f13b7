"""NF4 (QLoRA's 4-bit NormalFloat, blocks of 64, absmax scales): the codec format and the
public pure functions, against the NF4 table and an independent per-block reference."""

from __future__ import annotations

import concurrent.futures
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero3_offload import Zero3CpuOffloadConfig
from zero3_offload.config import CpuCompressionMethod as M
from zero3_offload.errors import ConfigError, InputError
from zero3_offload.parameter.codec import CompressedShard, ShardCodec
from zero3_offload.parameter.nf4 import (
    NF4_BLOCK,
    NF4_CODE,
    nf4_dequantize,
    nf4_nbytes,
    nf4_quantize,
    nf4_roundtrip,
    nf4_split,
)

CPU = torch.device("cpu")
CODE = torch.tensor(NF4_CODE, dtype=torch.float64)
# The largest distance from a value in [-1, 1] to its nearest code: half the widest gap.
HALF_GAP = max(b - a for a, b in itertools.pairwise(NF4_CODE)) / 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def encoded(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> CompressedShard:
    codec = ShardCodec(M.NF4, dtype)
    shard = codec.empty(x.numel(), device=CPU)
    codec.encode_(x, shard)
    return shard


def indices(shard: CompressedShard) -> torch.Tensor:
    """The shard's 4-bit indices, element order (high nibble first)."""
    pairs = torch.stack([shard.payload >> 4, shard.payload & 15], dim=1).reshape(-1)
    return pairs[: shard.numel].long()


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, indices) by the definition, independently of the codec: absmax per block
    of 64 from the first element, the nearest code of x / absmax (ties to the lower one)."""
    blocks = -(-x.numel() // NF4_BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * NF4_BLOCK - x.numel())).view(blocks, -1)
    scales = padded.abs().amax(1)
    normalized = (padded / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)).double()
    distance = (normalized.unsqueeze(-1) - CODE).abs()
    return scales, distance.argmin(-1).reshape(-1)[: x.numel()]  # argmin: the first of ties


def test_the_code_is_bitsandbytes_nf4_table() -> None:
    assert len(NF4_CODE) == 16 and list(NF4_CODE) == sorted(NF4_CODE)
    assert NF4_CODE[0] == -1.0 and NF4_CODE[-1] == 1.0 and NF4_CODE[7] == 0.0
    assert NF4_CODE[14] == 0.7229568362236023 and NF4_CODE[1] == -0.6961928009986877


def test_known_values_encode_to_their_index_and_decode_exactly() -> None:
    # Every code value times a power-of-two absmax, in a scrambled order: exact in fp32.
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    block = torch.cat([order, order.flip(0), order, order.flip(0)])  # 64 indices
    x = CODE[block].float() * 4.0
    shard = encoded(x)
    assert shard.scales.tolist() == [4.0]
    assert torch.equal(indices(shard), block)
    # Two indices per byte, the first element in the high nibble; scales first.
    assert shard.payload[0].item() == (block[0].item() << 4) | block[1].item()
    assert torch.equal(shard.wire()[:4].view(torch.float32), torch.tensor([4.0]))
    assert torch.equal(ShardCodec(M.NF4, torch.float32).decode(shard), x)


def test_a_value_on_a_midpoint_takes_the_lower_code() -> None:
    mids = [(a + b) / 2 for a, b in itertools.pairwise(NF4_CODE)]
    on = torch.tensor([1.0, *mids], dtype=torch.float64).float()  # absmax 1: x / 1 == x
    got = indices(encoded(on))[1:]
    assert got.tolist() == list(range(15))
    above = torch.nextafter(on, torch.tensor(2.0))
    above[0] = 1.0
    assert indices(encoded(above))[1:].tolist() == list(range(1, 16))


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 3000),
    scale=st.floats(1e-6, 1e4),
    seed=st.integers(0, 2**31),
)
def test_error_is_within_half_the_widest_code_gap(numel: int, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * scale
    x[:: max(1, numel // 5)] = 0.0
    shard = encoded(x)
    assert shard.nbytes() == -(-numel // 2) + 4 * -(-numel // NF4_BLOCK)
    y = ShardCodec(M.NF4, torch.float32).decode(shard)
    blocks = -(-numel // NF4_BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * NF4_BLOCK - numel))
    absmax = padded.view(blocks, -1).abs().amax(1).repeat_interleave(NF4_BLOCK)[:numel]
    # Exact arithmetic bound, plus a few ulps of absmax for x / absmax and code * absmax.
    assert torch.all((x - y).abs() <= absmax * (HALF_GAP + 2**-22))
    assert torch.all(y[x == 0] == 0)
    # The nearest code, by an independent computation (ties aside: within an ulp).
    scales, _ = reference(x)
    normalized = (x / absmax.clamp(min=torch.finfo(torch.float32).tiny)).double()
    chosen = (normalized - CODE[indices(shard)]).abs()
    nearest = (normalized.unsqueeze(-1) - CODE).abs().amin(-1)
    assert torch.all(chosen <= nearest + 1e-7)
    assert torch.equal(shard.scales, scales)


def test_several_chunks_and_a_short_last_block_match_the_reference() -> None:
    # More than one encoding chunk (2^20 elements), a last block of 3, an odd count.
    x = torch.randn((1 << 20) + 131, generator=torch.Generator().manual_seed(1))
    shard = encoded(x)
    scales, idx = reference(x)
    assert torch.equal(shard.scales, scales)
    assert torch.equal(indices(shard), idx)
    # The odd element's byte: its index high, the code of 0 (7) as the padding nibble.
    assert shard.payload[-1].item() & 15 == 7
    y = ShardCodec(M.NF4, torch.float32).decode(shard)
    expected = CODE[idx].float() * scales.repeat_interleave(NF4_BLOCK)[: x.numel()]
    assert torch.equal(y, expected)


@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 127, 128, 1000, 4097])
def test_byte_counts_are_the_true_compressed_bytes(numel: int) -> None:
    codec = ShardCodec(M.NF4, torch.bfloat16, block_size=256)  # NF4's block stays 64
    shard = codec.empty(numel, device=CPU)
    expected = math.ceil(numel / 2) + 4 * math.ceil(numel / 64)
    assert codec.block_size == NF4_BLOCK
    assert codec.wire_nbytes(numel) == nf4_nbytes(numel) == expected
    assert shard.nbytes() == expected == shard.wire().numel()
    assert shard.payload.dtype == torch.uint8 and shard.payload.numel() == math.ceil(numel / 2)
    assert shard.scales is not None and shard.scales.numel() == math.ceil(numel / 64)
    assert shard.numel == numel
    # Views of the one buffer (scales first).
    assert shard.packed is not None
    assert shard.scales.data_ptr() == shard.packed.data_ptr()
    assert shard.payload.data_ptr() == shard.packed.data_ptr() + 4 * math.ceil(numel / 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shard_numel", [64, 130, 257])
def test_gathered_decode_is_bitwise_the_per_shard_decode(
    dtype: torch.dtype, shard_numel: int
) -> None:
    # 130 and 257 elements: each rank's part is not a multiple of 4 bytes long, so the
    # scales of ranks 1, 2 start unaligned in the gathered buffer.
    world = 3
    codec = ShardCodec(M.NF4, dtype)
    g = torch.Generator().manual_seed(shard_numel)
    shards = []
    for _ in range(world):
        shard = codec.empty(shard_numel, device=CPU)
        codec.encode_(torch.randn(shard_numel, generator=g), shard)
        shards.append(shard)
    wire = torch.cat([s.wire() for s in shards])
    assert wire.numel() == world * codec.wire_nbytes(shard_numel)
    out = torch.empty(world * shard_numel, dtype=dtype)
    codec.decode_gathered_(wire, out, world_size=world)
    assert torch.equal(out, torch.cat([codec.decode(s) for s in shards]))


@pytest.mark.parametrize("numel", [64 * 5, 1001])
def test_encoding_the_decoded_values_gives_the_same_bytes(numel: int) -> None:
    codec = ShardCodec(M.NF4, torch.float32)
    first = encoded(torch.randn(numel, generator=torch.Generator().manual_seed(2)) * 3)
    again = encoded(codec.decode(first))
    assert torch.equal(first.wire(), again.wire())
    assert torch.equal(codec.decode(again), codec.decode(first))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_public_functions_equal_the_codec(dtype: torch.dtype) -> None:
    weight = torch.randn(48, 37, generator=torch.Generator().manual_seed(3))  # 1776: odd blocks
    codec = ShardCodec(M.NF4, dtype)
    shard = encoded(weight.reshape(-1), dtype)
    packed = nf4_quantize(weight)
    assert torch.equal(packed, shard.wire())
    decoded = nf4_dequantize(packed, weight.numel(), dtype=dtype)
    assert decoded.dtype == dtype and torch.equal(decoded, codec.decode(shard))
    rounded = nf4_roundtrip(weight, dtype=dtype)
    assert rounded.shape == weight.shape and torch.equal(rounded.reshape(-1), decoded)
    assert nf4_roundtrip(weight.to(dtype)).dtype == dtype  # default: the input's dtype
    assert not torch.equal(rounded.float(), weight), "a 4-bit code that changed nothing"
    # A parameter's roundtrip is what its shards give when they start at block bounds.
    halves = weight.reshape(-1).split(64 * 14)
    assert torch.equal(torch.cat([nf4_roundtrip(h, dtype=dtype) for h in halves]), decoded)


def test_an_all_zero_block_stays_zero() -> None:
    x = torch.zeros(130)
    x[64:] = torch.linspace(-2, 2, 66)
    shard = encoded(x)
    assert shard.scales[0].item() == 0.0 and torch.all(indices(shard)[:64] == 7)
    assert torch.equal(ShardCodec(M.NF4, torch.float32).decode(shard)[:64], x[:64])


def test_worker_threads_encode_at_once_with_the_results_of_one() -> None:
    tensors = [torch.randn(50_000, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    alone = [nf4_quantize(t) for t in tensors]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        together = list(pool.map(nf4_quantize, tensors))
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def test_bad_input_is_refused() -> None:
    with pytest.raises(InputError, match="1D fp32"):
        encoded(torch.zeros(64, dtype=torch.float64))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="uint8"):
        nf4_split(torch.zeros(10, dtype=torch.uint8), 64)


def test_nf4_is_refused_for_trainable_compute_copies() -> None:
    with pytest.raises(ConfigError, match="frozen parameters"):
        Zero3CpuOffloadConfig(cpu_compression="nf4")
    assert M.parse("NF4") is M.NF4 and M.NF4.storage_dtype(torch.float32) == torch.uint8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoding_on_the_device_is_bitwise_the_cpu_decode(dtype: torch.dtype) -> None:
    x = torch.randn((1 << 20) + 77, generator=torch.Generator().manual_seed(4))
    codec = ShardCodec(M.NF4, dtype)
    shard = encoded(x, dtype)
    cuda = torch.device("cuda")
    on_device = shard.to(cuda)
    assert on_device.numel == shard.numel and on_device.packed is not None
    assert torch.equal(codec.decode(on_device).cpu(), codec.decode(shard))
    # Encoding on the device gives the same bytes as in a worker thread on the CPU.
    device_shard = codec.empty(x.numel(), device=cuda)
    codec.encode_(x.to(cuda), device_shard)
    assert torch.equal(device_shard.wire().cpu(), shard.wire())
