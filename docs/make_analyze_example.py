"""Regenerate ``docs/analyze_example.txt`` and ``docs/analyze_timeline.png``.

    python docs/make_analyze_example.py

Trains a tiny transformer for 5 steps on 2 local gloo ranks with JSON logging
on (one file per rank, in a temporary directory), then runs
``zero3-offload analyze`` on the two logs. The step table at the end of the
output is copied into ``docs/observability.md`` (its ``<!-- excerpt -->``
block, which ``tests/test_docs.py`` compares with ``analyze_example.txt``).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import zero3_offload.logging
from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext, run_ranks

VOCAB, SEQ, D, STEPS, GLOBAL_BATCH, LR = 32, 16, 64, 5, 16, 3e-3
DOCS = Path(__file__).resolve().parent


def build_model() -> nn.Module:
    torch.manual_seed(0)
    block = {"d_model": D, "nhead": 4, "dim_feedforward": 4 * D, "dropout": 0.0}
    return nn.Sequential(
        OrderedDict(
            embed=nn.Embedding(VOCAB, D),
            block0=nn.TransformerEncoderLayer(**block, batch_first=True),
            block1=nn.TransformerEncoderLayer(**block, batch_first=True),
            ln_f=nn.LayerNorm(D),
            head=nn.Linear(D, VOCAB),
        )
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


async def train_logged(ctx: RankContext, log_dir: str) -> None:
    zero3_offload.logging.configure(json_path=Path(log_dir) / f"rank{ctx.rank}.jsonl")
    model = build_model()
    layers = [name for name, _ in model.named_children()]
    per_rank = GLOBAL_BATCH // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    async with Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), ctx.group, model) as manager:
        for step in range(STEPS):
            x, y = batch(step)
            logits = await manager.forward_pass(x[mine], layers)
            logits.requires_grad_()
            F.cross_entropy(logits.reshape(-1, VOCAB), y[mine].reshape(-1)).backward()
            # With the learning rate, each layer's CPU update overlaps the backward.
            await manager.backward_pass(logits.grad, layers, learning_rate=LR)
            await manager.optimizer_step(LR)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run_ranks(train_logged, 2, tmp))
        logs = [str(Path(tmp) / f"rank{r}.jsonl") for r in range(2)]
        plot = DOCS / "analyze_timeline.png"
        shown = subprocess.run(
            [sys.executable, "-m", "zero3_offload", "analyze", *logs, "--plot", str(plot)],
            capture_output=True,
            text=True,
            check=True,
        )
    command = "$ zero3-offload analyze rank0.jsonl rank1.jsonl --plot docs/analyze_timeline.png\n"
    (DOCS / "analyze_example.txt").write_text(command + shown.stdout, encoding="utf-8")
    copy_step_table(shown.stdout)


def copy_step_table(output: str) -> None:
    """Put the step table of ``output`` (from its ``Steps`` line on) into observability.md."""
    steps = output[output.index("\nSteps\n") + 1 :]
    page = DOCS / "observability.md"
    marker = re.compile(r"(<!-- excerpt: analyze_example.txt -->\n```text\n).*?(```)", re.DOTALL)
    text = page.read_text(encoding="utf-8")
    page.write_text(marker.sub(lambda m: m[1] + steps + m[2], text, count=1), encoding="utf-8")


if __name__ == "__main__":
    main()
