"""What rank 0 shows while training: a progress bar on a terminal, else plain lines.

The bar (rich) shows the step, loss, tokens/s, step time, this rank's CPU
memory (RSS) and device memory; evaluations and checkpoints are printed above
it. Without a terminal (a pipe, a file, CI) one line per ``log_every`` steps
is printed instead, so logs stay readable. Other ranks print nothing.
"""

from __future__ import annotations

import collections
import sys
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from zero3_offload.memory.memory_stats import Zero3MemoryStats
from zero3_offload.train.step_counts import StepCounts

__all__ = ["Reporter"]

_MIB = 2**20


class Reporter:
    """Rank 0's view of the run.

    Args:
        enabled: False on every rank but 0: nothing is printed.
        bar: draw a progress bar (a terminal) instead of plain lines.
        total: the run's last step.
        log_every: steps between plain lines.
        tokens_per_step: tokens of all ranks in one optimizer step.
        stream: where to print (default ``sys.stdout``).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        bar: bool,
        total: int,
        log_every: int,
        tokens_per_step: int,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self.total = total
        self.log_every = log_every
        self.tokens_per_step = tokens_per_step
        self._losses: collections.deque[float] = collections.deque(maxlen=log_every)
        stream = stream or sys.stdout
        self.console = Console(file=stream, highlight=False, width=None if bar else 200)
        self._progress: Progress | None = None
        self._task = 0
        if enabled and bar:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                auto_refresh=False,  # refreshed at each step: no drawing thread in a rank
            )

    def line(self, text: str) -> None:
        """Print ``text`` (above the bar, if there is one)."""
        if self.enabled:
            self.console.print(text, markup=False, soft_wrap=True)

    def start(self, first: int) -> None:
        """Begin at step ``first`` (the checkpoint's step when resuming)."""
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self.total, completed=first, stats=""
            )

    def step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        seconds: float,
        memory: Zero3MemoryStats,
        counts: StepCounts | None = None,
        examples_seen: int | None = None,
    ) -> None:
        """Report finished step ``step`` (1-based) and its mean loss over the ranks.

        The loss shown is the mean of the last ``log_every`` steps: one step's
        loss on a small batch is noisy. With ``counts`` (the step's, summed over the
        ranks) tokens/s counts the tokens of examples (not padding); with
        ``examples_seen`` (a run on examples) the line also shows the learned (valid)
        tokens, the padding fraction and the examples seen so far.
        """
        if not self.enabled:
            return
        self._losses.append(loss)
        mean = sum(self._losses) / len(self._losses)
        tokens = counts.real if counts is not None else self.tokens_per_step
        data = ""
        if counts is not None and examples_seen is not None:
            data = (
                f"valid {counts.valid:,.0f}  pad {counts.padding_fraction:.1%}  "
                f"seen {examples_seen:,}  "
            )
        stats = (
            f"loss {mean:.4f}  lr {lr:.2e}  {tokens / seconds:,.0f} tok/s  {data}"
            f"{seconds * 1000:.0f} ms/step  rss {memory.process_rss_bytes / _MIB:,.0f} MiB  "
            f"device {memory.device_allocated_bytes / _MIB:,.0f} MiB"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats, refresh=True)
        elif step % self.log_every == 0 or step == self.total:
            self.line(f"step {step}/{self.total}  {stats}")

    def close(self) -> None:
        """Stop drawing the bar (leaving its last state on screen)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
