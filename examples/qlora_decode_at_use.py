"""QLoRA-style fine-tuning on 2 local ranks, frozen weights decoded at gather time vs at use.

    pip install -e ".[hf]"                     # transformers and peft (included in [dev])
    python examples/qlora_decode_at_use.py     # a small Llama built from a config: no download

A Llama built from a config gets LoRA adapters (peft, r=8) on every attention and
MLP projection; its base weights are frozen and stored as NF4
(``frozen_compression="nf4"``: about 0.56 byte per element, one copy sharded over
the ranks). The same steps run twice under activation checkpointing: once with the
frozen weights decoded into fp32 when a unit is gathered, once with
``frozen_decode_at_use=True``, where a gathered unit keeps them as NF4 and each
frozen linear and the embedding decode their rows when they run. The losses are
the same; the gathered parameter bytes at their highest are not. A third run decodes
at use and keeps the forward's last units gathered for the recomputing backward, up
to ``keep_gathered_bytes`` (2 MiB here: the LM head and the last two decoder layers), so
those are gathered once per step instead of twice: the same losses again, fewer bytes
gathered. A fourth run also has the last two decoder layers save their matrix
products' outputs (``selective_checkpointing_units=2``; LoRA's low-rank products are
recomputed), so their recomputation skips the projections: the same losses, more bytes
saved for backward. How it works: docs/fine_tuning.md.
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext, run_ranks

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama() -> torch.nn.Module:
    """A randomly initialised Llama (the same on every call) with LoRA on every projection."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS)
    return get_peft_model(LlamaForCausalLM(config), lora)


def batch(step: int, rows: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 4096, (rows, seq), generator=g)


KEEP = 2 * 2**20
# run -> (decoded at use, bytes kept for backward, units that save their products)
RUNS = {
    "at gather": (False, 0, 0),
    "at use": (True, 0, 0),
    "at use, 2 MiB kept": (True, KEEP, 0),
    "at use, 2 MiB kept, 2 saving products": (True, KEEP, 2),
}


async def rank_main(
    ctx: RankContext, at_use: bool, keep: int, selective: int, steps: int
) -> tuple[list[float], int, int, int]:
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=0.0),
        frozen_compression="nf4",
        frozen_decode_at_use=at_use,
        activation_checkpointing=True,
        selective_checkpointing_units=selective,
        keep_gathered_for_backward=keep > 0,
        keep_gathered_bytes=keep,
    )
    manager = Zero3CpuOffloadManager(config, ctx.group, lora_llama())
    losses = []
    async with manager:
        for step in range(steps):
            x = batch(step, 4, 64).chunk(ctx.world_size)[ctx.rank]  # this rank's rows
            out = await manager.forward(input_ids=x, labels=x)
            saved = manager.get_memory_stats().activation_bytes  # kept for this backward
            await manager.backward(out.loss)
            await manager.optimizer_step(1e-3)
            losses.append(out.loss.item())
        performance = manager.get_performance_stats()
    high_water = performance.gathered_high_water_bytes
    return losses, high_water, performance.prefetch["gathered_bytes"], saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    for how, run in RUNS.items():
        results = asyncio.run(run_ranks(rank_main, args.world_size, *run, args.steps))
        losses, high_water, gathered, saved = results[0]
        print(f"decoded {how}: losses {' '.join(f'{v!r}' for v in losses)}")
        print(f"decoded {how}: gathered high-water {high_water} bytes")
        print(f"decoded {how}: gathered {gathered} bytes in all")
        print(f"decoded {how}: saved for backward {saved} bytes")


if __name__ == "__main__":
    main()
