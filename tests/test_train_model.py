"""The GPT, corpus and schedule behind ``zero3-offload train``."""

from __future__ import annotations

import itertools

import pytest
import torch

from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext
from zero3_offload.train.corpus import ByteCorpus, stdlib_files
from zero3_offload.train.loop import learning_rate
from zero3_offload.train.model import GPT, GPTShape
from zero3_offload.train.options import TrainOptions, parse_size

SHAPE = GPTShape(seq_len=16, d_model=24, layers=2, heads=3)


@pytest.mark.ranks(2)
async def test_gpt_built_on_meta_equals_eager_construction(rank: RankContext) -> None:
    torch.manual_seed(5)
    config = Zero3CpuOffloadConfig()
    async with Zero3CpuOffloadManager(config, rank.group, GPT(SHAPE)) as manager:
        eager = await manager.full_state_dict()
    with torch.device("meta"):
        model = GPT(SHAPE)
    async with Zero3CpuOffloadManager.from_meta(config, rank.group, model, seed=5) as manager:
        meta = await manager.full_state_dict()
    assert eager.keys() == meta.keys()
    for name, value in eager.items():
        assert torch.equal(value, meta[name]), name
    assert sum(v.numel() for v in eager.values()) == SHAPE.parameter_count()


def test_gpt_layers_and_shapes() -> None:
    model = GPT(SHAPE)
    assert model.layer_names == ["embed", "block0", "block1", "head"]
    assert sum(p.numel() for p in model.parameters()) == SHAPE.parameter_count()
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
    with pytest.raises(ValueError, match="not a multiple of heads"):
        GPT(GPTShape(d_model=10, heads=3))


def test_corpus_is_the_stdlib_in_a_fixed_order_and_batches_depend_on_position() -> None:
    files = stdlib_files()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    a, b = ByteCorpus.load(max_bytes=200_000), ByteCorpus.load(max_bytes=200_000)
    assert torch.equal(a.train, b.train) and a.train.numel() + a.eval.numel() == 200_000
    key = {"split": "train", "seed": 1, "step": 7, "first": 3, "batch_size": 3}
    x, y = a.batch(**key, seq_len=10)
    assert x.shape == y.shape == (3, 10) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, b.batch(**key, seq_len=10)[0])
    for change in ({"step": 8}, {"first": 0}, {"seed": 2}, {"split": "eval"}):
        assert not torch.equal(x, a.batch(**(key | change), seq_len=10)[0]), change
    # A sequence depends on its global position only: positions 3..5 as one batch of 3 or
    # as 3, then 4..5 (the same global batch split over other ranks or micro-steps).
    one = a.batch(**(key | {"batch_size": 1}), seq_len=10)[0]
    two = a.batch(**(key | {"first": 4, "batch_size": 2}), seq_len=10)[0]
    assert torch.equal(x, torch.cat([one, two]))


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    options = TrainOptions(steps=100, lr=1.0, warmup_steps=10)
    rates = [learning_rate(step, options) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in itertools.pairwise(rates[9:]))
    assert rates[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1024", 1024), ("2GiB", 2 * 2**30), ("2G", 2 * 2**30), ("1.5GB", 1_500_000_000),
     ("512 MiB", 512 * 2**20), ("3k", 3072)],
)  # fmt: skip
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected
