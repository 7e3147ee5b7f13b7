"""What the supervised fine-tuning tests share: a chat tokenizer built here, a tiny
Llama for it, and small chat datasets (no download).

The tokenizer is a byte-level BPE trained on the datasets' own words, with the
special tokens of a simple chat template: ``<|user|>...<|end|><|assistant|>...<|end|>``.
``MARKED`` wraps the assistant turns in ``{% generation %}`` (transformers' assistant
masks); ``UNMARKED`` does not (masks are found by rendering prefixes); ``UNSTABLE``
renders the last turn differently from the others, so it is not prefix-stable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers

SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
VOCAB = 320
_TURN = "<|{{ m['role'] }}|>"
MARKED = (
    "{{ bos_token }}{% for m in messages %}" + _TURN + "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
UNMARKED = (
    "{{ bos_token }}{% for m in messages %}" + _TURN + "{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
UNSTABLE = (
    "{{ bos_token }}{% for m in messages %}" + _TURN + "{{ m['content'] }}"
    "{% if not loop.last %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
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
WORDS = [
    "what",
    "is",
    "plus",
    "minus",
    "the",
    "answer",
    "please",
    "tell",
    "me",
    "hello",
    "fox",
    "dog",
    "says",
]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """A user asks one or two sums, the assistant answers each (sometimes a system line)."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "answer with one number"})
    for _ in range(rng.choice((1, 1, 2))):
        a, b = rng.randrange(7), rng.randrange(6)
        messages.append({"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}"})
        messages.append({"role": "assistant", "content": f"the answer is {NUMBERS[a + b]}"})
    return messages


def conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(count)]


def chat_tokenizer(template: str = MARKED) -> Any:
    """A fast BPE tokenizer of ``VOCAB`` ids with ``template`` as its chat template."""
    text = " ".join(NUMBERS + WORDS)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
    )
    tok.train_from_iterator([text] * 20, trainer)
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    out.chat_template = template
    return out


def tiny_llama_config(**overrides: Any) -> Any:
    """A 2-layer Llama (hidden 32) for the chat tokenizer's vocabulary."""
    from hf_models import TINY_DECODER

    fields = {**TINY_DECODER, "vocab_size": VOCAB, "max_position_embeddings": 128, **overrides}
    return transformers.LlamaConfig(**fields)


def save_model_dir(path: Path, *, template: str = MARKED, seed: int = 1) -> Path:
    """A model directory: the tiny Llama's weights (drawn from ``seed``) and the tokenizer."""
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    chat_tokenizer(template).save_pretrained(path)
    return path


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
