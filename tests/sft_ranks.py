"""Rank functions of the supervised fine-tuning tests, and their plain reference.

A run trains the tiny chat Llama of ``chat_data`` with the manager in module mode on
the examples of a JSONL file, through the library's own pieces (``SftData``,
``SftSteps``: the loop of ``zero3-offload train`` on examples), AdamW at a constant
learning rate, clipping 1.0 and accumulation 2. The plain reference trains the same
model in one process on the same micro-batches (the same collation, every rank's
micro-batch in turn) with the global token mean of the whole step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
import transformers
from chat_data import VOCAB, tiny_llama_config
from hf_models import ACC, CLIP, LR, make_config

from zero3_offload import Zero3CpuOffloadManager
from zero3_offload.checkpoint.format import read_metadata
from zero3_offload.data.sft_data import SftData
from zero3_offload.testing import RankContext
from zero3_offload.train.sft_steps import SftSteps

MODEL_SEED = 3


@attrs.frozen
class SftSpec:
    """One run on the ranks."""

    model_dir: str  # the tokenizer (the weights are drawn from MODEL_SEED)
    data: str
    steps: int
    batch_size: int  # examples per rank per micro-step
    pack: bool = False
    max_len: int = 48
    load_dir: str | None = None  # resume from this checkpoint root
    save_dir: str | None = None  # save here after the last step


def build_model() -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    model.train()
    return model


def load_data(model_dir: str, data: str, *, pack: bool, max_len: int) -> SftData:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return SftData.load(
        data,
        tokenizer=tokenizer,
        vocab=VOCAB,
        max_len=max_len,
        seed=5,
        pack=pack,
    )


async def _sums(ctx: RankContext, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ctx.group)
    return t.tolist()


async def sft_train(ctx: RankContext, spec: SftSpec) -> dict[str, Any]:
    """Train ``spec.steps`` steps; the global token-mean loss of each, the examples each
    rank took per step, the full state dict and the final data position."""
    data = load_data(spec.model_dir, spec.data, pack=spec.pack, max_len=spec.max_len)
    manager = Zero3CpuOffloadManager(make_config({}), ctx.group, build_model())
    steps = SftSteps(
        data,
        manager,
        rank=ctx.rank,
        world_size=ctx.world_size,
        batch_size=spec.batch_size,
        accumulation=ACC,
        eval_batches=1,
    )
    if spec.load_dir is not None:
        path = await manager.load_checkpoint(spec.load_dir)
        steps.restore(read_metadata(path).get("training_state"), str(path))
    losses, seen, padding = [], [], []
    for _ in range(spec.steps):
        order = data.order
        seen.append(
            [
                order.example(p)
                for m in range(ACC)
                for p in order.micro_batch(
                    steps.position,
                    micro=m,
                    rank=ctx.rank,
                    world_size=ctx.world_size,
                    batch_size=spec.batch_size,
                )
            ]
        )
        counts = await steps.train_step(LR)
        loss_sum, valid, real, pad = await _sums(
            ctx, [counts.loss_sum, counts.valid, counts.real, counts.padding]
        )
        losses.append(loss_sum / valid)
        padding.append(pad / (real + pad))
    if spec.save_dir is not None:
        await manager.save_checkpoint(spec.save_dir, training_state=steps.training_state())
    state = await manager.full_state_dict()
    await manager.close()
    return {
        "losses": losses,
        "seen": seen,
        "padding": padding,
        "state": state,
        "position": steps.position,
    }


def plain_sft(spec: SftSpec, world_size: int) -> dict[str, Any]:
    """Plain single-process training on the micro-batches that ``world_size`` ranks take,
    with the global token mean of each step (sum of per-token losses / learned tokens)."""
    data = load_data(spec.model_dir, spec.data, pack=spec.pack, max_len=spec.max_len)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, position = [], 0
    for _ in range(spec.steps):
        batches = [
            data.train_batch(
                position, micro=m, rank=r, world_size=world_size, batch_size=spec.batch_size
            )
            for m in range(ACC)
            for r in range(world_size)
        ]
        total = sum(b.valid_tokens for b in batches)
        loss = sum(model(**b.model_kwargs()).loss * b.valid_tokens for b in batches) / total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        position += spec.batch_size * ACC * world_size
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


def write_model_dir(root: Path) -> Path:
    """A directory with the chat tokenizer (the rank runs draw the weights)."""
    from chat_data import chat_tokenizer

    path = root / "tokenizer"
    chat_tokenizer().save_pretrained(path)
    return path
