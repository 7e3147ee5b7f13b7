"""The step runner: optimizer updates of this rank's shards, in worker threads.

[Note: optimizer update during backward]
With ``overlap_computation`` and a ``learning_rate`` passed to
``backward_pass``, a layer's update starts as soon as its gradient shard is
final: when its reduce-scatter completed on the last micro-step of an
accumulation window. The update (CPU optimizer math, then re-encoding the
compute copy) runs in a worker thread while the event loop's thread computes
the backward of the layers before it. ``optimizer_step`` then only waits.
When a layer occurs twice in ``layer_names`` every update starts in
``optimizer_step``, still one worker task per layer. A failure in a backward
whose updates started early leaves the layers already updated as they are
(the error says so).

[Note: speculative update]
Global-norm clipping (the norm covers every shard of every rank), fp16
loss scaling and the non-finite guard (an inf anywhere skips the step) need
every gradient before any update is known to be right. With
``speculative_step`` the early updates start anyway, with the gradient as it
lands (scaled by ``1 / (accumulation steps * loss scale)``, or
``1 / (window tokens * loss scale)`` when token-weighted, as the step would
scale it): before each, the layer's fp32 master shard and optimizer state are
copied into reused buffers (:class:`SpeculationBackup`), and its gradient shard
is held. ``optimizer_step``
then validates: the inf check and the global norm run over the held shards
exactly as without speculation. If nothing is found and the clip coefficient
is not below 1 (``clip_grad_norm_`` would not change the gradients), the
speculative updates stand: they are the updates the step would have made. If
clipping applies, every speculated layer is restored bitwise from its copy,
the gradients are scaled by the coefficient, and the layers are updated again;
on inf/nan they are restored and the step is skipped. Either way the result
is bitwise the non-speculative step's. The cost is the copies (three shard
sizes per layer for AdamW, counted in ``speculation_backup_bytes``) and, when
clipping fires, a second update of the speculated layers.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Sequence

import torch

from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.gradient.reducer import GradientReducer, PendingGradient
from zero3_offload.gradient.store import GradientStore
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state.loss_scaler import LossScaler
from zero3_offload.optimizer_state.nonfinite_guard import NonFiniteGuard, NonFiniteReport
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.optimizer_state.speculation_backup import SpeculationBackup
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.stats.phase import Phase

__all__ = ["StepRunner"]

log = get_logger(__name__)

_ALL_LAYERS = "(all layers)"  # the layer of timeline work that covers every layer


class StepRunner:
    """Runs each layer's optimizer update and compute-copy refresh in a worker thread.

    Args:
        config: accumulation, clipping and compute dtype come from here.
        params: master shards and compute copies.
        grads: accumulated gradient shards.
        optimizer: per-layer optimizers.
        workers: the CPU worker threads.
        comm: collectives (global norm, inf check).
        backup: where speculative updates save the pre-update state (see
            [Note: speculative update]).
        guard: with ``skip_nonfinite_steps``, what locates and counts the skipped
            steps (see [Note: non-finite guard] in ``optimizer_state.nonfinite_guard``);
            None: inf/nan gradients are applied, as plain torch optimizers do.
    """

    def __init__(
        self,
        *,
        config: Zero3CpuOffloadConfig,
        params: ParameterStore,
        grads: GradientStore,
        optimizer: ShardOptimizers,
        workers: WorkerThreads,
        comm: Collectives,
        backup: SpeculationBackup,
        guard: NonFiniteGuard | None = None,
    ) -> None:
        self._k = config.gradient_accumulation_steps
        self._speculate = config.speculative_step
        self._backup = backup
        self._clip = config.gradient_clipping
        self._overlap = config.overlap_computation
        self._fp16 = config.compute_dtype == torch.float16
        self._params = params
        self._grads = grads
        self._optimizer = optimizer
        self._workers = workers
        self._comm = comm
        self.guard = guard
        self.loss_scaler: LossScaler | None = LossScaler() if self._fp16 else None
        self.stepped: set[str] = set()  # layers already updated in this window
        # The global norm before clipping of the last closed step (computed with clipping on).
        self.last_grad_norm: float | None = None
        # Valid tokens over all ranks of the last closed token-weighted window (None: the
        # last window was not token-weighted); see [Note: token-weighted gradients].
        self.last_tokens: int | None = None
        self._tokens: int | None = None  # the open window's total, once agreed
        self.rollbacks = 0  # steps whose speculative updates were undone
        self._skipped: NonFiniteReport | None = None  # the open step's skip, for the guard

    def can_start_early(self, names: tuple[str, ...], calls_since_update: int) -> bool:
        """Whether this backward's layers may update as soon as their gradient is final."""
        return (
            self._overlap
            and calls_since_update == self._k - 1
            and (self._speculate or not self._needs_validation())
            and len(set(names)) == len(names)
        )

    def _needs_validation(self) -> bool:
        # Clipping, fp16 loss scaling or the non-finite guard: an update is known right
        # only once every gradient is in (see [Note: speculative update]).
        return self._clip > 0 or self.loss_scaler is not None or self.guard is not None

    async def early_rate(
        self,
        lr: float | None,
        names: tuple[str, ...],
        calls_since_update: int,
        *,
        tokens: int | None,
    ) -> float | None:
        """The learning rate a backward's early updates run with, or None (they wait for
        ``optimizer_step``).

        A token-weighted backward whose updates may start agrees on the window's token
        total first (a collective; its own ``tokens`` counted ahead), since each early
        update divides by it; a total of 0 starts none (the step skips).
        """
        if lr is None or not self.can_start_early(names, calls_since_update):
            return None
        if tokens is None:
            return lr
        self._tokens = await self._grads.token_total(self._comm, pending=tokens)
        return lr if self._tokens > 0 else None

    def _grad_scale(self) -> float:
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # A token-weighted window holds the gradient of the sum of per-token losses.
        count = self._k if self._tokens is None else self._tokens
        return 1.0 / (count * loss_scale)

    async def update_layer(
        self, name: str, lr: float, grad_scale: float, *, save: bool = False
    ) -> None:
        """Scale ``name``'s gradient, step its optimizer, re-encode its compute copy.

        With ``save`` the master shard and optimizer state are copied into the
        backup first (a speculative update).
        """
        grad = self._grads.get(name)

        def update() -> None:
            if save:
                self._backup.save(name)
            if grad_scale != 1.0:
                grad.mul_(grad_scale)
            self._optimizer.step(name, grad, lr)

        self.stepped.add(name)
        # With the disk tier: read before, written back after (see [Note: disk tier]).
        async with self._optimizer.resident(name, write=True):
            await self._workers.run("cpu-optimizer", name, Phase.STEP, update)
            await self._refresh(name)

    async def _refresh(self, name: str) -> None:
        await self._workers.run(
            "compress", name, Phase.STEP, lambda: self._params.refresh_compute_copy(name)
        )

    async def land_and_update(
        self, partitioner: GradientReducer, pending: PendingGradient, lr: float
    ) -> None:
        """Wait for a layer's reduce-scatter, commit its shard and update it at once.

        The shard is dropped once the layer is updated, so a backward holds only
        the shards in flight, not every layer's (its step no longer needs them);
        a speculative update keeps it for the validation.
        """
        shard = await partitioner.finish(pending)
        await self._grads.commit_layer(pending.layer, shard)
        partitioner.forget_pending(pending.layer)
        owned = self._optimizer.owned
        if owned is not None and owned.has(pending.layer):
            return  # whole-parameter updates run in optimizer_step (see [Note: owned parameters])
        if self._needs_validation():
            await self.update_layer(pending.layer, lr, self._grad_scale(), save=True)
            return
        await self.update_layer(pending.layer, lr, self._grad_scale())
        self._grads.drop(pending.layer)

    def keep_updates(self) -> None:
        """Let the speculative updates made so far stand (their backward failed; the
        error names the layers), as non-speculative early updates do."""
        for name in self._backup.saved():
            self._backup.discard(name)

    async def _roll_back(self, names: list[str]) -> None:
        """Restore ``names`` bitwise from their pre-update copies, compute copies included."""

        async def restore(name: str) -> None:
            restore_state = functools.partial(self._backup.restore, name)
            await self._workers.run("cpu-optimizer", name, Phase.ROLLBACK, restore_state)
            await self._refresh(name)

        await asyncio.gather(*(restore(name) for name in names))
        self.rollbacks += 1
        log.info("speculative_update_rolled_back", rank=self._comm.rank, layers=len(names))

    async def apply(
        self,
        lr: float,
        *,
        first: Sequence[str] = (),
        ready: Callable[[list[str]], None] | None = None,
    ) -> list[str] | None:
        """Update every layer not yet updated in this window; all layers in parallel.

        Speculative updates are validated first (see [Note: speculative update]).

        Args:
            lr: the learning rate.
            first: layers to update first (the next forward's first layers).
            ready: called with ``first`` once those layers hold this step's
                values, while the others may still be updating (the caller
                gathers them for the next forward); not called when the step
                is skipped.

        Returns:
            The layers updated in this window (early ones included), or None
            when the step was skipped on every rank: fp16 loss scaling or the
            non-finite guard found an inf/nan on some rank, or a token-weighted
            window had no valid token on any rank.
        """
        self._skipped = None
        try:
            if not await self._apply(lr, list(first), ready):
                return None
            return sorted(self.stepped)
        finally:
            self.stepped.clear()
            self.keep_updates()
            self._tokens = None

    async def _skip(
        self, speculated: list[str], reason: str, *, nonfinite: bool = True, **fields: object
    ) -> bool:
        """Skip the step on every rank (each rank calls it at the same point): speculative
        updates restored, nothing else updated; where an inf/nan came from, with the guard.
        Returns False, for ``_apply`` to return."""
        if speculated:
            await self._roll_back(speculated)
        if nonfinite and self.guard is not None:
            self._skipped = await self.guard.locate(self._grads)
            fields |= {
                "layer": self._skipped.first_layer,
                "layers": list(self._skipped.layers),
                "loss_ranks": list(self._skipped.loss_ranks),
                "detail": self._skipped.describe(),
            }
        log.warning("step_skipped", rank=self._comm.rank, reason=reason, **fields)
        return False

    async def _agree_tokens(self, speculated: list[str]) -> bool:
        """For a token-weighted window, agree on its token total; False when it is 0 (the
        step is skipped on every rank: there is no loss to follow)."""
        self._tokens = await self._grads.token_total(self._comm) if self._grads.weighted else None
        self.last_tokens = self._tokens
        if self._tokens != 0:
            return True
        return await self._skip(speculated, "no valid tokens on any rank", nonfinite=False)

    async def _scale_and_check(self, remaining: list[str], speculated: list[str]) -> bool:
        """Scale the window's remaining gradients; False when the step is skipped for an
        inf/nan: fp16's loss scaler, or the guard's check when clipping is off (with
        clipping, the norm is the check; see [Note: non-finite guard])."""
        check = self.guard is not None and self.loss_scaler is None and self._clip == 0
        if not check:
            self._grads.scale_layers_(remaining, self._grad_scale())
        else:  # in a worker thread: its interval is the check's cost on the timeline

            def scale_and_check() -> bool:
                found = self._grads.scale_layers_(remaining, self._grad_scale(), check=True)
                return found or self._grads.has_nonfinite(speculated)

            found = await self._workers.run("inf-check", _ALL_LAYERS, Phase.STEP, scale_and_check)
            flag = torch.tensor([float(found)], dtype=torch.float32, device=self._comm.device)
            await self._comm.all_reduce_sum(flag, what="the inf/nan check")
            if flag.item() > 0:
                return await self._skip(speculated, "inf/nan gradient")
        if self.loss_scaler is not None:
            found_inf = await self.loss_scaler.found_inf(self._grads.shards(), self._comm)
            self.loss_scaler.update(found_inf)
            if found_inf:
                scale = self.loss_scaler.scale
                return await self._skip(speculated, "inf/nan gradient", scale=scale)
        return True

    async def _apply(
        self, lr: float, first: list[str], ready: Callable[[list[str]], None] | None
    ) -> bool:
        remaining = [n for n in self._grads.layers() if n not in self.stepped]
        speculated = self._backup.saved()
        if not await self._agree_tokens(speculated):
            return False
        if not remaining and not speculated:
            if ready is not None:
                ready(first)
            return True
        if not await self._scale_and_check(remaining, speculated):
            return False
        if self._clip > 0:
            norm = await self._grads.global_norm(self._comm)
            self.last_grad_norm = norm
            if self.guard is not None and not math.isfinite(norm):
                return await self._skip(speculated, "inf/nan gradient", norm=norm)
            _, clipped = await self._grads.clip_(self._clip, self._comm, norm=norm)
            if clipped and speculated:
                await self._roll_back(speculated)
                remaining += speculated
        owned = self._optimizer.owned
        if owned is not None:  # collectives: before any update task (see [Note: owned parameters])
            await owned.update(remaining, self._optimizer.master, self._grads.get, lr)
        # The next forward's first layers go first; their gathers can then start
        # while the other layers update.
        remaining.sort(key=lambda name: name not in first)
        tasks = [asyncio.ensure_future(self.update_layer(n, lr, 1.0)) for n in remaining]
        leading = [t for n, t in zip(remaining, tasks, strict=True) if n in first]
        try:
            await asyncio.gather(*leading)
            if ready is not None:
                ready(first)
        finally:
            # Every update is awaited, also when one failed or the caller's call did.
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            task.result()  # the first failure, if any
        return True

    def close_step(self, *, updated: bool) -> None:
        """The step closed (the guard counts a skip for an inf/nan, or a good update)."""
        if self.guard is None:
            return
        skipped = self._skipped
        # Under fp16 an overflow alone is the scaler's: only a non-finite loss counts.
        counts = skipped is not None and (self.loss_scaler is None or bool(skipped.loss_ranks))
        self.guard.close_step(skipped, updated=updated, counts=counts)
        self._skipped = None

    def note_loss(self, value: torch.Tensor, tokens: int | None) -> None:
        """Record whether a backward's loss (chain mode: its ``grad_output``) is finite,
        for the guard's report (nothing without the guard)."""
        if self.guard is not None:
            self.guard.note_loss(value, tokens)

    def check_nonfinite(self) -> None:
        """Raise when the guard's limit of skips in a row is reached.

        Raises:
            NonFiniteError: ``max_consecutive_nonfinite`` steps in a row were skipped.
        """
        if self.guard is not None:
            self.guard.check()

    def reset(self) -> None:
        """Forget the window's progress, the loss scale, the pre-update copies and the
        guard's skips in a row."""
        self.stepped.clear()
        self._skipped = None
        if self.guard is not None:
            self.guard.reset()
        self._tokens = None
        self._backup.clear()
        if self._fp16:
            self.loss_scaler = LossScaler()
