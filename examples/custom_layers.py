"""A custom model given as an ordered mapping of layers, with its own layer list.

    python examples/custom_layers.py                  # 2 local ranks, 60 steps
    python examples/custom_layers.py --steps 15       # short mode (CI)
    torchrun --nproc-per-node 2 examples/custom_layers.py

The model is not an ``nn.Module`` with children but a plain ``dict`` of name ->
layer, and the program decides which layers run and in which order: training
runs every layer, while a forward pass over ``ENCODER_LAYERS`` (a prefix of the
list) gets the encoder's features without gathering the classifier. The layers are built
on the meta device and materialised one at a time by ``from_meta``: custom
modules initialise themselves in ``reset_parameters`` (children first), so the
values equal eager construction's with the same seed.

The task: tell apart four kinds of noisy periodic signals (sine, square,
sawtooth, triangle) from 64 samples. Only the public API is used; the ranks
compute on the CPU and use gloo, also under torchrun. What ``from_meta`` does:
[Note: meta initialisation] in ``zero3_offload/parameter/meta_init.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload import (
    OptimizerConfig,
    Zero3CpuOffloadConfig,
    Zero3CpuOffloadManager,
    destroy_process_group,
    init_process_group_from_env,
)
from zero3_offload.testing import RankContext, run_ranks

LENGTH, CLASSES, WIDTH = 64, 4, 32


class ResidualConv(nn.Module):
    """Two 1-D convolutions with a skip connection; a custom layer."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.conv1 = nn.Conv1d(channels, channels, 3, padding=dilation, dilation=dilation)
        self.conv2 = nn.Conv1d(channels, channels, 1)
        self.scale = nn.Parameter(torch.empty(channels, 1))  # its own parameter
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Called after the children's own reset (eagerly: at the end of __init__).
        nn.init.constant_(self.scale, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.conv2(F.gelu(self.conv1(self.norm(x))))


class Pool(nn.Module):
    """Mean over time, then a LayerNorm: (batch, channels, time) -> (batch, channels)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.mean(dim=-1))


def build_layers() -> dict[str, nn.Module]:
    """The model: an ordered mapping of layer name -> module."""
    return {
        "stem": nn.Conv1d(1, WIDTH, 5, padding=2),
        "res1": ResidualConv(WIDTH, 1),
        "res2": ResidualConv(WIDTH, 2),
        "res3": ResidualConv(WIDTH, 4),
        "pool": Pool(WIDTH),
        "classifier": nn.Linear(WIDTH, CLASSES),
    }


TRAIN_LAYERS = ["stem", "res1", "res2", "res3", "pool", "classifier"]
ENCODER_LAYERS = TRAIN_LAYERS[:-1]  # the encoder: every layer but the classifier


def signals(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of noisy periodic signals and their kind (0-3); depends only on ``step``."""
    g = torch.Generator().manual_seed(step)
    kind = torch.randint(0, CLASSES, (size,), generator=g)
    period = torch.randint(8, 24, (size, 1), generator=g).float()
    phase = torch.rand(size, 1, generator=g) * period
    t = (torch.arange(LENGTH).float() + phase) / period  # in periods
    frac = t - t.floor()
    waves = torch.stack(
        [
            torch.sin(2 * math.pi * t),
            torch.sign(frac - 0.5),
            2 * frac - 1,
            4 * (frac - 0.5).abs() - 1,
        ]
    )
    x = waves[kind, torch.arange(size)] + 0.3 * torch.randn(size, LENGTH, generator=g)
    return x.unsqueeze(1), kind


async def train(ctx: RankContext, steps: int, global_batch: int) -> dict[str, float]:
    with torch.device("meta"):
        layers = build_layers()  # shapes only: no rank ever holds the whole model
    config = Zero3CpuOffloadConfig(optimizer=OptimizerConfig(kind="adamw", weight_decay=0.01))
    per_rank = global_batch // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    async with Zero3CpuOffloadManager.from_meta(config, ctx.group, layers, seed=0) as manager:
        losses = []
        for step in range(steps):
            x, y = signals(step, global_batch)
            logits = await manager.forward_pass(x[mine], TRAIN_LAYERS)
            logits.requires_grad_()
            loss = F.cross_entropy(logits, y[mine])
            loss.backward()
            await manager.backward_pass(logits.grad, TRAIN_LAYERS, learning_rate=3e-3)
            await manager.optimizer_step(learning_rate=3e-3)
            losses.append(loss.item())
            if ctx.rank == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
        x, y = signals(10**6, 256)  # held out: a step number training never reaches
        with torch.no_grad():  # evaluation: the manager keeps nothing for a backward
            logits = await manager.forward_pass(x, TRAIN_LAYERS)
            features = await manager.forward_pass(x, ENCODER_LAYERS)  # the encoder only
        accuracy = logits.argmax(-1).eq(y).float().mean()
        if ctx.rank == 0:
            print(f"held-out accuracy {accuracy.item():.3f} (chance {1 / CLASSES:.2f})")
            print(f"encoder features: {tuple(features.shape)} from layers {ENCODER_LAYERS}")
    return {"first": losses[0], "last": losses[-1], "accuracy": accuracy.item()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        group = await init_process_group_from_env("gloo")  # the config's device is the CPU
        try:
            await train(RankContext(group.rank(), group.size(), group), args.steps, args.batch)
        finally:
            destroy_process_group()
    else:
        await run_ranks(train, args.world_size, args.steps, args.batch)


if __name__ == "__main__":
    asyncio.run(main())
