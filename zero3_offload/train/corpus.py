"""The byte-level training text: the Python standard library's own source.

Every machine with Python has it, so the default run needs no download. The
files are read in a fixed (sorted) order up to a size limit, so the corpus is
the same on every run of the same Python; the last ``eval_fraction`` of it is
held out for evaluation. With a tokenizer (``--model`` with one),
``ByteCorpus.tokenized`` turns each split into token ids. Each sequence of a
step is drawn at a place that depends only on ``(seed, split, step, its global
position in the step's batch)``, so a resumed run continues exactly where the
interrupted one stopped, whatever happened before, and a run resumed on fewer
ranks (with more accumulation, the same global batch) sees the same sequences.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from zero3_offload.data.text_check import check_text
from zero3_offload.errors import InputError

__all__ = ["VOCAB_SIZE", "ByteCorpus", "stdlib_files"]

VOCAB_SIZE = 256
"""One token per byte value."""

# Not the library's source: installed packages, byte-code caches and the test
# suites (which hold deliberately odd data such as bad encodings).
_SKIPPED_PARTS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby seeds apart


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The ``.py`` files of the standard library, sorted by relative path.

    Args:
        root: the library directory (default: ``sysconfig.get_paths()["stdlib"]``).

    Returns:
        The files, in an order that does not depend on the file system.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(base):
        # Pruned while walking: site-packages alone can hold far more than the stdlib.
        dirs[:] = [d for d in dirs if d not in _SKIPPED_PARTS]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


@attrs.frozen
class ByteCorpus:
    """Training and evaluation tokens as 1-D tensors: bytes (``uint8``) as read, or
    ``int64`` token ids after :meth:`tokenized`."""

    train: torch.Tensor  # 1D uint8 (bytes) or int64 (token ids)
    eval: torch.Tensor  # 1D, as train
    source: str  # where the bytes came from, for the run's banner

    @classmethod
    def load(
        cls, *, data: Path | None = None, max_bytes: int, eval_fraction: float = 0.05
    ) -> ByteCorpus:
        """Read the corpus: ``data`` (a file or a directory of text), or the stdlib.

        Args:
            data: a file, or a directory whose files are read in sorted order;
                ``None`` reads the standard library's ``.py`` files.
            max_bytes: stop reading once this many bytes are in.
            eval_fraction: the share held out at the end for evaluation.

        Returns:
            The corpus.

        Raises:
            InputError: when there is too little text to split, or a file of ``data`` is
                not UTF-8 text (a binary file, e.g. Parquet, named as text).
        """
        if data is None:
            files, source = stdlib_files(), f"Python {sysconfig.get_python_version()} stdlib"
        elif data.is_dir():
            files, source = sorted(p for p in data.rglob("*") if p.is_file()), str(data)
        else:
            files, source = [data], str(data)
        chunks, size = [], 0
        for path in files:
            if size >= max_bytes:
                break
            whole = path.read_bytes()
            chunk = whole[: max_bytes - size]
            if data is not None:  # a user's file must be text (a binary one is refused)
                check_text(path, chunk, complete=len(chunk) == len(whole))
            chunks.append(chunk)
            size += len(chunk)
        blob = b"".join(chunks)
        n_eval = max(int(len(blob) * eval_fraction), 1)
        if len(blob) - n_eval < 2 or n_eval < 2:
            raise InputError(f"{source}: {len(blob)} bytes are too few to train on")
        tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        source = f"{source}, {len(chunks)} files"
        return cls(train=tensor[:-n_eval], eval=tensor[-n_eval:], source=source)

    def tokenized(self, encode: Callable[[str], list[int]]) -> ByteCorpus:
        """This corpus as token ids: each split decoded as UTF-8 (invalid bytes replaced by
        U+FFFD) and passed to ``encode``, separately, so no token spans both.

        Args:
            encode: text -> token ids (e.g. a tokenizer without special tokens).

        Returns:
            A corpus of ``int64`` ids with the same ``source``.

        Raises:
            InputError: when a split has fewer than 2 tokens.
        """
        splits = []
        for name, data in (("train", self.train), ("eval", self.eval)):
            text = data.numpy().tobytes().decode("utf-8", errors="replace")
            ids = torch.tensor(encode(text), dtype=torch.int64)
            if ids.numel() < 2:
                raise InputError(
                    f"{self.source}: the {name} text gives {ids.numel()} token(s), too few "
                    "to train on: give more text"
                )
            splits.append(ids)
        return ByteCorpus(train=splits[0], eval=splits[1], source=self.source)

    def batch(
        self,
        *,
        split: str,
        seed: int,
        step: int,
        first: int,
        batch_size: int,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences at global positions ``first .. first + batch_size - 1`` of ``step``:
        inputs and next-token targets.

        Each sequence's window is drawn from ``(seed, split, step, position)`` alone, so a
        step's global batch is the same whatever the world size and accumulation that
        split it into micro-batches (the trainer gives micro-step ``m`` of rank ``r`` of
        ``W`` the positions from ``(m * W + r) * batch_size``).

        Args:
            split: ``"train"`` or ``"eval"``.
            seed: the run's seed.
            step: the optimizer step (or eval batch index).
            first: the global position of the micro-batch's first sequence in the step.
            batch_size: sequences in the batch.
            seq_len: tokens per sequence (fewer when the split is shorter).

        Returns:
            ``(x, y)``, both ``int64`` of shape ``(batch_size, seq_len)``; ``y`` is
            ``x`` shifted by one token.
        """
        data = self.train if split == "train" else self.eval
        span = min(seq_len, data.numel() - 1)
        starts = torch.empty(batch_size, 1, dtype=torch.int64)
        for i in range(batch_size):
            key = (seed, 0 if split == "train" else 1, step, first + i)
            g = torch.Generator().manual_seed(hash(key) * _MIX % 2**63)
            starts[i] = torch.randint(0, data.numel() - span, (1,), generator=g)
        idx = starts + torch.arange(span + 1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]
