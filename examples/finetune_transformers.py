"""Fine-tune a transformers causal LM with ZeRO-3 on 2 local ranks: load, train, generate, export.

    pip install -e ".[hf]"                       # transformers (included in [dev])
    python examples/finetune_transformers.py     # a tiny Llama built from a config: no download
    python examples/finetune_transformers.py --model DIR --steps 50   # a local model directory

Without ``--model`` a tiny Llama (grouped-query attention, rotary positions) is
built from a config and saved to a temporary directory first, so the example
needs no network. Each rank then loads only the slices of its shards from the
safetensors files (``from_pretrained``), runs the model's own forward and
backward under ZeRO-3 (module mode: units are the model's decoder layers),
evaluates under ``torch.no_grad()``, decodes greedily with ``generate``, and
writes the result with ``save_pretrained``, which transformers loads as is.
How module mode works: docs/transformers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.testing import RankContext, run_ranks

TEXT = (
    b"ZeRO stage 3 partitions parameters, gradients and optimizer states across ranks; "
    b"each rank gathers a layer's parameters just before it runs and frees them after. "
) * 8


def batch(step: int, rows: int, seq: int) -> torch.Tensor:
    """``rows`` windows of ``seq`` bytes of TEXT (token ids are bytes)."""
    g = torch.Generator().manual_seed(step)
    data = torch.tensor(list(TEXT))
    starts = torch.randint(0, len(TEXT) - seq, (rows,), generator=g)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def tiny_llama(directory: Path) -> None:
    """Save a tiny randomly initialised Llama whose vocabulary holds every byte."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(directory)


async def rank_main(ctx: RankContext, model_dir: str, out_dir: str, steps: int) -> list[float]:
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=0.0),
        gradient_clipping=1.0,
        cpu_memory_budget=2**30,
        gpu_param_memory_budget=2**28,
    )
    manager = Zero3CpuOffloadManager.from_pretrained(config, ctx.group, model_dir)
    losses = []
    async with manager:
        for step in range(steps):
            x = batch(step, 4, 32).chunk(ctx.world_size)[ctx.rank]  # this rank's rows
            out = await manager.forward(input_ids=x, labels=x)  # the model's own forward
            await manager.backward(out.loss)
            await manager.optimizer_step(3e-3)
            losses.append(out.loss.item())
            if ctx.rank == 0:
                print(f"step {step:3d} loss {out.loss.item():.4f}", flush=True)
        with torch.no_grad():
            x = batch(10_000, 4, 32)
            evaluated = (await manager.forward(input_ids=x, labels=x)).loss.item()
        prompt = torch.tensor([list(b"ZeRO stage")])
        tokens = await manager.generate(prompt, max_new_tokens=12, do_sample=False)
        await manager.save_pretrained(out_dir)
    if ctx.rank == 0:
        print(f"eval loss {evaluated:.4f}")
        print(f"generated: {bytes(tokens[0].tolist())!r}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local transformers model directory (vocab >= 256)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(Path(tmp) / "tiny-llama")
        if args.model is None:
            tiny_llama(Path(model_dir))
        out_dir = str(Path(tmp) / "fine-tuned")
        asyncio.run(run_ranks(rank_main, args.world_size, model_dir, out_dir, args.steps))
        # The export is an ordinary transformers directory.
        model = AutoModelForCausalLM.from_pretrained(out_dir)
        x = batch(10_000, 4, 32)
        with torch.no_grad():
            print(f"reloaded with transformers: eval loss {model(input_ids=x, labels=x).loss:.4f}")


if __name__ == "__main__":
    main()
