"""Train a LightningModule with ZeRO-3 and offload: one line changes.

    plain:  trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, ...)
    ZeRO-3: trainer = L.Trainer(strategy=Zero3Strategy(config=Zero3CpuOffloadConfig(...)),
                                accelerator="cpu", devices=2, ...)

A small regression network with an AdamW of two parameter groups (weight decay on the
hidden layers only), a warm-up then cosine schedule stepped every optimizer step,
accumulation 2 and clipping at 1.0. ``--compare`` first trains with ``strategy="ddp"``
and checks that every rank's loss at every micro-step is within 1e-5; with ``--resume``
both then restart from their checkpoints saved halfway (ours in its own format), and the
resumed runs' losses must agree as well.

    python examples/lightning_zero3.py --compare --resume     # Lightning starts 2 ranks
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload import Zero3CpuOffloadConfig
from zero3_offload.integrations import Zero3Strategy

STEPS = 6  # optimizer steps


def emit(report: dict) -> None:
    """One JSON line in one write: the ranks share stdout, and lines must not interleave."""
    os.write(1, (json.dumps(report) + "\n").encode())


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> dict:
        hidden = [*self.l1.parameters(), *self.l2.parameters()]
        optimizer = torch.optim.AdamW(
            [{"params": hidden, "weight_decay": 0.1}, {"params": self.head.parameters()}],
            lr=1e-2,
            weight_decay=0.0,
        )

        def warm_cosine(step: int) -> float:
            return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * step / STEPS))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warm_cosine)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True
    )


def fit(strategy: object, root: Path, steps: int, resume: str | None = None) -> list[float]:
    L.seed_everything(0, verbose=False)
    module = Regressor()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[
            L.callbacks.ModelCheckpoint(
                dirpath=str(root), every_n_train_steps=steps // 2, save_top_k=-1
            )
        ],
    )
    trainer.fit(module, data(), ckpt_path=resume)
    return module.losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", action="store_true", help='against strategy="ddp"')
    parser.add_argument("--resume", action="store_true", help="resume from the middle")
    parser.add_argument("--out", type=Path, default=None, help="(default: a temporary dir)")
    opts = parser.parse_args()
    # Lightning starts rank 1 by running this script again: both ranks need one directory.
    root = opts.out or Path(os.environ.setdefault("ZERO3_EXAMPLE_DIR", tempfile.mkdtemp()))
    config = Zero3CpuOffloadConfig(cpu_memory_budget=2**28, gpu_param_memory_budget=2**26)
    ours = fit(Zero3Strategy(config=config), root / "zero3", STEPS)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    report: dict[str, object] = {"rank": rank, "micro_steps": len(ours)}
    if opts.compare:
        plain = fit("ddp", root / "ddp", STEPS)
        report["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(ours, plain, strict=True))
    if opts.compare and opts.resume:
        middle = f"epoch=0-step={STEPS // 2}.ckpt"
        resumed = fit(
            Zero3Strategy(config=config), root / "r0", STEPS, str(root / "zero3" / middle)
        )
        resumed_ddp = fit("ddp", root / "r1", STEPS, str(root / "ddp" / middle))
        report["resumed_micro_steps"] = len(resumed)
        report["max_loss_diff_resumed"] = max(
            abs(a - b) for a, b in zip(resumed, resumed_ddp, strict=True)
        )
    emit(report)
    bad = {k: v for k, v in report.items() if k.startswith("max") and v > 1e-5}
    if bad:
        raise SystemExit(f"rank {rank}: {bad}")


if __name__ == "__main__":
    main()
