"""Fine-tune a chat model with TRL's ``SFTTrainer`` under ZeRO-3 with offload: one line
changes.

    plain:  trainer = SFTTrainer(model=model, args=config, train_dataset=data, ...)
    ZeRO-3: class Zero3SFTTrainer(Zero3TrainerMixin, SFTTrainer): pass
            trainer = Zero3SFTTrainer(model=model, args=config, train_dataset=data, ...,
                                      zero3_config=Zero3CpuOffloadConfig(...))

A tiny Llama and a byte-level BPE tokenizer with a chat template are built here (nothing
is downloaded); the data are prompt-completion conversations (sums in words), packed,
with the loss on the completions only, accumulation 2, clipping 1.0, a cosine schedule
with warm-up and weight decay. ``--compare`` first trains the same model with plain
``SFTTrainer`` (DDP under torchrun) and checks every logged loss within 1e-5 and the saved
weights within 1e-4.

    torchrun --nproc_per_node 2 examples/sft_trl_zero3.py --compare --out DIR
    python examples/sft_trl_zero3.py --compare
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import datasets
import tokenizers
import torch
import transformers
from safetensors.torch import load_file
from trl import SFTConfig, SFTTrainer

from zero3_offload import Zero3CpuOffloadConfig
from zero3_offload.integrations import Zero3TrainerMixin

NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def emit(report: dict) -> None:
    """One JSON line in one write: the ranks share stdout, and lines must not interleave."""
    os.write(1, (json.dumps(report) + "\n").encode())


class Zero3SFTTrainer(Zero3TrainerMixin, SFTTrainer):
    """TRL's SFTTrainer under ZeRO-3: the one line."""


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    special = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special,
    )
    bpe.train_from_iterator(
        [" ".join([*NUMBERS, "what", "is", "plus", "it", "makes"])] * 20, trainer
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="<|end|>", pad_token="<pad>"
    )
    tok.chat_template = TEMPLATE
    return tok


def dataset(count: int) -> datasets.Dataset:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(7), rng.randrange(6)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}"}],
                "completion": [{"role": "assistant", "content": f"it makes {NUMBERS[a + b]}"}],
            }
        )
    return datasets.Dataset.from_list(rows)


def build_model(vocab: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=5,
    )
    return transformers.LlamaForCausalLM(config)


def train(kind: str, out: Path, steps: int) -> dict:
    tok = tokenizer()
    model = build_model(len(tok))
    config = SFTConfig(
        output_dir=str(out),
        max_length=64,
        packing=True,
        completion_only_loss=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_drop_last=True,
        bf16=False,  # fp32: exact comparison (SFTConfig defaults to bf16)
    )
    common = dict(model=model, args=config, train_dataset=dataset(160), processing_class=tok)
    if kind == "plain":
        trainer = SFTTrainer(**common)
    else:
        zero3 = Zero3CpuOffloadConfig(cpu_memory_budget=2**30, gpu_param_memory_budget=2**28)
        trainer = Zero3SFTTrainer(**common, zero3_config=zero3)
    trainer.train()
    trainer.save_model(str(out / "final"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 writes the files: the others read them after
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if kind == "zero3":
        trainer.close()
    return {
        "losses": {h["step"]: h["loss"] for h in logs},
        "accuracy": {h["step"]: h.get("mean_token_accuracy") for h in logs},
        "weights": out / "final" / "model.safetensors",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--compare", action="store_true", help="against plain SFTTrainer")
    parser.add_argument("--out", type=Path, default=None, help="(under torchrun: required)")
    opts = parser.parse_args()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with tempfile.TemporaryDirectory() as tmp:
        root = opts.out or Path(tmp)
        ours = train("zero3", root / "zero3", opts.steps)
        if rank0:
            emit({"zero3_losses": ours["losses"]})
        if not opts.compare:
            return
        plain = train("plain", root / "plain", opts.steps)
        loss = max(abs(ours["losses"][s] - plain["losses"][s]) for s in plain["losses"])
        wa, wb = load_file(ours["weights"]), load_file(plain["weights"])
        weight = max((wa[k] - wb[k]).abs().max().item() for k in wb)
        if rank0:
            emit(
                {
                    "compare": "Zero3SFTTrainer vs SFTTrainer",
                    "steps": len(plain["losses"]),
                    "max_loss_diff": loss,
                    "max_weight_diff": weight,
                    "accuracy_equal": ours["accuracy"] == plain["accuracy"],
                }
            )
        if loss > 1e-5 or weight > 1e-4 or wa.keys() != wb.keys():
            raise SystemExit(f"losses differ by {loss:.3g}, weights by {weight:.3g}")


if __name__ == "__main__":
    main()
