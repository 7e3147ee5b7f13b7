"""``--model DIR``: fine-tuning a local transformers causal LM instead of the built-in GPT.

What is read from ``DIR``:

* ``config.json`` (required): the model is ``AutoModelForCausalLM.from_config`` of it.
* ``model.safetensors`` or ``model.safetensors.index.json`` with its shards: the
  starting weights, read by ``Zero3CpuOffloadManager.from_pretrained``, each rank
  only the slices of its own shards. Without them the model is built eagerly on
  every rank with ``torch.manual_seed(seed)`` (transformers' own initialisation)
  and handed to the manager, which keeps rank 0's values.
* with ``--lora``/``--peft-config`` the model trained is the peft model over it (the
  base weights frozen); with ``--freeze`` the parameters matching its globs are frozen.
* a tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``,
  ...): ``AutoTokenizer.from_pretrained(DIR, local_files_only=True)``, applied to
  the text without special tokens. Without one the bytes of the text are the
  token ids, which needs a vocabulary of at least 256.

:func:`check_model_dir` runs in the launcher, reading ``config.json`` as JSON, so
mistakes are reported before any rank starts; the rest runs on each rank.
``transformers`` is imported only by these functions, never at module import.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError
from zero3_offload.integrations.meta_model import build_model_from_directory
from zero3_offload.integrations.peft_pretrained import reset_adapters
from zero3_offload.integrations.pretrained_load import PretrainedShards
from zero3_offload.integrations.require import require_transformers
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.train.corpus import VOCAB_SIZE, ByteCorpus
from zero3_offload.train.decay_split import trainer_param_groups
from zero3_offload.train.freeze import freeze_parameters
from zero3_offload.train.sources import OptionError

__all__ = [
    "build_manager",
    "check_export_dir",
    "check_model_dir",
    "has_tokenizer",
    "has_weights",
    "load_tokenizer",
    "tokenize",
    "vocab_size",
]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)
# Config keys holding the longest input, by model family (llama, gpt2, ...).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions")


def has_weights(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory`` holds safetensors weights (one file or a sharded index)."""
    return any((Path(directory) / name).is_file() for name in _WEIGHT_FILES)


