"""The micro-steps and evaluations of a fine-tune on examples (``--data`` of records).

:class:`SftSteps` holds the run's :class:`~zero3_offload.data.sft_data.SftData`
and its data position (global examples consumed): each step takes the next
global batch of ``batch_size * accumulation * world_size`` examples (see [Note:
example order]), runs ``forward(**batch.model_kwargs())`` and
``backward(out.loss, tokens=n)`` per micro-step (``out.loss`` is transformers'
mean over the micro-batch's ``n`` learned tokens, so the update follows the global
token mean: [Note: token-weighted gradients]) and advances the position. The
position goes into the checkpoint's ``training_state`` and comes back on resume.
"""

from __future__ import annotations

from typing import Any

from zero3_offload.data.sft_data import SftData
from zero3_offload.errors import Zero3Error
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.train.step_counts import StepCounts

__all__ = ["SftSteps"]


class SftSteps:
    """A rank's steps over ``data``.

    Args:
        data: the run's examples.
        manager: the module-mode manager of the causal LM.
        rank: this rank.
        world_size: ranks of the group.
        batch_size: examples per rank per micro-step.
        accumulation: micro-steps per optimizer step.
        eval_batches: at most this many eval micro-batches per rank.
    """

    def __init__(
        self,
        data: SftData,
        manager: Zero3CpuOffloadManager,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        accumulation: int,
        eval_batches: int,
    ) -> None:
        self.data, self.manager = data, manager
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.accumulation, self.eval_batches = (
            batch_size,
            accumulation,
            eval_batches,
        )
        self.position = 0  # global examples consumed before the next step

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step over all ranks and micro-steps."""
        return self.batch_size * self.accumulation * self.world_size

    async def train_step(self, lr: float) -> StepCounts:
        """One optimizer step on the next global batch; this rank's counts."""
        loss_sum = valid = real = padding = examples = 0.0
        for micro in range(self.accumulation):
            batch = self.data.train_batch(
                self.position,
                micro=micro,
                rank=self.rank,
                world_size=self.world_size,
                batch_size=self.batch_size,
            )
            out = await self.manager.forward(**batch.model_kwargs())
            tokens = batch.valid_tokens
            await self.manager.backward(out.loss, tokens=tokens)
            if tokens:  # an all-masked micro-batch's loss is NaN: it weighs nothing
                loss_sum += float(out.loss.item()) * tokens
            valid, real, padding = (
                valid + tokens,
                real + batch.real_tokens,
                padding + batch.padding_tokens,
            )
            examples += batch.examples
            await self.manager.optimizer_step(lr)
        self.position += self.global_batch
        return StepCounts(loss_sum, valid, real, padding, examples)

    async def eval_sums(self) -> tuple[float, float]:
        """This rank's sum of per-token losses on the eval set, and its learned tokens
        (forward only; the caller sums them over ranks)."""
        total = count = 0.0
        n = self.data.eval_batches(
            world_size=self.world_size, batch_size=self.batch_size, limit=self.eval_batches
        )
        for i in range(n):
            batch = self.data.eval_batch(
                i, rank=self.rank, world_size=self.world_size, batch_size=self.batch_size
            )
            out = await self.manager.forward(**batch.model_kwargs())
            tokens = batch.valid_tokens
            if tokens:
                total += float(out.loss.item()) * tokens
                count += tokens
        return total, count

    def training_state(self) -> dict[str, Any]:
        """The data position, for the checkpoint's ``training_state``."""
        return {
            "data": {
                "examples_seen": self.position,
                "epoch": self.data.epoch(self.position),
                "train_examples": len(self.data.train),
                "seed": self.data.order.seed,
            }
        }

    def restore(self, state: Any, where: str) -> None:
        """Continue from the data position of a checkpoint's ``training_state``.

        Raises:
            Zero3Error: when ``state`` holds no data position, or the position of a run
                on another number of examples or seed (not the same data).
        """
        data = state.get("data") if isinstance(state, dict) else None
        seen = data.get("examples_seen") if isinstance(data, dict) else None
        if not isinstance(seen, int) or isinstance(seen, bool) or seen < 0:
            raise Zero3Error(
                f"{where}: no data position in its training_state (not saved by a run on "
                "examples): resume it with the data it was trained on"
            )
        count, seed = data.get("train_examples"), data.get("seed")
        if count != len(self.data.train) or seed != self.data.order.seed:
            raise Zero3Error(
                f"{where}: saved by a run on {count} training examples with seed {seed}; "
                f"--data now gives {len(self.data.train)} with --seed {self.data.order.seed}: "
                "resume with the same data and seed"
            )
        self.position = seen
