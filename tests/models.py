"""Small models and reference training shared by the tests.

Every test compares the manager against plain single-process PyTorch built
from the same functions here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 37
SEQ = 12


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int, mlp: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(
            d, 3 * d, bias=False
        )  # a key bias has zero gradient: Adam would amplify noise
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp)
        self.fc2 = nn.Linear(mlp, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.empty(seq, d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Children first, then own parameters: meta initialisation replays this order.
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class TinyGPT(nn.Module):
    """Token embedding, ``n_blocks`` blocks, final LayerNorm, LM head; unequal layer sizes."""

    def __init__(
        self, *, d: int = 24, heads: int = 4, n_blocks: int = 2, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embed = Embed(VOCAB, d, SEQ)
        for i in range(n_blocks):
            # Unequal MLP widths give layers of unequal, odd sizes.
            self.add_module(f"block{i}", Block(d, heads, 4 * d + 3 * i + 1, dropout))
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


def make_model(seed: int = 0, **kwargs: object) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def make_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task: predict the next token of a shifted arithmetic sequence."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_torch_optimizer(kind: str, params: object, **kw: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=kw.get("weight_decay", 0.0))
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, weight_decay=kw.get("weight_decay", 0.0))
    return torch.optim.SGD(
        params,
        lr=1e-2,
        momentum=kw.get("momentum", 0.9),
        nesterov=bool(kw.get("nesterov", False)),
        weight_decay=kw.get("weight_decay", 0.0),
    )


def train_reference(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    clip: float = 0.0,
    norms: list[float] | None = None,
) -> list[float]:
    """Plain PyTorch training on whole batches; returns the loss per step.

    With ``clip``, the pre-clipping global norm of each step is appended to
    ``norms`` when given.
    """
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        optimizer.step()
        losses.append(loss.item())
    return losses
