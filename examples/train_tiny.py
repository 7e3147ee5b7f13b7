"""Train a tiny GPT with ZeRO-3 on 2 local ranks, printing the loss per step.

    python examples/train_tiny.py                 # starts 2 local gloo ranks
    python examples/train_tiny.py --steps 50 --world-size 4
    python examples/train_tiny.py --activation-checkpointing   # same losses, less kept
    python examples/train_tiny.py --gradient-clipping 0.5 --speculative   # same losses as
        # without --speculative: updates start during backward, undone when clipping applies
    python examples/train_tiny.py --nvme-path /tmp/tier   # same losses: masters and
        # optimizer state in a file per rank under /tmp/tier, streamed for each update
    python examples/train_tiny.py --nvme-path /tmp/tier --nvme-params   # same losses:
        # the compute copies in a second file per rank, read ahead of each gather
    torchrun --nproc-per-node 2 examples/train_tiny.py   # joins torchrun's group

Only the public API is used; the model is an ordinary ``nn.Module`` whose
children are the layers the manager runs in order. The model computes on the
CPU, so the ranks use gloo, also under torchrun on a machine with GPUs. How the
passes work: docs/architecture.md.
"""

from __future__ import annotations

import argparse
import asyncio
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

VOCAB, SEQ, D = 32, 16, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same model; rank 0's values are used
    return nn.Sequential(
        nn.Embedding(VOCAB, D), Block(), Block(), nn.LayerNorm(D), nn.Linear(D, VOCAB)
    )


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token prediction on sequences counting up with a random start and stride."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


async def train(
    ctx: RankContext,
    steps: int,
    global_batch: int,
    checkpointing: bool = False,
    clipping: float = 0.0,
    speculative: bool = False,
    nvme_path: str | None = None,
    nvme_params: bool = False,
) -> list[float]:
    model = build_model()
    layers = [name for name, _ in model.named_children()]
    lr = 3e-3
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=0.01),
        # True: keep only each layer's input and recompute its forward in backward.
        activation_checkpointing=checkpointing,
        gradient_clipping=clipping,  # global-norm clipping; 0 turns it off
        # True: with the learning rate given to backward_pass, each layer's update starts
        # when its gradient lands, even though clipping needs the global norm first; the
        # updates are undone and redone clipped when clipping applies (same numbers).
        speculative_step=speculative,
        # "nvme": fp32 masters and optimizer state in a file per rank under nvme_path,
        # read and written back for each layer's update (same numbers as in memory).
        offload_optimizer_device="cpu" if nvme_path is None else "nvme",
        # "nvme": the compute copies (what gathers send) in a second file per rank, read
        # into reused buffers ahead of each gather (same numbers as in memory).
        offload_param_device="nvme" if nvme_params else "cpu",
        nvme_path=nvme_path,
    )
    per_rank = global_batch // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)  # this rank's samples
    losses = []
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        for step in range(steps):
            x, y = batch(step, global_batch)
            logits = await manager.forward_pass(x[mine], layers)
            if step == 0 and ctx.rank == 0:
                kept = manager.get_memory_stats().activation_bytes
                print(f"kept for backward after the first forward: {kept} bytes", flush=True)
            logits.requires_grad_()  # the loss is computed outside the manager
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y[mine].reshape(-1))
            loss.backward()
            # The learning rate given here lets updates start during the backward.
            await manager.backward_pass(logits.grad, layers, learning_rate=lr)
            await manager.optimizer_step(learning_rate=lr)
            losses.append(loss.item())
            if ctx.rank == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
        # Evaluation: under no_grad the manager keeps nothing for a backward.
        x, y = batch(steps, global_batch)
        with torch.no_grad():
            logits = await manager.forward_pass(x[mine], layers)
        eval_loss = F.cross_entropy(logits.reshape(-1, VOCAB), y[mine].reshape(-1))
        if ctx.rank == 0:
            print(f"eval loss {eval_loss.item():.4f}", flush=True)
            stats = manager.get_performance_stats()
            print(f"speculative updates undone: {stats.speculative_rollbacks} steps", flush=True)
            if nvme_path is not None:
                read, written = stats.transfers["disk_read"], stats.transfers["disk_write"]
                print(
                    f"disk tier: {read.bytes} bytes read in {read.time:.3f} s, "
                    f"{written.bytes} bytes written in {written.time:.3f} s",
                    flush=True,
                )
    return losses


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's forward in backward instead of keeping activations",
    )
    parser.add_argument("--gradient-clipping", type=float, default=0.0, help="max global norm")
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="with clipping, start updates during backward anyway (speculative_step)",
    )
    parser.add_argument(
        "--nvme-path",
        help="keep masters and optimizer state in files under this directory (the disk tier)",
    )
    parser.add_argument(
        "--nvme-params",
        action="store_true",
        help="with --nvme-path, keep the compute copies on disk too (offload_param_device)",
    )
    args = parser.parse_args()
    if args.nvme_params and args.nvme_path is None:
        parser.error("--nvme-params needs --nvme-path")
    ckpt = args.activation_checkpointing
    options = (
        args.steps,
        args.batch,
        ckpt,
        args.gradient_clipping,
        args.speculative,
        args.nvme_path,
        args.nvme_params,
    )
    if "RANK" in os.environ:  # launched by torchrun
        group = await init_process_group_from_env("gloo")  # the config's device is the CPU
        ctx = RankContext(rank=group.rank(), world_size=group.size(), group=group)
        try:
            await train(ctx, *options)
        finally:
            destroy_process_group()
    else:
        await run_ranks(train, args.world_size, *options)


if __name__ == "__main__":
    asyncio.run(main())
