"""Frozen weights decoded at use: rows decoded by blocks == the whole decode, and the
replaced ``nn.Linear`` / ``nn.Embedding`` forwards == torch's on the decoded weight.

The scratch is made small here, so large weights go through the blocked paths (rows
decoded and computed a block at a time; an embedding's ids picked block by block).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload.config import CpuCompressionMethod
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.flat_layout import build_layouts
from zero3_offload.parameter.frozen_embedding import FrozenEmbeddingForward
from zero3_offload.parameter.frozen_linear import FrozenLinearForward
from zero3_offload.parameter.frozen_rows import FrozenRows
from zero3_offload.parameter.rank_mapping import Zero3RankMapping

METHODS = ["nf4", "int8", "bf16", "fp16"]
SHAPES = [(37, 40), (50, 64), (130, 7)]  # columns off and on NF4's 64-element blocks


def _frozen_unit(shape: tuple[int, int]) -> nn.Module:
    """A frozen module: a small vector first (the weight starts past it), then the weight."""
    unit = nn.Module()
    unit.first = nn.Parameter(torch.randn(11), requires_grad=False)
    unit.weight = nn.Parameter(torch.randn(*shape), requires_grad=False)
    return unit


def _wire(
    method: str, world: int, shape: tuple[int, int]
) -> tuple[ShardCodec, torch.Tensor, torch.Tensor, int, int]:
    """(codec, every rank's stored shard gathered, the whole decode of it, the weight's
    offset, the shard length) of ``_frozen_unit(shape)`` at ``world`` ranks."""
    codec = ShardCodec(CpuCompressionMethod.parse(method), torch.float32, block_size=16)
    unit = _frozen_unit(shape)
    mapping = Zero3RankMapping(rank=0, world_size=world)
    frozen = build_layouts({"u": unit}, mapping, frozen_align=codec.align)["u"].frozen
    assert frozen is not None
    flat = torch.zeros(frozen.padded_numel)
    for slot in frozen.slots:
        flat[slot.offset : slot.offset + slot.numel] = getattr(unit, slot.name).view(-1)
    shards = []
    for r in range(world):
        shard = codec.empty(frozen.shard_numel, device=torch.device("cpu"))
        codec.encode_(flat[r * frozen.shard_numel : (r + 1) * frozen.shard_numel], shard)
        shards.append(shard.wire().clone())
    wire = torch.cat(shards)
    whole = torch.empty(frozen.padded_numel)
    codec.decode_gathered_(wire, whole, world_size=world)
    offset = next(s.offset for s in frozen.slots if s.name == "weight")
    return codec, wire, whole, offset, frozen.shard_numel


def _rows(method: str, world: int, shape: tuple[int, int], scratch: int):
    codec, wire, whole, offset, shard = _wire(method, world, shape)
    rows = FrozenRows(
        layer="u",
        shape=shape,
        offset=offset,
        codec=codec,
        world_size=world,
        shard_numel=shard,
        wire={"u": wire}.__getitem__,
        scratch_elements=scratch,
    )
    weight = whole[offset : offset + shape[0] * shape[1]].view(shape)
    return rows, wire, weight


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_decoded_by_blocks_are_bitwise_the_whole_decode(
    method: str, world: int, shape: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    rows, wire, weight = _rows(method, world, shape, scratch=3 * shape[1])
    assert not rows.whole and len(list(rows.blocks())) > 1
    # Blocks start on the codec's blocks (NF4: 64 elements; INT8: block_size 16 here).
    align = {"nf4": 64, "int8": 16}.get(method, 1)
    assert all(first * shape[1] % align == 0 for first, _ in rows.blocks())
    for first, end in rows.blocks():
        assert torch.equal(rows.decode(wire, first, end), weight[first:end])
    # Any range of rows, also not on a block's start.
    assert torch.equal(rows.decode(wire, 1, shape[0]), weight[1:])


@pytest.mark.parametrize("method", ["nf4", "bf16"])
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("bias", [None, "frozen", "trainable"])
def test_linear_decoded_at_use_equals_torch_linear(
    method: str, world: int, blocked: bool, bias: str | None
) -> None:
    torch.manual_seed(0)
    shape = (37, 40)
    rows, _, weight = _rows(method, world, shape, scratch=8 * shape[1] if blocked else 1 << 20)
    assert rows.whole is not blocked
    linear = nn.Linear(shape[1], shape[0], bias=bias is not None)
    if linear.bias is not None:
        linear.bias.requires_grad_(bias == "trainable")
    forward = FrozenLinearForward(linear, rows)
    x = torch.randn(3, 5, shape[1], requires_grad=True)
    out = forward(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_b = None
    if linear.bias is not None:
        ref_b = linear.bias.detach().clone().requires_grad_(linear.bias.requires_grad)
    ref = F.linear(ref_x, weight, ref_b)
    # Whole: torch's own linear on the same values. Blocks: a matmul per block of
    # output rows, which may round differently in the last bits.
    tol = {"rtol": 1e-5, "atol": 1e-5} if blocked else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)
    if bias == "trainable":
        assert ref_b is not None
        torch.testing.assert_close(linear.bias.grad, ref_b.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["nf4", "int8", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("blocked", [False, True])
def test_embedding_decoded_at_use_equals_torch_embedding(
    method: str, world: int, blocked: bool
) -> None:
    torch.manual_seed(0)
    shape = (50, 64)
    rows, _, weight = _rows(method, world, shape, scratch=7 * shape[1] if blocked else 1 << 20)
    assert rows.whole is not blocked
    embedding = nn.Embedding(*shape, padding_idx=0)
    forward = FrozenEmbeddingForward(embedding, rows)
    ids = torch.randint(0, shape[0], (4, 9))
    ids[0, :3] = torch.tensor([0, shape[0] - 1, 0])  # the first and last rows, repeated
    out = forward(ids)
    assert out.shape == (4, 9, shape[1])
    assert torch.equal(out, F.embedding(ids, weight))
    with pytest.raises(IndexError, match="index out of range"):
        forward(torch.tensor([[1, shape[0]]]))


def test_a_decoded_linear_last_in_a_checkpointed_block_is_not_computed_again() -> None:
    # Its wire is saved before its product, so the recomputation, which stops at the
    # block's last saved tensor, ends before the product: 2 decodes in the forward, then
    # 1 in the recomputation (the first linear) and 2 for the inputs' gradients.
    torch.manual_seed(0)
    shape = (40, 40)
    rows, _, weight = _rows("nf4", 1, shape, scratch=1 << 20)
    decodes = []
    decode = rows.decode
    rows.decode = lambda *a: decodes.append(a[1:]) or decode(*a)  # type: ignore[method-assign]
    first, last = (FrozenLinearForward(nn.Linear(40, 40, bias=False), rows) for _ in range(2))
    x = torch.randn(3, 40, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return last(torch.relu(first(x)))

    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    assert len(decodes) == 2
    out.square().sum().backward()
    assert len(decodes) == 5
    ref_x = x.detach().clone().requires_grad_()
    F.linear(torch.relu(F.linear(ref_x, weight)), weight).square().sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
