"""Train with transformers' ``Trainer`` under ZeRO-3 with offload: one line changes.

    plain:  trainer = Trainer(model=model, args=args, train_dataset=data)
    ZeRO-3: trainer = Zero3Trainer(model=model, args=args, train_dataset=data,
                                   zero3_config=Zero3CpuOffloadConfig(...))

A tiny model built from a config (nothing is downloaded) learns synthetic token
sequences with accumulation 2, clipping 1.0, a cosine schedule with warm-up and weight
decay. ``--compare`` first trains the same model with plain ``Trainer`` (DDP under
torchrun) and checks that every logged loss is within 1e-5 and the saved weights within
1e-4 of it; ``--resume`` then reruns the second half from the middle checkpoint and
checks that it ends where the whole run ended.

    torchrun --nproc_per_node 2 examples/trainer_zero3.py --compare --resume
    python examples/trainer_zero3.py --arch gpt2 --compare       # one process
    python examples/trainer_zero3.py --resume-from DIR/zero3/checkpoint-4  # another world size
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from zero3_offload import Zero3CpuOffloadConfig
from zero3_offload.integrations import Zero3Trainer

SEQ = 16


def emit(report: dict) -> None:
    """One JSON line in one write: the ranks share stdout, and lines must not interleave."""
    os.write(1, (json.dumps(report) + "\n").encode())


def build_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=97,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Sequences of a repeating pattern with noise, with a few padded (-100) labels."""

    def __init__(self, count: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, vocab, (count, 1), generator=g)
        self.ids = (start + torch.arange(SEQ) * 3) % vocab
        self.labels = self.ids.clone()
        self.labels[::3, -3:] = -100  # unequal valid tokens per sequence

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def arguments(out: Path, steps: int, **extra: object) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_steps=steps,
        logging_steps=1,
        save_steps=steps // 2,
        save_total_limit=2,
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **extra,
    )


def train(kind: str, arch: str, out: Path, steps: int, resume: str | None = None) -> dict:
    model = build_model(arch)
    data = Tokens(64, model.config.vocab_size)
    args = arguments(out, steps)
    if kind == "plain":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    else:
        config = Zero3CpuOffloadConfig(cpu_memory_budget=2**30, gpu_param_memory_budget=2**28)
        trainer = Zero3Trainer(model=model, args=args, train_dataset=data, zero3_config=config)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 writes the files: the others read them after
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    if kind == "zero3":
        trainer.close()
    return {"losses": losses, "weights": out / "final" / "model.safetensors"}


def compare(a: dict, b: dict, what: str, loss_tol: float, weight_tol: float) -> None:
    steps = sorted(set(a["losses"]) & set(b["losses"]))
    loss = max(abs(a["losses"][s] - b["losses"][s]) for s in steps)
    wa, wb = load_file(a["weights"]), load_file(b["weights"])
    assert wa.keys() == wb.keys(), wa.keys() ^ wb.keys()
    weight = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    report = {
        "compare": what,
        "steps": len(steps),
        "max_loss_diff": loss,
        "max_weight_diff": weight,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        emit(report)
    if loss > loss_tol or weight > weight_tol:
        sys.exit(f"{what}: losses differ by {loss:.3g}, weights by {weight:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compare", action="store_true", help="against plain Trainer")
    parser.add_argument("--resume", action="store_true", help="resume from the middle")
    parser.add_argument("--out", type=Path, default=None, help="(default: a temporary dir)")
    parser.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="only resume from this checkpoint-N (saved at any number of ranks)",
    )
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # Every rank must use the same directory: under torchrun pass --out.
        root = opts.out or Path(tmp)
        if opts.resume_from is not None:
            resumed = train("zero3", opts.arch, root / "resumed", opts.steps, str(opts.resume_from))
            emit({"resumed_losses": resumed["losses"]})
            return
        ours = train("zero3", opts.arch, root / "zero3", opts.steps)
        if int(os.environ.get("RANK", "0")) == 0:
            emit({"zero3_losses": ours["losses"]})
        if opts.compare:
            plain = train("plain", opts.arch, root / "plain", opts.steps)
            compare(ours, plain, f"Zero3Trainer vs Trainer ({opts.arch})", 1e-5, 1e-4)
        if opts.resume:
            middle = root / "zero3" / f"checkpoint-{opts.steps // 2}"
            resumed = train("zero3", opts.arch, root / "resumed", opts.steps, str(middle))
            compare(resumed, ours, f"resumed vs whole ({opts.arch})", 1e-5, 1e-5)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        emit({"rank": int(os.environ.get("RANK", "0")), "peak_rss_mib": peak})


if __name__ == "__main__":
    main()
