"""The supervised fine-tuning data of a run: the train and eval examples as batches.

:meth:`SftData.load` reads ``--data`` (and ``--eval-data``), renders every example
with the tokenizer (``chat_render``), applies the ``--max-seq-len`` rule
(``token_dataset``) and keeps the two sets; :meth:`train_batch` gives a rank's
micro-batch of a step by [Note: example order], collated padded or packed
([Note: packed rows]); :meth:`eval_batch` walks the eval set in file order.
Every rank loads the same data and computes its own batches: no data moves
between ranks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from zero3_offload.data.bad_records import BadRecords
from zero3_offload.data.batch import Batch
from zero3_offload.data.chat_render import Renderer
from zero3_offload.data.collate import collate
from zero3_offload.data.example_loader import load_examples
from zero3_offload.data.order import ExampleOrder
from zero3_offload.data.source import find_source
from zero3_offload.data.token_dataset import IGNORED, TokenDataset
from zero3_offload.errors import InputError
from zero3_offload.logging import get_logger

__all__ = ["SftData"]

log = get_logger(__name__)


class SftData:
    """The train and eval examples of a run and their batches.

    Args:
        train: the training examples.
        eval: the held-out examples.
        seed: the order's seed.
        pack: pack examples into rows of ``max_len`` tokens.
        max_len: ``--max-seq-len``.
        pad_id: the padding token id.
        source: what the data is, for the banner.
    """

    def __init__(
        self,
        train: TokenDataset,
        eval: TokenDataset,
        *,
        seed: int,
        pack: bool,
        max_len: int,
        pad_id: int,
        source: str,
    ) -> None:
        self.train, self.eval = train, eval
        self.order = ExampleOrder(len(train), seed)
        self.pack, self.max_len, self.pad_id, self.source = pack, max_len, pad_id, source

    @classmethod
    def load(
        cls,
        data: str | Path,
        *,
        tokenizer: Any,
        vocab: int,
        max_len: int,
        seed: int,
        eval_data: str | Path | None = None,
        data_format: str = "auto",
        data_field: str | None = None,
        loss_on: str = "assistant",
        bad_records: str = "fail",
        pack: bool = False,
        eval_fraction: float = 0.05,
    ) -> SftData:
        """Read, render and split the data (every rank calls it and gets the same).

        Without ``eval_data`` the last ``eval_fraction`` of the examples in file order
        (at least one) is held out.

        Raises:
            InputError: a file that cannot be read as what it is, no recognisable
                shape, a bad record under ``bad_records="fail"``, too few examples.
            ConfigError: a tokenizer without the chat template the data needs, a
                template that is not prefix-stable, ids beyond ``vocab``.
        """
        renderer = Renderer(tokenizer, loss_on)

        def read(path: str | Path, bad: BadRecords) -> list[Any]:
            source = find_source(path)
            if not source.structured:
                raise InputError(
                    f"{path}: text, not examples: --eval-data takes records or a dataset "
                    "(for text, the held-out share of --data is used)"
                )
            return load_examples(source, data_format=data_format, data_field=data_field, bad=bad)

        bad, eval_bad = BadRecords(bad_records), BadRecords(bad_records)
        examples = read(data, bad)
        if eval_data is not None:
            held = read(eval_data, eval_bad)
        else:
            if len(examples) < 2:
                raise InputError(
                    f"{data}: {len(examples)} example(s): too few to hold some out for "
                    "evaluation; give more, or --eval-data"
                )
            n_eval = max(int(len(examples) * eval_fraction), 1)
            examples, held = examples[:-n_eval], examples[-n_eval:]

        def build(items: list[Any], policy: BadRecords, name: str) -> TokenDataset:
            return TokenDataset.build(
                items, renderer, max_len=max_len, vocab=vocab, bad=policy, name=name
            )

        pad = tokenizer.pad_token_id
        pad = tokenizer.eos_token_id if pad is None else pad
        train = build(examples, bad, f"training example of {data}")
        held_out = build(held, eval_bad, f"eval example of {eval_data or data}")
        log.info(
            "sft_data",
            source=str(data),
            eval_source=None if eval_data is None else str(eval_data),
            train_examples=len(train),
            eval_examples=len(held_out),
            learned_tokens=train.learned_tokens,
            truncated=train.truncated + held_out.truncated,
            dropped=train.dropped + held_out.dropped,
            skipped=train.skipped + held_out.skipped,
        )
        return cls(
            train,
            held_out,
            seed=seed,
            pack=pack,
            max_len=max_len,
            pad_id=0 if pad is None else int(pad),
            source=str(data),
        )

    def epoch(self, position: int) -> int:
        """The epoch that global ``position`` is in."""
        return position // len(self.train)

    def train_batch(
        self, start: int, *, micro: int, rank: int, world_size: int, batch_size: int
    ) -> Batch:
        """``rank``'s micro-batch ``micro`` of the step whose first global position is
        ``start`` (see [Note: example order])."""
        positions = self.order.micro_batch(
            start, micro=micro, rank=rank, world_size=world_size, batch_size=batch_size
        )
        picked = [self.order.example(p) for p in positions]
        return collate(
            [self.train.ids[i] for i in picked],
            [self.train.labels[i] for i in picked],
            pack=self.pack,
            max_len=self.max_len,
            pad_id=self.pad_id,
        )

    def eval_batches(self, *, world_size: int, batch_size: int, limit: int) -> int:
        """Eval micro-batches per rank that cover the eval set once (at most ``limit``)."""
        return min(limit, math.ceil(len(self.eval) / (world_size * batch_size)))

    def eval_batch(self, index: int, *, rank: int, world_size: int, batch_size: int) -> Batch:
        """``rank``'s eval micro-batch ``index``: the eval set in file order. Positions past
        its end repeat examples with every label ignored, so every rank runs the same
        number of forwards and each example counts once."""
        first = index * world_size * batch_size + rank * batch_size
        ids, labels, counted = [], [], 0
        for p in range(first, first + batch_size):
            i = p % len(self.eval)
            ids.append(self.eval.ids[i])
            if p < len(self.eval):
                labels.append(self.eval.labels[i])
                counted += 1
            else:
                labels.append(torch.full_like(self.eval.labels[i], IGNORED))
        return collate(
            ids, labels, pack=self.pack, max_len=self.max_len, pad_id=self.pad_id, counted=counted
        )

    def describe(self) -> str:
        """One line for the banner: examples, tokens, and what the rules left out."""
        t, e = self.train, self.eval
        return (
            f"{self.source}: {len(t)} train examples ({t.learned_tokens} learned tokens), "
            f"{len(e)} eval examples; {t.truncated + e.truncated} truncated and "
            f"{t.dropped + e.dropped} dropped by --max-seq-len {self.max_len}, "
            f"{t.skipped + e.skipped} bad record(s) skipped"
            f"{'; packed rows' if self.pack else '; padded to the longest example'}"
        )
