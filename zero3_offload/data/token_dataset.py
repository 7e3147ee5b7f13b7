"""Rendered examples as tensors, after the ``--max-seq-len`` rule.

[Note: truncation rule]
An example longer than ``--max-seq-len`` (``--seq-len``) tokens keeps its first
``max_seq_len`` tokens (the end is cut: a long prompt loses its answer first, as in
TRL and transformers' tokenizers). When a learned token is left among them it is
counted as *truncated* and trained on; when none is (the prompt alone fills the
window) it is *dropped* and counted. An example with no learned token to predict
(e.g. a one-token text) is dropped too. Both counts are in the run's banner. The
first token of every example is never a target (nothing comes before it), so its
label is always ignored: in a packed row it would otherwise be predicted from the
previous example's last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from zero3_offload.data.bad_record import BadRecord
from zero3_offload.data.bad_records import BadRecords
from zero3_offload.data.chat_render import Renderer
from zero3_offload.data.example import Example
from zero3_offload.errors import ConfigError, InputError

__all__ = ["IGNORED", "TokenDataset"]

IGNORED = -100
"""The label of a token that is not learned (cross-entropy's ``ignore_index``)."""


@attrs.frozen
class TokenDataset:
    """Each example's token ids and labels (``IGNORED`` where not learned), in order."""

    ids: list[torch.Tensor]  # int64, 1-D, at most max_len each
    labels: list[torch.Tensor]  # int64, as ids; IGNORED where not learned
    truncated: int  # examples cut to max_len that kept a learned token
    dropped: int  # examples left out: nothing learned within max_len
    skipped: int  # bad records left out (--bad-records skip)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def learned_tokens(self) -> int:
        """Label tokens learned over the whole dataset."""
        return sum(int((lab != IGNORED).sum()) for lab in self.labels)

    @classmethod
    def build(
        cls,
        examples: Sequence[Example],
        renderer: Renderer,
        *,
        max_len: int,
        vocab: int,
        bad: BadRecords,
        name: str = "example",
    ) -> TokenDataset:
        """Render ``examples`` and apply the truncation rule (see [Note: truncation rule]).

        ``name`` says which set they are, for the error when none is left.

        Raises:
            BadRecord: a bad example under the ``fail`` policy.
            ConfigError: for token ids beyond the model's ``vocab`` rows, or a chat
                template that cannot be used (see ``chat_render``).
            InputError: when no example is left.
        """
        ids_out, labels_out, truncated, dropped = [], [], 0, 0
        for example in examples:
            try:
                ids, mask = renderer.render(example)
            except BadRecord as exc:
                bad.bad(exc.where, exc.reason)
                continue
            if len(ids) > max_len:
                ids, mask = ids[:max_len], mask[:max_len]
                cut = True
            else:
                cut = False
            if not any(mask[1:]):
                dropped += 1
                continue
            truncated += cut
            if max(ids) >= vocab:
                raise ConfigError(
                    f"{example.where}: the tokenizer gives token id {max(ids)}, but the "
                    f"model's vocabulary has {vocab} rows: use the tokenizer the model was "
                    "made for"
                )
            x = torch.tensor(ids, dtype=torch.int64)
            y = torch.where(torch.tensor(mask, dtype=torch.bool), x, IGNORED)
            y[0] = IGNORED
            ids_out.append(x)
            labels_out.append(y)
        if not ids_out:
            raise InputError(
                f"no {name} left ({dropped} dropped by --max-seq-len {max_len}, "
                f"{bad.skipped} bad record(s) skipped)"
            )
        return cls(ids_out, labels_out, truncated, dropped, bad.skipped)
