"""Supervised fine-tuning with LoRA from the command line, offline: data, model, train, generate.

    python examples/sft_chat.py prepare demo      # chat data, a tiny Llama and its tokenizer
    zero3-offload train --model demo/model --data demo/train.jsonl \\
        --eval-data demo/heldout.jsonl \\
        --lora r=16,alpha=32,dropout=0.05,target=q_proj,k_proj,v_proj,o_proj \\
        --steps 150 --lr 1e-2 --export demo/adapter
    python examples/sft_chat.py generate demo/model demo/adapter --data demo/heldout.jsonl

``prepare`` writes a chat dataset built from Python itself: for every public name of
``builtins`` and every ``keyword.kwlist`` entry, a user asks what kind of name it is
(``What kind of name is `zip` in Python?``) and the assistant answers (``It is a
built-in function.``): a keyword, a built-in function, type, exception, warning or
constant. One name in six of each kind is held out (``heldout.jsonl``). Beside it, a
2-layer Llama (hidden 64) built from a config with random weights (seed 0, drawn wide
enough that its frozen output head can be confident) and a
byte-level BPE tokenizer trained on the dataset's text, with a chat template that
marks the assistant turns (``{% generation %}``) and ``<|end|>`` as the end of a turn,
and a ``generation_config.json`` (greedy, stop at ``<|end|>``).

``generate`` loads the base model with transformers, the adapter directory that
``--export`` wrote with ``PeftModel.from_pretrained`` (or a merged export as it is),
renders each question with the exported tokenizer's chat template and decodes
greedily with ``model.generate`` and the exported ``generation_config.json``.
Nothing is downloaded. How it works: docs/fine_tuning.md.
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import random
from pathlib import Path
from typing import Any

import torch

SPECIAL = ["<pad>", "<s>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUESTION = "What kind of name is `{name}` in Python?"
HELD_OUT_EVERY = 6  # one name in six of each kind


def kind_of(name: str) -> str:
    """What ``name`` is in Python: a keyword, or the kind of its ``builtins`` object."""
    if keyword.iskeyword(name):
        return "a keyword"
    value = getattr(builtins, name)
    if isinstance(value, type):
        if issubclass(value, Warning):
            return "a built-in warning"
        if issubclass(value, BaseException):
            return "a built-in exception"
        return "a built-in type"
    return "a built-in function" if callable(value) else "a built-in constant"


def conversation(name: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": QUESTION.format(name=name)},
            {"role": "assistant", "content": f"It is {kind_of(name)}."},
        ]
    }


def split_names() -> tuple[list[str], list[str]]:
    """Every keyword and public builtin, split by kind: (train, held out)."""
    names = sorted(set(keyword.kwlist) | {n for n in dir(builtins) if not n.startswith("_")})
    by_kind: dict[str, list[str]] = {}
    for name in names:
        by_kind.setdefault(kind_of(name), []).append(name)
    train, held_out = [], []
    rng = random.Random(0)
    for kind in sorted(by_kind):
        group = by_kind[kind]
        rng.shuffle(group)
        count = len(group) // HELD_OUT_EVERY
        held_out += group[:count]
        train += group[count:]
    rng.shuffle(train)
    return train, sorted(held_out)


def write_jsonl(path: Path, names: list[str]) -> None:
    path.write_text("".join(json.dumps(conversation(n)) + "\n" for n in names))


def chat_tokenizer(text: str) -> Any:
    """A byte-level BPE tokenizer trained on ``text``, with the chat template."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=512,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
    )
    tok.train_from_iterator([text], trainer)
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>", pad_token="<pad>"
    )
    out.chat_template = TEMPLATE
    return out


def prepare(out: Path) -> None:
    """The dataset, the tiny Llama and its tokenizer under ``out``."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    train, held_out = split_names()
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", held_out)
    text = (out / "train.jsonl").read_text() + (out / "heldout.jsonl").read_text()
    tokenizer = chat_tokenizer(text)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # Weights drawn 15x wider than transformers' default (0.02): the adapters
        # train on this random base, whose frozen head must be able to give confident
        # logits (at 0.02 they stay within about +-1.3 of each other, and the loss
        # cannot fall below about 5).
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=16,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"train: {len(train)} conversations in {out / 'train.jsonl'}")
    print(f"held out: {len(held_out)} conversations in {out / 'heldout.jsonl'}")
    print(f"model: {out / 'model'} ({model.num_parameters() / 1e6:.2f}M parameters, random)")


def load_export(model_dir: Path, export: Path) -> tuple[Any, Any, Any]:
    """The trained model, its tokenizer and generation config, from ``--export``'s
    directory: an adapter over ``model_dir`` or a merged model."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    generation = transformers.GenerationConfig.from_pretrained(export)
    if (export / "adapter_config.json").is_file():
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        model = PeftModel.from_pretrained(base, export)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(export)
    return model.eval(), tokenizer, generation


def answer(model: Any, tokenizer: Any, generation: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, generation_config=generation)
    new = out[0, prompt["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def generate(model_dir: Path, export: Path, data: Path | None, questions: list[str]) -> None:
    """Answer ``questions`` and each question of ``data`` (comparing with its answer)."""
    model, tokenizer, generation = load_export(model_dir, export)
    for question in questions:
        print(f"Q: {question}\nA: {answer(model, tokenizer, generation, question)}")
    if data is None:
        return
    right, total = 0, 0
    for line in data.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        got = answer(model, tokenizer, generation, user["content"])
        right, total = right + (got == assistant["content"]), total + 1
        print(f"Q: {user['content']}\nA: {got}  (data: {assistant['content']})")
    print(f"held-out answers equal to the data's: {right}/{total}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write the dataset, the model and its tokenizer")
    prep.add_argument("out", type=Path)
    gen = commands.add_parser("generate", help="answer questions with an exported model")
    gen.add_argument("model", type=Path, help="the base model directory (--model)")
    gen.add_argument("export", type=Path, help="the --export directory")
    gen.add_argument("--data", type=Path, help="answer every question of this JSONL file")
    gen.add_argument("--question", action="append", default=[], help="a question to answer")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out)
    else:
        generate(args.model, args.export, args.data, args.question)


if __name__ == "__main__":
    main()