def has_tokenizer(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory`` holds one of the files a transformers tokenizer is read from."""
    return any((Path(directory) / name).is_file() for name in _TOKENIZER_FILES)


def check_model_dir(model: str, *, seq_len: int) -> None:
    """Check ``--model`` before any rank starts: a directory with a readable ``config.json``
    whose context fits ``seq_len`` and, without a tokenizer, whose vocabulary holds the
    256 byte values; and transformers installed.

    Raises:
        OptionError: naming ``--model`` (or ``--seq-len``) and what is wrong; when
            transformers is not installed, the message says how to install it.
    """
    path = Path(model)
    if not path.is_dir():
        raise OptionError(f"--model {model}: not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise OptionError(
            f"--model {model}: no config.json (expected a transformers model directory, "
            "as save_pretrained writes)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OptionError(f"--model {model}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict):
        raise OptionError(f"--model {model}: config.json does not hold a JSON object")
    context = next((config[k] for k in _CONTEXT_KEYS if isinstance(config.get(k), int)), None)
    if context is not None and seq_len > context:
        raise OptionError(
            f"--seq-len={seq_len} is invalid: the model of {model} takes at most {context} "
            f"positions; give --seq-len {context} or less"
        )
    vocab = config.get("vocab_size")
    if not has_tokenizer(path) and isinstance(vocab, int) and vocab < VOCAB_SIZE:
        raise OptionError(
            f"--model {model}: no tokenizer, so the text's bytes are the tokens, but the "
            f"model's vocab_size is {vocab} < {VOCAB_SIZE}: add a tokenizer to the directory"
        )
    if importlib.util.find_spec("transformers") is None:
        try:
            require_transformers()  # raises ConfigError with the install hint
        except ConfigError as exc:
            raise OptionError(f"--model {model}: {exc}") from None


def check_export_dir(export: str) -> None:
    """Check ``--export`` before any rank starts: it must not exist, or be an empty directory.

    Raises:
        OptionError: when it is a file or a directory with files in it.
    """
    path = Path(export)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise OptionError(
            f"--export {export}: exists and is not an empty directory: give a new directory"
        )


def build_manager(
    config: Zero3CpuOffloadConfig,
    group: dist.ProcessGroup,
    directory: str | os.PathLike[str],
    *,
    seed: int,
    peft_config: Any = None,
    freeze: Sequence[str] | None = None,
) -> Zero3CpuOffloadManager:
    """The module-mode manager of the causal LM in ``directory`` (every rank calls it).

    With weights: ``from_pretrained`` (each rank reads its slices). Without: the model
    is built eagerly from ``config.json`` after ``torch.manual_seed(seed)``, so every
    rank draws the same values, and the manager keeps rank 0's. With ``peft_config``
    the model is that peft model over it, its adapters initialised from ``seed`` (see
    [Note: peft from pretrained]); with ``freeze`` the parameters matching those globs
    are frozen first (``train.freeze``). Either way the parameters are in HF Trainer's
    default groups: no weight decay for biases and norm weights (``train.decay_split``).

    Raises:
        ConfigError: when transformers (or peft) is missing or cannot build the model,
            a LoRA target that names no module, a ``--freeze`` glob that matches nothing.
        CheckpointError: for unreadable weights or weights that do not match the config.
        MemoryBudgetError: when the shards do not fit their budget.
    """
    try:
        if has_weights(directory):
            return _from_weights(config, group, directory, seed, peft_config, freeze)
        torch.manual_seed(seed)
        model = build_model_from_directory(directory, on_meta=False)
        if peft_config is not None:
            model = _peft_model(model, peft_config)
            reset_adapters(model, seed)  # the values from_pretrained gives them
        if freeze is not None:
            freeze_parameters(model, freeze)
    except ValueError as exc:  # peft: target modules not found, unsupported layers
        if peft_config is None:
            raise
        raise ConfigError(f"the LoRA adapters of --lora/--peft-config: {exc}") from exc
    groups = trainer_param_groups(model, config.optimizer)
    return Zero3CpuOffloadManager(config, group, model, param_groups=groups)


def _peft_model(model: nn.Module, peft_config: Any) -> nn.Module:
    """``get_peft_model`` of a copy of ``peft_config`` (peft fills in fields of the one
    it is given)."""
    from peft import get_peft_model

    return get_peft_model(model, copy.deepcopy(peft_config))


def _from_weights(
    config: Zero3CpuOffloadConfig,
    group: dist.ProcessGroup,
    directory: str | os.PathLike[str],
    seed: int,
    peft_config: Any,
    freeze: Sequence[str] | None,
) -> Zero3CpuOffloadManager:
    if freeze is not None:
        with PretrainedShards(directory) as shards:
            freeze_parameters(shards.model, freeze)
            groups = trainer_param_groups(shards.model, config.optimizer)
            return Zero3CpuOffloadManager(
                config, group, shards.model, shard_source=shards.shard, param_groups=groups
            )
    # The names of the groups, from the model built on meta (no weights read).
    names = build_model_from_directory(directory, on_meta=True)
    if peft_config is not None:
        names = _peft_model(names, peft_config)
    groups = trainer_param_groups(names, config.optimizer)
    return Zero3CpuOffloadManager.from_pretrained(
        config,
        group,
        directory,
        param_groups=groups,
        peft_config=None if peft_config is None else copy.deepcopy(peft_config),
        seed=seed,
    )


def load_tokenizer(directory: str | os.PathLike[str]) -> Any | None:
    """``directory``'s transformers tokenizer, or None when it holds no tokenizer files.

    Raises:
        ConfigError: when transformers is missing or cannot load the tokenizer.
    """
    if not has_tokenizer(directory):
        return None
    transformers = require_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"--model {directory}: cannot load its tokenizer ({exc})") from exc


def vocab_size(model: nn.Module) -> int:
    """Rows of the model's input embedding (``num_embeddings``; the config's ``vocab_size``
    for an embedding without it). Read from the module, not the weight, whose storage
    the manager has freed."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    return int(rows) if isinstance(rows, int) else int(model.config.vocab_size)


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        # verbose=False: a whole corpus is longer than model_max_length, which is fine here.
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        return list(ids)

    return encode


def tokenize(corpus: ByteCorpus, tokenizer: Any | None, vocab: int) -> ByteCorpus:
    """The corpus as the model's tokens: ``tokenizer``'s ids, or the bytes themselves.

    Raises:
        ConfigError: when the ids do not fit the model's vocabulary of ``vocab`` rows.
        InputError: when a split has too little text.
    """
    if tokenizer is None:
        if vocab < VOCAB_SIZE:
            raise ConfigError(
                f"the model's vocabulary has {vocab} rows < {VOCAB_SIZE}: without a tokenizer "
                "the text's bytes are the tokens; add a tokenizer to the model directory"
            )
        return corpus
    tokens = corpus.tokenized(_encoder(tokenizer))
    largest = int(max(tokens.train.max(), tokens.eval.max()))
    if largest >= vocab:
        raise ConfigError(
            f"the tokenizer gives token id {largest}, but the model's vocabulary has {vocab} "
            "rows: use the tokenizer the model was made for"
        )
    return tokens
