"""The model, data and loss every system of ``compare_peers.py`` trains.

One definition for all systems: a GPT whose children are its layers (token +
position embedding, ``n_layers`` pre-LayerNorm transformer blocks, final
LayerNorm, LM head), so ``zero3_offload`` can run it layer by layer, FSDP2 can
shard it per block and DeepSpeed can partition it as it is.

The data is a learnable byte-level corpus: the bytes of the Python standard
library's top-level ``*.py`` files (sorted by name, concatenated), from which
every step draws ``global_batch`` windows of ``seq + 1`` bytes at offsets from
a seeded generator. Every process builds exactly the same model (same seed)
and the same batches; a distributed rank takes its contiguous slice of the
global batch.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


class Embed(nn.Module):
    def __init__(self, d: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """Pre-LayerNorm block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # No qkv bias: the key bias has zero gradient, which Adam would turn into
        # lr-sized updates of numerical noise that differ between systems.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Children, in order, are the layers: ``embed``, ``block0``.. , ``ln_f``, ``head``."""

    def __init__(self, *, d: int, heads: int, n_layers: int, seq: int) -> None:
        super().__init__()
        self.embed = Embed(d, seq)
        for i in range(n_layers):
            self.add_module(f"block{i}", Block(d, heads))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.named_children()]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = idx
        for module in self.children():
            h = module(h)
        return h


def make_model(dims: dict[str, int], seed: int) -> GPT:
    """The model with GPT-2 style initial values (N(0, 0.02), residual projections scaled)."""
    torch.manual_seed(seed)
    model = GPT(d=dims["d"], heads=dims["heads"], n_layers=dims["n_layers"], seq=dims["seq"])
    resid_std = 0.02 / math.sqrt(2 * dims["n_layers"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            elif name.endswith(("proj.weight", "fc2.weight")):
                p.normal_(0.0, resid_std)
            else:
                p.normal_(0.0, 0.02)
    return model


def count_params(model: nn.Module) -> tuple[int, dict[str, int]]:
    per_layer = {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_children()}
    return sum(per_layer.values()), per_layer


_CORPUS: torch.Tensor | None = None


def corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The first ``max_bytes`` of the stdlib's top-level ``*.py`` files, as uint8 tensor."""
    global _CORPUS
    if _CORPUS is None or _CORPUS.numel() != max_bytes:
        root = Path(sysconfig.get_paths()["stdlib"])
        buf = bytearray()
        for f in sorted(root.glob("*.py")):
            buf += f.read_bytes()
            if len(buf) >= max_bytes:
                break
        _CORPUS = torch.frombuffer(buf[:max_bytes], dtype=torch.uint8).clone()
    return _CORPUS


def corpus_info() -> dict[str, Any]:
    c = corpus()
    return {
        "source": f"{sysconfig.get_paths()['stdlib']}/*.py, sorted by name, concatenated",
        "bytes": c.numel(),
        "sha256": hashlib.sha256(c.numpy().tobytes()).hexdigest(),
    }


def batches(
    steps: int, global_batch: int, seq: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (input bytes, next bytes), each ``[global_batch, seq]`` int64."""
    data = corpus()
    g = torch.Generator().manual_seed(seed)
    ar = torch.arange(seq + 1)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (global_batch, 1), generator=g)
        window = data[starts + ar].long()
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
