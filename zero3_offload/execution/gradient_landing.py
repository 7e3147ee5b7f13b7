"""The landing of a backward's reduce-scatters, and the abandoning of a failed backward.

Both runners launch a layer's (unit's) reduce-scatter as soon as its gradient
is complete, so it overlaps the backward of the layers before it. Each launch
gets a *landing*: a task that waits for the collective and hands the averaged
shard over, to the layer's early update (see [Note: optimizer update during
backward]) or to the end of the pass. When the pass succeeded,
:meth:`GradientLanding.land` waits for every landing and commits the shards to
the gradient store together, so a backward that fails part way commits
nothing; :meth:`GradientLanding.abandon` then leaves nothing in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from zero3_offload.errors import Zero3Error
from zero3_offload.execution.pass_result import PassResult
from zero3_offload.gradient.reducer import GradientReducer, PendingGradient
from zero3_offload.gradient.store import GradientStore
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.timeline import Timeline

__all__ = ["GradientLanding"]


class GradientLanding:
    """Lands the reduce-scatters of a backward (either runner's) and abandons failed ones.

    Args:
        reducer: whose reduce-scatters land.
        grads: where the shards are committed.
        steps: runs a layer's update as its shard lands (early updates).
        prefetch: releases what a failed pass left gathered.
        timeline: where the wait for the last landings is added.
    """

    def __init__(
        self,
        *,
        reducer: GradientReducer,
        grads: GradientStore,
        steps: StepRunner,
        prefetch: PrefetchScheduler,
        timeline: Timeline,
    ) -> None:
        self._reducer = reducer
        self._grads = grads
        self._steps = steps
        self._prefetch = prefetch
        self._timeline = timeline

    def start(
        self, result: PassResult, pending: PendingGradient, *, early_lr: float | None = None
    ) -> None:
        """Start ``pending``'s landing: at the end of the pass, or (``early_lr``) into the
        layer's update as soon as it arrives."""
        result.pending.append(pending)
        if early_lr is not None:
            landing = self._steps.land_and_update(self._reducer, pending, early_lr)
        else:
            landing = self._reducer.finish(pending)
        result.landings.append(asyncio.ensure_future(landing))

    async def land(
        self, result: PassResult, *, early: bool = False, tokens: int | None = None
    ) -> None:
        """Wait for every landing of ``result`` and commit the shards (``early``: the early
        updates committed each shard already; the micro-step is counted), with the pass's
        valid ``tokens`` when it was token-weighted."""
        waited = time.perf_counter()
        shards = await asyncio.gather(*result.landings)
        # Waits for every layer's reduce-scatter (and early update): no single layer's.
        self._timeline.add("wait", "*", Phase.BACKWARD, waited, time.perf_counter())
        if early:
            self._grads.count_micro_step(tokens)
            return
        layers = (p.layer for p in result.pending)
        await self._grads.commit(zip(layers, shards, strict=True), tokens=tokens)
        self._reducer.forget_pending()

    async def abandon(self, result: PassResult) -> None:
        """Leave nothing of a failed backward in flight; the caller raises its first error.

        The pass's shards not committed are dropped. Updates already made stand,
        speculative ones too (the caller's error names them).
        """
        self._steps.keep_updates()
        self._reducer.forget_pending()
        for task in result.landings:
            task.cancel()
        for task in result.landings:
            with contextlib.suppress(BaseException):
                await task
        for p in result.pending:
            with contextlib.suppress(Zero3Error):
                await p.collective.wait()
        with contextlib.suppress(Zero3Error):
            await self._prefetch.release_all()
