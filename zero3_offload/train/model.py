"""A byte-level GPT whose named children are the layers the manager runs.

Every module initialises itself in ``reset_parameters`` (children first, then
its own parameters) so the model can be built on the meta device and
materialised layer by layer with the same values as eager construction; see
[Note: meta initialisation] in ``zero3_offload.parameter.meta_init``. There are no
buffers: the causal mask comes from ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload.errors import ConfigError

__all__ = ["GPT", "Block", "Embedding", "GPTShape", "Head"]


@attrs.frozen(kw_only=True)
class GPTShape:
    """The model's size."""

    vocab_size: int = 256
    seq_len: int = 128  # longest input; positions beyond it have no embedding
    d_model: int = 128
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads; must divide d_model

    def parameter_count(self) -> int:
        """Elements of the whole model (what ``sum(p.numel())`` gives)."""
        d, v = self.d_model, self.vocab_size
        embed = v * d + self.seq_len * d
        block = 2 * 2 * d + 3 * d * d + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        head = 2 * d + d * v + v
        return embed + self.layers * block + head


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.empty(seq_len, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the initial values (runs after the children's, as in ``__init__``)."""
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d_model: int, heads: int, depth: int) -> None:
        super().__init__()
        self.heads = heads
        self.depth = depth  # number of blocks: scales the residual projections
        self.ln1 = nn.LayerNorm(d_model)
        # No key/query bias: a key bias gets zero gradient and Adam amplifies its noise.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.depth)
        for linear, std in (
            (self.qkv, 0.02),
            (self.proj, residual_std),
            (self.fc, 0.02),
            (self.out, residual_std),
        ):
            nn.init.normal_(linear.weight, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to next-byte logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, zero bias."""
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class GPT(nn.Module):
    """``embed``, ``block0`` ... ``block{L-1}``, ``head``: one layer each for the manager."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        if shape.d_model % shape.heads:
            raise ConfigError(f"d_model={shape.d_model} is not a multiple of heads={shape.heads}")
        self.shape = shape
        self.embed = Embedding(shape.vocab_size, shape.seq_len, shape.d_model)
        for i in range(shape.layers):
            self.add_module(f"block{i}", Block(shape.d_model, shape.heads, shape.layers))
        self.head = Head(shape.d_model, shape.vocab_size)

    @property
    def layer_names(self) -> list[str]:
        """The layers in the order the forward pass runs them."""
        return [name for name, _ in self.named_children()]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Plain (unsharded) forward, for reference and tests."""
        h = idx
        for layer in self.children():
            h = layer(h)
        return h
