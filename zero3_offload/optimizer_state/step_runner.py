"""The step runner: optimizer updates of this rank's shards, in worker threads.

[Note: optimizer update during backward]
With ``overlap_computation`` and a ``learning_rate`` passed to
``backward_pass``, a layer's update starts as soon as its gradient shard is
final: when its reduce-scatter completed on the last micro-step of an
accumulation window. The update (CPU optimizer math, then re-encoding the
compute copy) runs in a worker thread while the event loop's thread computes
the backward of the layers before it. ``optimizer_step`` then only waits.
Updates cannot start early when the step needs every gradient first: global
norm clipping (the norm covers all shards of all ranks) and fp16 loss scaling
(an inf anywhere skips the whole step); then, and when a layer occurs twice in
``layer_names``, every update starts in ``optimizer_step``, still one worker
task per layer. A failure in a backward whose updates started early leaves the
layers already updated as they are (the error says so).
"""

from __future__ import annotations

import asyncio

import torch

from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.gradient.reducer import GradientReducer, PendingGradient
from zero3_offload.gradient.store import GradientStore
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state.loss_scaler import LossScaler
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.parameter.store import ParameterStore

__all__ = ["StepRunner"]

log = get_logger(__name__)


class StepRunner:
    """Runs each layer's optimizer update and compute-copy refresh in a worker thread.

    Args:
        config: accumulation, clipping and compute dtype come from here.
        params: master shards and compute copies.
        grads: accumulated gradient shards.
        optimizer: per-layer optimizers.
        workers: the CPU worker threads.
        comm: collectives (global norm, inf check).
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
    ) -> None:
        self._k = config.gradient_accumulation_steps
        self._clip = config.gradient_clipping
        self._overlap = config.overlap_computation
        self._fp16 = config.compute_dtype == torch.float16
        self._params = params
        self._grads = grads
        self._optimizer = optimizer
        self._workers = workers
        self._comm = comm
        self.loss_scaler: LossScaler | None = LossScaler() if self._fp16 else None
        self.stepped: set[str] = set()  # layers already updated in this window
        self.last_grad_norm: float | None = None  # global norm before clipping, last update

    def can_start_early(self, names: tuple[str, ...], calls_since_update: int) -> bool:
        """Whether this backward's layers may update as soon as their gradient is final."""
        return (
            self._overlap
            and calls_since_update == self._k - 1
            and self._clip == 0
            and self.loss_scaler is None
            and len(set(names)) == len(names)
        )

    async def update_layer(self, name: str, lr: float, grad_scale: float) -> None:
        """Scale ``name``'s gradient, step its optimizer, re-encode its compute copy."""
        grad = self._grads.get(name)

        def update() -> None:
            if grad_scale != 1.0:
                grad.mul_(grad_scale)
            self._optimizer.step(name, grad, lr)

        self.stepped.add(name)
        await self._workers.run("cpu-optimizer", name, "step", update)
        await self._workers.run(
            "compress", name, "step", lambda: self._params.refresh_compute_copy(name)
        )

    async def land_and_update(
        self, partitioner: GradientReducer, pending: PendingGradient, lr: float
    ) -> None:
        """Wait for a layer's reduce-scatter, commit its shard and update it at once.

        The shard is dropped once the layer is updated, so a backward holds only
        the shards in flight, not every layer's (its step no longer needs them).
        """
        shard = await partitioner.finish(pending)
        await self._grads.commit_layer(pending.layer, shard)
        await self.update_layer(pending.layer, lr, 1.0 / self._k)
        self._grads.drop(pending.layer)

    async def apply(self, lr: float) -> list[str] | None:
        """Update every layer not yet updated in this window; all layers in parallel.

        Returns:
            The layers updated in this window (early ones included), or None
            when fp16 loss scaling found inf/nan on some rank (step skipped).
        """
        try:
            if not await self._apply(lr):
                return None
            return sorted(self.stepped)
        finally:
            self.stepped.clear()

    async def _apply(self, lr: float) -> bool:
        remaining = [n for n in self._grads.layers() if n not in self.stepped]
        if not remaining:
            return True
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if self._k > 1 or loss_scale != 1.0:
            for name in remaining:
                self._grads.get(name).mul_(1.0 / (self._k * loss_scale))
        if self.loss_scaler is not None:
            found_inf = await self.loss_scaler.found_inf(self._grads.shards(), self._comm)
            self.loss_scaler.update(found_inf)
            if found_inf:
                log.warning(
                    "step_skipped",
                    rank=self._comm.rank,
                    reason="inf/nan gradient",
                    scale=self.loss_scaler.scale,
                )
                return False
        if self._clip > 0:
            self.last_grad_norm = await self._grads.clip_(self._clip, self._comm)
        await asyncio.gather(*(self.update_layer(name, lr, 1.0) for name in remaining))
        return True

    def reset(self) -> None:
        """Forget the window's progress and the loss scale."""
        self.stepped.clear()
        if self._fp16:
            self.loss_scaler = LossScaler()
