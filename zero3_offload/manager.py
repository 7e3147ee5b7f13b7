"""The coordinator: orders gathers, compute, reduce-scatters and optimizer steps.

It holds no algorithm of its own: sharding lives in ``parameter_management``,
autograd in ``layer_execution``, gradients in ``gradient_management``, the step
math in ``optimizer_state``, updates in ``update``, loss scaling in
``mixed_precision``, prefetch in ``prefetch``; checkpoints and stats live in the
``manager_checkpoint`` and ``manager_observe`` mixins, its construction in
``manager_wiring``. See [Note: kept activations] in ``layer_execution`` and
[Note: optimizer update during backward] in ``update``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zero3_offload._checks import check_backward_args, check_lr, resolve_layer_names
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError, InputError, StateError, Zero3Error
from zero3_offload.gradient_management import (
    PendingGradient,
)
from zero3_offload.layer_execution import ForwardRecord, SavedStep
from zero3_offload.logging import get_logger
from zero3_offload.manager_checkpoint import CheckpointMixin
from zero3_offload.manager_lifecycle import LifecycleMixin
from zero3_offload.manager_observe import ObservabilityMixin
from zero3_offload.manager_wiring import WiringMixin
from zero3_offload.memory_management import relieve_pressure
from zero3_offload.model_sharding import (
    InitFn,
    reset_parameters_in_order,
)

__all__ = ["Zero3CpuOffloadManager"]

log = get_logger(__name__)


class Zero3CpuOffloadManager(WiringMixin, CheckpointMixin, ObservabilityMixin, LifecycleMixin):
    """Trains a model with ZeRO stage 3 across the ranks of a process group.

    Every rank builds the manager with the same model; rank 0's initial values
    are broadcast, then each rank keeps only its shard of every layer.

    Args:
        config: the configuration (validated again here).
        process_group: the group whose ranks share the model (e.g. from
            :func:`init_process_group`).
        model: an ``nn.Module`` whose named children are the layers, or a
            mapping of layer name to module. It may be built on the meta
            device: layers are then materialised one at a time (see
            [Note: meta initialisation] in ``model_sharding``).
        init_fn: ``init_fn(layer_name, module)`` initialises a materialised
            meta layer in place; the default calls ``reset_parameters()`` of
            its submodules in registration order.

    Raises:
        ConfigError: when the config cannot run here (e.g. CUDA asked but absent).
        Zero3Error: when the model cannot be partitioned.
        CommunicationError: when the initial broadcast fails.
    """

    def __init__(
        self,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        *,
        init_fn: InitFn = reset_parameters_in_order,
    ) -> None:
        self._wire(config, process_group, model, init_fn)
        self._record: ForwardRecord | None = None
        self._calls_since_update = 0  # optimizer_step calls since the last update
        self._early_lr: float | None = None  # lr of updates started in the last backward
        self._window_started: float | None = None  # first forward of the accumulation window
        self._closed = False
        log.info(
            "manager_ready",
            rank=self.rank,
            world_size=self.mapping.world_size,
            layers=len(self.layers),
            parameters=self.partitioner.total_numel(),
            owned_parameters=self.partitioner.owned_numel(),
        )

    # ----------------------------------------------------------------- checks

    @classmethod
    def from_meta(
        cls,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        *,
        seed: int | None = None,
        init_fn: InitFn = reset_parameters_in_order,
    ) -> Zero3CpuOffloadManager:
        """Build the manager from a model constructed on the meta device.

        No rank ever holds the full model: each layer is materialised,
        initialised, sharded and freed before the next. With ``seed`` (the seed
        the model would have been built with eagerly) and the default
        ``init_fn``, the values equal eager construction's.

        Example::

            with torch.device("meta"):
                model = GPT(config)
            manager = Zero3CpuOffloadManager.from_meta(cfg, pg, model, seed=0)
        """
        if seed is not None:
            torch.manual_seed(seed)
        return cls(config, process_group, model, init_fn=init_fn)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the manager is closed; build a new one")

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless ``compute_dtype`` is float16)."""
        scaler = self.updater.loss_scaler
        return None if scaler is None else scaler.scale

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping at the last update (clipping on only)."""
        return self.updater.last_grad_norm

    # ----------------------------------------------------------------- passes

    async def forward_pass(self, x: torch.Tensor, layer_names: Sequence[str]) -> torch.Tensor:
        """Run ``layer_names`` in order on ``x``; keep what backward needs.

        Under ``torch.no_grad()`` (evaluation) nothing is kept: no graph, no
        inputs, and no backward may follow.

        Args:
            x: input of the first layer (moved to the device; floating inputs
                are cast to the compute dtype).
            layer_names: the layers to run, in order.

        Returns:
            The last layer's output (no autograd history; see backward_pass).

        Raises:
            LayerNotFoundError: for a name that is not a layer.
            LayerExecutionError: when a layer raises; the manager's state is unchanged.
            CommunicationError: when a gather fails.
        """
        self._check_open()
        names = resolve_layer_names(self.layers, layer_names)
        if not isinstance(x, torch.Tensor):
            raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
        started = time.perf_counter()
        if self._window_started is None:
            self._window_started = started
        self.cache.phase = "forward"
        h = self.executor.to_compute(x)
        steps: list[SavedStep | None] = []
        training = torch.is_grad_enabled()
        try:
            # An evaluation forward has its own trace, so it does not disturb
            # the prediction that a training forward is followed by its backward.
            await self.prefetch.begin_pass("forward" if training else "inference", names)
            next_order = self.prefetch.next_after_forward(names) if training else ()
            for i, name in enumerate(names):
                module = await self.prefetch.acquire(names, i)
                t0 = time.perf_counter()
                h, saved = self.executor.forward(name, module, h, keep=training)
                steps.append(saved)
                self._record_compute(name, "forward", t0)
                self.prefetch.finish_use(names, i, next_order=next_order)
        except BaseException:
            await self.prefetch.release_all()  # nothing stays in flight
            raise
        self._record = (
            ForwardRecord(layer_names=names, steps=steps, output_shape=h.shape)
            if training
            else None
        )
        self._stats.forward_passes += 1
        self._stats.forward_samples += x.shape[0] if x.dim() else 1
        self._stats.total_forward_time += time.perf_counter() - started
        return h

    def _record_compute(self, name: str, phase: str, t0: float) -> None:
        t1 = time.perf_counter()
        self._stats.record_layer(name, phase, t1 - t0)
        self.timeline.record("compute", name, phase, t0, t1)

    async def backward_pass(
        self,
        grad_output: torch.Tensor,
        layer_names: Sequence[str],
        *,
        learning_rate: float | None = None,
    ) -> torch.Tensor | None:
        """Backpropagate ``grad_output`` through ``layer_names`` in reverse.

        Each layer's parameter gradient is reduce-scattered (mean over ranks) so
        this rank keeps the shard it owns; the reduce-scatter of one layer
        overlaps the compute of the next. Gradients are committed only when the
        whole pass succeeded, unless updates started early (below).

        Args:
            grad_output: d(this rank's micro-batch mean loss)/d(forward output).
            layer_names: the same names as the forward pass.
            learning_rate: the learning rate of the optimizer step this backward
                completes. With ``overlap_computation`` it lets each layer's
                update start while earlier layers still run backward (see
                [Note: optimizer update during backward]); ``optimizer_step``
                must then be called with the same value.

        Returns:
            The gradient with respect to the forward input, or None when the
            input is not floating point (e.g. token ids).

        Raises:
            StateError: without a matching forward_pass.
            InputError: when ``grad_output``'s shape differs from the output's.
            LayerExecutionError: when a layer raises.
            CommunicationError: when a collective fails.
        """
        self._check_open()
        record = check_backward_args(
            self._record, resolve_layer_names(self.layers, layer_names), grad_output
        )
        names = record.layer_names
        early_lr = None
        if learning_rate is not None:
            early_lr = check_lr(learning_rate)
            if not self.updater.can_start_early(names, self._calls_since_update):
                early_lr = None
        started = time.perf_counter()
        self.cache.phase = "backward"
        g: torch.Tensor | None = self.executor.to_compute(grad_output)
        if self.loss_scale is not None:
            g = g * self.loss_scale
        pending: list[PendingGradient] = []
        updates: list[asyncio.Future[torch.Tensor | None]] = []  # reduce-scatter landings
        try:
            order = names[::-1]
            await self.prefetch.begin_pass("backward", order)
            for i, name in enumerate(order):
                step = len(names) - 1 - i
                if g is None:
                    raise StateError(
                        f"layer {names[step + 1]!r} has a non-floating input, so no gradient "
                        f"reaches layer {name!r}: it must come first in layer_names"
                    )
                module = await self.prefetch.acquire(order, i)
                has_params = self.layouts[name].numel > 0
                if has_params:
                    prepared = await self.grad_partitioner.prepare(name, module)
                t0 = time.perf_counter()
                saved = record.steps[step]
                record.steps[step] = None  # its activations go as soon as the layer is done
                assert saved is not None
                g = self.executor.backward(name, module, saved, g)
                self._record_compute(name, "backward", t0)
                if has_params:
                    p = await self.grad_partitioner.start_reduce_scatter(name, module, prepared)
                    pending.append(p)
                    if early_lr is not None:
                        landing = self.updater.land_and_update(self.grad_partitioner, p, early_lr)
                    else:
                        landing = self.grad_partitioner.finish(p)
                    updates.append(asyncio.ensure_future(landing))
                self.prefetch.finish_use(order, i)
            waited = time.perf_counter()
            results = await asyncio.gather(*updates)
            # Waits for every layer's reduce-scatter (and early update): no single layer's.
            self.timeline.record("wait", "*", "backward", waited, time.perf_counter())
            if early_lr is None:
                await self.grads.commit(zip((p.layer for p in pending), results, strict=True))
            else:
                self.grads.count_micro_step()
        except BaseException as exc:
            # Nothing may stay in flight; the first error is the one raised. The
            # forward's graphs are (partly) consumed: the next backward needs a new forward.
            self._record = None
            for task in updates:
                task.cancel()
            for task in updates:
                with contextlib.suppress(BaseException):
                    await task
            for p in pending:
                with contextlib.suppress(Zero3Error):
                    await p.collective.wait()
            with contextlib.suppress(Zero3Error):
                await self.prefetch.release_all()
            if self.updater.stepped and isinstance(exc, Zero3Error):
                raise type(exc)(
                    f"{exc} (layers {sorted(self.updater.stepped)} were already updated by this "
                    "backward's early optimizer step)"
                ) from exc
            raise
        self._early_lr = early_lr
        self._record = None
        self._stats.backward_passes += 1
        self._stats.total_backward_time += time.perf_counter() - started
        return g

    async def optimizer_step(self, learning_rate: float) -> bool:
        """Count a micro-step; at every ``gradient_accumulation_steps``-th, update.

        Each rank updates only its own shards (one worker-thread task per layer,
        running in parallel), then refreshes their compute copies.

        Args:
            learning_rate: the step's learning rate (>= 0).

        Returns:
            True when the parameters were updated by this call; False inside an
            accumulation window, or when fp16 loss scaling found inf/nan and
            skipped the step on every rank.

        Raises:
            ConfigError: for a negative or non-finite learning rate, or one that
                differs from the learning rate given to the early update.
            StateError: when no backward_pass ran since the last call.
        """
        self._check_open()
        lr = check_lr(learning_rate)
        if self.grads.micro_steps <= self._calls_since_update:
            raise StateError(
                "optimizer_step called without a backward_pass since the last call: "
                "call forward_pass and backward_pass for each micro-batch first"
            )
        if self._early_lr is not None and lr != self._early_lr:
            raise ConfigError(
                f"learning_rate={lr!r} differs from the learning_rate={self._early_lr!r} given "
                "to backward_pass, whose updates already started: pass the same value"
            )
        self._stats.micro_steps += 1
        self._calls_since_update += 1
        k = self.config.gradient_accumulation_steps
        if self._calls_since_update < k:
            await self.prefetch.after_update(())  # parameters unchanged: prefetch the forward
            return False
        started = time.perf_counter()
        await self.prefetch.drain()  # no gather may read a shard while it is updated
        updated = await self.updater.apply(lr)
        self.grads.clear()
        self._calls_since_update = 0
        self._early_lr = None
        if updated is not None:
            self._stats.optimizer_steps += 1
        pressure = await relieve_pressure(self.memory, self.prefetch, self.comm)
        await self.prefetch.after_update(updated or ())
        ended = time.perf_counter()
        self._stats.total_optimizer_time += ended - started
        self._end_step(ended, stepped=updated is not None, pressure=pressure.pressure)
        return updated is not None
