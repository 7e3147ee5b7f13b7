"""What every training suite trains: the library's ``GPT`` (its children are the layers) built
after ``torch.manual_seed(seed)``, on ``ByteCorpus`` windows; every system draws the same global
batch at each step and a rank of N takes its contiguous 1/N of it.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch
import torch.nn.functional as F

from zero3_offload.train.corpus import VOCAB_SIZE, ByteCorpus
from zero3_offload.train.model import GPT, GPTShape

MODEL = "`zero3_offload.train.model.GPT`"


def shape(dims: dict[str, int]) -> GPTShape:
    d, seq, layers, heads = dims["d"], dims["seq"], dims["n_layers"], dims["heads"]
    return GPTShape(vocab_size=VOCAB_SIZE, seq_len=seq, d_model=d, layers=layers, heads=heads)


def layer_params(dims: dict[str, int]) -> dict[str, int]:
    """Parameters per layer (counted on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(shape(dims))
    return {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_children()}


@functools.cache
def corpus() -> ByteCorpus:
    return ByteCorpus.load(max_bytes=4 << 20)


def corpus_info() -> dict[str, Any]:
    c = corpus()
    sha256 = hashlib.sha256(c.train.numpy().tobytes()).hexdigest()
    return {"description": f"windows of the first 4 MiB of the {c.source}", "sha256": sha256}


def batches(steps: int, dims: dict[str, int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (bytes, next bytes), each ``[global_batch, seq]`` int64."""
    size, seq = dims["global_batch"], dims["seq"]
    batch = functools.partial(corpus().batch, split="train", seed=seed, micro=0, rank=0)
    return [batch(step=i, batch_size=size, seq_len=seq) for i in range(steps)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
