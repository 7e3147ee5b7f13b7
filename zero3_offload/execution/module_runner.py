"""Running a whole model's own forward and backward under ZeRO-3 (module mode).

[Note: module mode]
The model's ``forward`` runs unchanged, with its keyword arguments, outputs
and buffers, on a dedicated *model thread*; the event loop stays free. Hooks
connect the model's code to the components on the loop: each hook hands a
coroutine to the loop (``run_coroutine_threadsafe``) and blocks the model
thread until it is done, so every gather, reduce-scatter and copy is an
awaitable on the loop while the model's code waits. The hooks:

- forward pre-hook of the model: the root unit (parameters outside every
  other unit) is acquired for the whole pass;
- forward pre-hook of each unit module: the unit is acquired through the
  prefetch scheduler, at its position in the predicted order (the order
  recorded by the previous pass of the same kind); the look-ahead gathers of
  the next units start there;
- forward post-hook of each unit: the unit is released (unless the scheduler
  keeps it), and a hook is put on its outputs that acquires it again when
  their gradient arrives (the unit's backward is about to run);
- saved-tensor hooks over the whole forward: a saved tensor that is a view of
  a gathered unit's buffer is saved as its place in that buffer (see
  [Note: saved activations] in ``execution.layer_runner``) and rebuilt from the
  buffer gathered again in backward, gathering it first if needed;
- a post-accumulate-grad hook on every parameter: before backward runs, the
  autograd graph is walked once to count, per unit, the parameters that will
  receive a gradient; when a unit's count reaches zero its gradients are
  complete, so they are reduce-scattered (overlapping the backward of the
  units before it) and the unit is released. Units whose count is unknown
  (e.g. under reentrant checkpointing) are completed at the end of backward,
  in forward order, identically on every rank.

Code that reads a unit's parameters without calling its module (a fused loss reading
``lm_head.weight``) holds the unit with :meth:`ModuleRunner.gathered`; a forward that
reads a released parameter otherwise raises (see [Note: released reads] in
``execution.released_reads``). A forward given ``labels=`` may compute a causal LM's loss
in chunks through the head, never making the full logits (see [Note: the head's tiled
loss] in ``execution.head_loss``); a unit whose outputs carry no gradient that way enters
the backward when a saved view of it is unpacked.

A parameter used by several units belongs to the root unit (see
``engine.model_units``), so tied weights have one gradient, accumulated by
autograd from both uses before the hook sees it.

Gradients accumulate in place into the flat buffer the reduce-scatter sends
(taken when a unit enters its backward; the root takes a buffer of its own for
the whole pass, since its gradients arrive at both ends). Once the backward
reaches the other units the root's gathered values are freed (fp32: its
gradient views keep accumulating; a saved weight unpacked later gathers it
again), and once no other unit remains the gather pool and the idle gradient
buffers are freed, so the end of the backward, its peak, holds nothing idle.
Before each hook returns to the model's code, every collective queued so far
has been launched (see the launcher in ``comm.collectives``): the model may
call torch.distributed itself (transformers' ``synced_gpus`` does).

The reduce-scatters land through :class:`GradientLanding`, as in chain mode;
the passes are timed by the same :class:`PassClock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import attrs
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import InputError, LayerExecutionError, StateError, Zero3Error
from zero3_offload.execution.activation_offload import ActivationOffload
from zero3_offload.execution.buffer_slot import BufferSlot
from zero3_offload.execution.gradient_landing import GradientLanding
from zero3_offload.execution.head_loss import HeadLoss
from zero3_offload.execution.pass_result import PassResult
from zero3_offload.execution.product_saving import ProductSaving
from zero3_offload.execution.released_reads import ReleasedReadCheck
from zero3_offload.gradient.reducer import GradientReducer, GradientSlot
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.parameter.flat_layout import ROOT_UNIT
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.parameter.unit_params import UnitParams
from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.sequence.sequence_parallel import SequenceParallel
from zero3_offload.stats.pass_clock import PassClock
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.tensor_bytes import storage_bytes

__all__ = ["ModuleRunner", "UnitPass"]

_LAYOUT_WARNING = "grad and param do not obey the gradient layout contract"

T = TypeVar("T")


@attrs.define
class UnitPass:
    """One module-mode pass in progress: where each unit is in the order as it runs.

    ``result`` is what the pass leaves: the units in the order they were entered,
    what autograd saved for backward, the reduce-scatters launched.
    """

    phase: Phase
    predicted: tuple[str, ...]  # the order expected from the trace
    result: PassResult
    on_track: bool = True  # result.layers is a prefix of predicted so far
    where: dict[str, tuple[tuple[str, ...], int]] = attrs.Factory(dict)  # unit -> (order, i)
    started: dict[str, float] = attrs.Factory(dict)  # unit -> perf_counter at entry
    expected: dict[str, int] = attrs.Factory(dict)  # backward: gradients still to accumulate
    done: set[str] = attrs.Factory(set)  # backward: units whose gradients were reduced
    units_left: int = 0  # backward: non-root units of the forward not done yet
    slots: dict[str, GradientSlot] = attrs.Factory(dict)  # backward: buffers taken at entry
    skipped: set[str] = attrs.Factory(set)  # backward: the forward's units without one
    awaiting_input: set[str] = attrs.Factory(set)  # backward: input gradients still to come

    @property
    def observed(self) -> list[str]:
        """Units in the order they were entered."""
        return self.result.layers


class ModuleRunner:
    """Runs ``model(*args, **kwargs)`` and its backward with units gathered on demand.

    See [Note: module mode].

    Args:
        model: the whole model; its own ``forward`` runs.
        units: unit name -> its parameters (the root unit under ``ROOT_UNIT``).
        unit_modules: unit name -> its submodule, for every non-root unit.
        gatherer: the gathered units' buffers (saved views point into them).
        prefetch: gathers and releases units, in the predicted order, under the budget.
        reducer: reduce-scatters units' gradients.
        landing: lands the reduce-scatters, or abandons a failed backward.
        steps: the loss scale.
        comm: the group's collectives (flushed before the model's code runs).
        clock: counts passes and units' compute.
        device: the compute device (the call's tensors are moved there).
        after_forward: called with the phase at the end of every forward (the C heap
            trimmed after a training one, when ``trim_heap_after_forward`` is on).
        before_last_unit: called with the phase as a forward enters its last unit of
            ``unit_modules`` (every other one entered: in a transformers model most
            often the head, as the loss begins); the C heap trimmed in a training one,
            likewise.
        recompute: wrap every unit's forward in (non-reentrant) activation
            checkpointing, except units that are one ``nn.Linear`` or ``nn.Embedding``
            (they save only their input anyway: a recomputation would only add their
            output, an LM head's logits, to the backward's peak, and its compute). A
            training forward of a model whose ``config.use_cache`` is on is then called
            with ``use_cache=False`` unless the call sets it, as transformers does under
            its own checkpointing: a recomputed attention layer would otherwise append
            its keys and values to the KV cache a second time and attend to both.
        products: with ``recompute``, picks the checkpointed units (the last ones) that
            also save their products (but low-rank ones); see [Note: saved products] in
            ``execution.product_saving``. None: every one recomputes its whole forward.
        activations: with ``recompute``, where checkpointed units' saved inputs go
            between a training forward and its backward (see [Note: activation offload]
            in ``execution.activation_offload``). None: they stay on the device.
        sequence: sequence parallelism: each forward runs this rank's slice of the
            sequence, its loss made whole (see [Note: sequence parallelism] in
            ``zero3_offload.sequence``); None runs the call's inputs as they are.
        head_loss: computes the loss of a forward given ``labels=`` in chunks, without the
            full logits (see [Note: the head's tiled loss] in ``execution.head_loss``);
            None: the model's own loss.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        units: Mapping[str, UnitParams],
        unit_modules: Mapping[str, nn.Module],
        gatherer: ParameterGatherer,
        prefetch: PrefetchScheduler,
        reducer: GradientReducer,
        landing: GradientLanding,
        steps: StepRunner,
        comm: Collectives,
        clock: PassClock,
        device: torch.device,
        after_forward: Callable[[Phase], None],
        before_last_unit: Callable[[Phase], None],
        recompute: bool,
        products: ProductSaving | None = None,
        activations: ActivationOffload | None = None,
        sequence: SequenceParallel | None = None,
        head_loss: HeadLoss | None = None,
    ) -> None:
        self.model = model
        self.activations = activations
        self._sequence = sequence
        self._head_loss = head_loss
        self._units = units
        self._gatherer = gatherer
        self._prefetch = prefetch
        self._reducer = reducer
        self._landing = landing
        self._steps = steps
        self._comm = comm
        self._clock = clock
        self._device = device
        self._after_forward = after_forward
        self._before_last_unit = before_last_unit
        self._unit_count = len(unit_modules)
        config = getattr(model, "config", None)
        self._no_cache = recompute and bool(getattr(config, "use_cache", False))
        self._root = ROOT_UNIT if ROOT_UNIT in units else None
        self._param_unit = {id(p): name for name, u in units.items() for p in u.parameters()}
        self._param_names: dict[int, str] = {}
        for pname, param in model.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(id(param), pname)
        # A new thread's OpenMP pool ignores torch.set_num_threads of other threads:
        # the model thread takes the count of the thread that built the manager.
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="zero3-model",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._storages: dict[int, tuple[str, int, int]] = {}
        self._current: UnitPass | None = None  # the pass in progress
        self._handles: list[Any] = [
            model.register_forward_pre_hook(self._root_pre),
            model.register_forward_hook(self._root_post),
        ]
        for name, module in unit_modules.items():
            self._handles.append(
                module.register_forward_pre_hook(functools.partial(self._unit_pre, name))
            )
            self._handles.append(
                module.register_forward_hook(functools.partial(self._unit_post, name))
            )
        checkpointed = [
            name
            for name, module in unit_modules.items()
            if recompute and not isinstance(module, nn.Linear | nn.Embedding)
        ]
        selective = products.chosen(checkpointed) if products is not None else frozenset()
        saving = activations.saving if activations is not None else contextlib.nullcontext
        for name in checkpointed:
            context_fn = torch.utils.checkpoint.noop_context_fn
            if products is not None and name in selective:
                context_fn = functools.partial(products.contexts, self._saved_product)
            forward = unit_modules[name].forward
            unit_modules[name].forward = functools.partial(
                _checkpointed, forward, context_fn, saving
            )
        for unit in units.values():
            for param in unit.parameters():
                if param.requires_grad:  # frozen parameters get no gradient
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(self._grad_accumulated)
                    )

    # ------------------------------------------------------- the loop bridge

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from the model or autograd thread)."""
        outside = self._current is None or self._loop is None
        if outside or threading.get_ident() == self._loop_thread:
            coro.close()
            raise StateError(
                "the model was called outside the manager, or from the event loop's thread: "
                "run it through `await manager.forward(...)` / `await manager.backward(loss)`"
            )
        result = asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        self._comm.flush_blocking()  # the model's code may call torch.distributed itself
        self._storages = self._gatherer.gathered_storages()
        return result

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._storages = self._gatherer.gathered_storages()
        await self._comm.flush()
        done = self._loop.run_in_executor(self._executor, fn)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # A thread cannot be stopped: let the model's code finish (its hooks
            # need the loop) before the cancellation goes on.
            with contextlib.suppress(BaseException):
                await done
            raise

    # ---------------------------------------------------------------- passes

    async def forward(
        self, phase: Phase, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, PassResult]:
        """Run ``model(*args, **kwargs)`` on the model thread (tensors moved to the device).

        Args:
            phase: ``Phase.FORWARD`` (training: the graph is saved) or
                ``Phase.INFERENCE`` (no graph).
            args: positional arguments of the model.
            kwargs: keyword arguments of the model.

        Returns:
            The model's output and the pass's result.

        Raises:
            LayerExecutionError: when the model's code raised (the cause is chained).
        """
        args, kwargs = _to_device((args, kwargs), self._device)
        finish = None
        if self._sequence is not None:  # this rank's slice; the loss of the whole sequence
            tiled = self._head_loss is not None and self._head_loss.tiles(kwargs)
            kwargs, finish = self._sequence.split(args, kwargs, tiled=tiled)
            args = ()
        if self._no_cache and phase is Phase.FORWARD:
            kwargs.setdefault("use_cache", False)  # see ``recompute`` in the class docstring
        method: Callable[..., Any] = self.model
        if self._head_loss is not None:  # takes return_logits; maybe labels, for the tiled loss
            method, kwargs = self._head_loss.prepare(method, kwargs, self.gathered)
        started = self._clock.start(phase)
        offload = self.activations if phase is Phase.FORWARD else None
        if offload is not None:
            offload.begin_forward()
        try:
            out, result = await self._run(phase, method, args, kwargs, "forward", finish)
        except BaseException:
            if offload is not None:
                offload.abandon_forward()  # the pending forward before it stays
            raise
        if offload is not None:
            try:
                offload.end_forward()  # raises when a write failed (its file deleted)
            except BaseException:
                await self.abandon()
                raise
        self._after_forward(phase)
        result.samples = _batch_size(args, kwargs)
        self._clock.finish(phase, started, samples=result.samples)
        return out, result

    async def generate(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], *, keep_gathered: bool
    ) -> Any:
        """Run ``model.generate(input_ids, **kwargs)`` without autograd on the model thread.

        With ``keep_gathered`` units stay gathered between the model's calls while
        the budget allows (released at the end); else every decoding step gathers
        and releases them as an inference forward does. With more than one rank
        ``synced_gpus=True`` is passed unless given.

        Raises:
            InputError: when ``input_ids`` is not a tensor.
            StateError: with sequence parallelism.
            LayerExecutionError: when the model's code raised (the cause is chained).
        """
        if not isinstance(input_ids, torch.Tensor):
            raise InputError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if self._sequence is not None:
            raise StateError(
                "generate is not available with sequence_parallel_size > 1 (decoding runs "
                "whole sequences): build a manager with sequence_parallel_size=1 to generate"
            )
        phase = Phase.GENERATE if keep_gathered else Phase.INFERENCE
        if self._comm.world_size > 1:
            # Ranks whose sequences end at different steps keep running forwards together.
            kwargs.setdefault("synced_gpus", True)
        args, kwargs = _to_device(((input_ids,), kwargs), self._device)
        out, _ = await self._run(phase, self.model.generate, args, kwargs, "generate")
        if phase is Phase.GENERATE:
            await self._prefetch.release_all()
        return out

    async def _run(
        self,
        phase: Phase,
        method: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: str,
        finish: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, PassResult]:
        predicted = self._prefetch.predicted(phase)
        unit_pass = UnitPass(phase=phase, predicted=predicted, result=PassResult(phase=phase))
        await self._prefetch.begin_pass(phase, predicted)
        self._current = unit_pass
        grad = phase is Phase.FORWARD
        reads = self._released_reads()

        def call_model() -> Any:
            out = method(*args, **kwargs)
            return out if finish is None else finish(out)

        def run() -> Any:
            self._gatherer.reserve_scratch()
            if not grad:
                with torch.no_grad(), reads:
                    return call_model()
            with (
                torch.enable_grad(),
                reads,
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
            ):
                return call_model()

        try:
            out = await self._in_thread(run)
        except Zero3Error:
            await self.abandon()
            raise
        except Exception as exc:
            await self.abandon()
            raise LayerExecutionError(f"the model raised in {call}: {exc}") from exc
        except BaseException:
            await self.abandon()
            raise
        self._current = None
        self._prefetch.end_pass(phase, unit_pass.observed)
        self._gatherer.release_scratch()
        return out, unit_pass.result

    def check_backward(self, forward: PassResult | None, loss: object) -> PassResult:
        """The training forward a backward of ``loss`` goes through (raises on bad input
        or without one)."""
        if forward is None:
            raise StateError(
                "backward called without a training forward to go back through: call "
                "`await manager.forward(...)` (outside torch.no_grad()) first; each forward is "
                "used by one backward"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError(
                "loss must be a scalar tensor, got "
                + (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss))
            )
        if loss.grad_fn is None:
            raise InputError(
                "loss has no autograd history: compute it from the output of "
                "`await manager.forward(...)` called outside torch.no_grad()"
            )
        return forward

    async def backward(
        self, loss: torch.Tensor, forward: PassResult, *, tokens: int | None = None
    ) -> PassResult:
        """Backpropagate ``loss`` (checked by :meth:`check_backward`) on the model thread.

        Each unit's reduce-scatter is launched as soon as its gradients are
        complete; the shards are committed when the whole backward succeeded. On
        failure nothing is committed and nothing stays in flight. With ``tokens``
        the pass is token-weighted (see [Note: token-weighted gradients] in
        ``gradient.store``).

        Raises:
            LayerExecutionError: when the model's backward raised.
            CommunicationError: when a collective fails.
        """
        started = self._clock.start(Phase.BACKWARD)
        scaler = self._steps.loss_scaler
        scaled = loss * scaler.scale if scaler is not None else loss
        forward_units = forward.units()
        predicted = self._prefetch.predicted(Phase.BACKWARD) or self._predict_backward(forward)
        result = PassResult(phase=Phase.BACKWARD, root_views=forward.root_views)
        unit_pass = UnitPass(phase=Phase.BACKWARD, predicted=predicted, result=result)
        unit_pass.expected = self._count_gradients(scaled)
        unit_pass.skipped = forward.no_backward
        unit_pass.awaiting_input = set(forward.grad_inputs)
        unit_pass.units_left = sum(
            u != self._root and u not in forward.no_backward for u in forward_units
        )
        self._reducer.begin_pass(tokens=tokens)
        try:
            await self._prefetch.begin_pass(Phase.BACKWARD, predicted)
            self._current = unit_pass
            if self._root is not None and self._root in forward_units:
                await self._enter(self._root)
            try:
                await self._in_thread(functools.partial(_backward, scaled, self._gatherer))
            except Zero3Error:
                raise
            except Exception as exc:
                raise LayerExecutionError(f"the model raised in backward: {exc}") from exc
            if self.activations is not None:
                self.activations.end_backward()
            # Units whose gradients were not counted complete now, in forward order
            # (the root last): the same collectives in the same order on every rank.
            last = [self._root] if self._root in forward_units else []
            for unit in [*(u for u in forward_units if u != self._root), *last]:
                if unit not in unit_pass.done:
                    await self._unit_done(unit)
            self._current = None
            self._prefetch.end_pass(Phase.BACKWARD, unit_pass.observed)
            self._gatherer.release_scratch()
            await self._landing.land(result, tokens=tokens)
        except BaseException:
            if self.activations is not None:
                self.activations.end_backward()  # nothing offloaded outlives its backward
            await self.abandon(result)
            raise
        self._clock.finish(Phase.BACKWARD, started)
        return result

    async def abandon(self, result: PassResult | None = None) -> None:
        """Drop the pass in progress: nothing of it stays in flight or gathered.

        A failed backward's ``result`` (its reduce-scatters in flight) is abandoned
        through the landing, and the parameters' gradients it left are dropped.
        """
        self._current = None
        if result is None:
            await self._prefetch.release_all()
            return
        self.clear_grads()
        await self._landing.abandon(result)

    def _predict_backward(self, forward: PassResult) -> tuple[str, ...]:
        """The forward's units in reverse, the root first, without the units no gradient
        goes through (a frozen embedding at the input: never gathered in backward)."""
        units = forward.units()
        others = [u for u in reversed(units) if u != self._root and u not in forward.no_backward]
        return tuple([self._root, *others] if self._root in units else others)

    def _count_gradients(self, loss: torch.Tensor) -> dict[str, int]:
        """Per unit, the parameters whose gradient this backward will accumulate."""
        counts: dict[str, int] = {}
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # AccumulateGrad nodes
            if variable is not None:
                unit = self._param_unit.get(id(variable))
                if unit is not None:
                    counts[unit] = counts.get(unit, 0) + 1
                continue
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return counts

    # ------------------------------------------------------ coroutines (loop)

    async def _enter(self, unit: str) -> None:
        p = self._current
        assert p is not None
        if p.phase is Phase.BACKWARD and unit in p.where:
            if not self._gatherer.is_gathered(unit):
                await self._prefetch.regather(unit)
            return
        entered = len(p.where) - (self._root in p.where)  # units other than the root
        if unit != self._root and unit not in p.where and entered == self._unit_count - 1:
            self._before_last_unit(p.phase)  # the forward's last unit
        i = len(p.observed)
        p.on_track = p.on_track and i < len(p.predicted) and p.predicted[i] == unit
        p.observed.append(unit)
        order = p.predicted if p.on_track else tuple(p.observed)
        p.where[unit] = (order, i)
        if unit != self._root:
            self._root_segment(p, resume=False)
            if p.phase is Phase.BACKWARD:
                self._release_root_values(p)
        await self._prefetch.acquire(order, i)
        if p.phase is Phase.BACKWARD and self._reducer.has_gradients(unit):
            # Autograd accumulates into the flat buffer the reduce-scatter sends
            # (see [Note: gradients in place]). The root's gradients arrive at
            # both ends of the backward: it takes a buffer of its own, not a
            # pool slot, for the whole pass.
            fresh = unit == self._root
            p.slots[unit] = await self._reducer.prepare(unit, self._units[unit], fresh=fresh)
        p.started[unit] = time.perf_counter()

    async def _exit(self, unit: str) -> None:
        p = self._current
        assert p is not None
        order, i = p.where[unit]
        self._add_compute(unit, p.phase, p.started.pop(unit, None))
        if p.phase is Phase.GENERATE:
            # Stays gathered while the budget allows.
            self._prefetch.finish((unit,), 0, next_order=(unit,))
            return
        next_order: tuple[str, ...] = ()
        training = p.phase is Phase.FORWARD
        last = training and p.on_track and i == len(order) - 1
        follows = training and self._prefetch.backward_follows_forward()
        if last and follows:
            next_order = self._prefetch.predicted(Phase.BACKWARD) or self._predict_backward(
                p.result
            )
        if unit == self._root:
            # A backward starts where the forward ended (the LM head): keep the root.
            p.done.add(unit)
            self._prefetch.finish((unit,), 0, next_order=(unit,) if follows else ())
        else:
            self._prefetch.finish(order, i, next_order=next_order)

    async def _unit_done(self, unit: str) -> None:
        """``unit``'s gradients are complete: launch its reduce-scatter, release it."""
        p = self._current
        assert p is not None
        if unit in p.where:
            self._add_compute(unit, Phase.BACKWARD, p.started.pop(unit, None))
        p.done.add(unit)
        params = self._units[unit]
        if self._reducer.has_gradients(unit):
            slot = p.slots.pop(unit, None) or await self._reducer.prepare(
                unit, params, in_place=False
            )
            pending = await self._reducer.start_reduce_scatter(unit, params, slot)
            self._landing.start(p.result, pending)
        if unit in p.where:
            order, i = p.where[unit]
            if unit == self._root:
                self._prefetch.finish((unit,), 0)
            else:
                self._prefetch.finish(order, i)
        counted = unit != self._root and unit not in p.skipped
        if counted:
            p.units_left -= 1
        if counted and p.units_left == 0:
            # No other unit is gathered in this backward (the root's gradient
            # is the last to complete): reusable buffers, and the root's
            # released parameters, would only add to the backward's peak.
            self._gatherer.clear_pool()
            self._reducer.end_pass()

    def _release_root_values(self, p: UnitPass) -> None:
        """Free the root unit's gathered values once the backward reached another unit
        after unpacking every view of them autograd saved.

        The root's backward at the top (final norm; an LM head in the root) is
        done by then, and its gradients keep accumulating in their own buffer:
        the values are rarely needed again (an embedding's backward needs only
        the ids), and if they are, unpacking a saved weight gathers the root again.
        """
        root = self._root
        if root is None or not self._prefetch.is_in_use(root) or root in p.done:
            return
        if p.result.root_views > 0:  # the root's own backward has not run yet
            return
        # Autograd can accumulate into a released parameter only through a
        # defined .grad: the in-place views of the root's gradient buffer
        # (fp32); other dtypes keep the values until the root is done.
        trainable = [param for param in self._units[root].parameters() if param.requires_grad]
        if all(param.grad is not None for param in trainable):
            self._prefetch.finish((root,), 0, keep_grads=True, pool=False)

    def _add_compute(self, unit: str, phase: Phase, t0: float | None) -> None:
        p = self._current
        if unit == self._root and p is not None:
            # The root runs around the other units: its compute is the time
            # outside them, added as the segments between them.
            self._root_segment(p, resume=False)
            return
        if t0 is not None:
            self._clock.compute(unit, phase, t0)
        if p is not None:
            self._root_segment(p, resume=True)

    def _root_segment(self, p: UnitPass, *, resume: bool) -> None:
        """Close the root's open compute segment, or open one (``resume``) while it is in use."""
        root = self._root
        if root is None or root not in p.where or root in p.done:
            return
        if resume:
            p.started[root] = time.perf_counter()
            return
        t0 = p.started.pop(root, None)
        if t0 is not None:
            self._clock.compute(root, p.phase, t0)

    # ------------------------------------------------------ hooks (model thread)

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if self._root is not None:
            self._call(self._enter(self._root))

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        p = self._current
        if self._root is not None and p is not None and p.phase is not Phase.BACKWARD:
            self._call(self._exit(self._root))

    def _unit_pre(self, unit: str, module: nn.Module, args: Any) -> None:
        self._call(self._enter(unit))
        p = self._current
        if p is not None and p.phase is Phase.FORWARD and torch.is_grad_enabled():
            hook = functools.partial(self._input_grad, unit)
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
                    p.result.grad_inputs.add(unit)

    def _unit_post(self, unit: str, module: nn.Module, args: Any, output: Any) -> None:
        p = self._current
        if p is None or p.phase is Phase.BACKWARD:
            return  # a recomputation during backward: the unit stays until it is done
        self._call(self._exit(unit))
        if p.phase is Phase.FORWARD:
            hook = functools.partial(self._before_backward, unit)
            carries = False
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(hook)
                    carries = True
            if not carries:  # no gradient goes through it: not gathered in backward
                p.result.no_backward.add(unit)

    def _before_backward(self, unit: str, grad: torch.Tensor) -> None:
        p = self._current
        if p is not None and p.phase is Phase.BACKWARD and unit not in p.where:
            self._call(self._enter(unit))

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        p = self._current
        if p is None or p.phase is not Phase.BACKWARD:
            return
        unit = self._param_unit[id(param)]
        left = p.expected.get(unit)
        if left is None:
            return  # not counted: completed at the end of backward
        p.expected[unit] = left - 1
        if left == 1 and unit not in p.awaiting_input:
            self._call(self._unit_done(unit))

    def _input_grad(self, unit: str, grad: torch.Tensor) -> None:
        """The gradient of ``unit``'s input is computed: its backward is over. Done now
        when its own gradients are complete too (or it has none)."""
        p = self._current
        if p is None or p.phase is not Phase.BACKWARD or unit not in p.awaiting_input:
            return
        p.awaiting_input.discard(unit)
        trainable = self._reducer.has_gradients(unit)
        complete = p.expected.get(unit) == 0 if trainable else True
        if complete and unit in p.where and unit not in p.done:
            self._call(self._unit_done(unit))

    @contextlib.contextmanager
    def gathered(self, items: tuple[nn.Module | torch.Tensor, ...]) -> Iterator[None]:
        """Hold the units of ``items`` (modules or parameters of the model) gathered for the
        block, on the model thread under a pass: for code that reads parameters without
        calling their module.

        In a forward, a unit not in use is entered as its module's hooks enter it (in the
        pass's order) and finished at the end of the block; saved views of it are gathered
        again in backward, where its gradients are reduce-scattered as the unit's. In a
        backward (a checkpointed block recomputed) the units are entered as the backward
        enters a unit and stay until their gradients are complete.

        Raises:
            InputError: for an item that is not a module or parameter of the model.
            StateError: outside ``manager.forward`` / ``manager.backward`` (or on the loop).
        """
        units: list[str] = []
        for item in items:
            params = list(item.parameters()) if isinstance(item, nn.Module) else [item]
            for param in params:
                unit = self._param_unit.get(id(param))
                if unit is None:
                    raise InputError(
                        "manager.gathered takes modules and parameters of the manager's model, "
                        f"got a {type(item).__name__} that is not one"
                    )
                if unit not in units:
                    units.append(unit)
        p = self._current
        entered: list[str] = []
        for unit in units:
            in_use = self._prefetch.is_in_use(unit) and self._gatherer.is_gathered(unit)
            if p is None or p.phase is Phase.BACKWARD or not in_use:
                self._call(self._enter(unit))  # StateError outside a pass
                entered.append(unit)
        yield  # a failure in the block fails the pass: it releases everything
        if p is not None and p.phase is not Phase.BACKWARD:
            for unit in reversed(entered):
                self._call(self._exit(unit))

    def _released_reads(self) -> ReleasedReadCheck:
        """The check of a pass's reads of released parameters (see [Note: released reads])."""
        return ReleasedReadCheck(
            names=self._param_names, units=self._param_unit, is_gathered=self._gatherer.is_gathered
        )

    def _pack(self, t: torch.Tensor) -> object:
        if t.layout == torch.strided and not t.is_meta and t.device == self._gatherer.device:
            found = self._storages.get(t.untyped_storage().data_ptr())
            p = self._current
            if found is not None:
                unit, base, part = found
                if unit == self._root and p is not None and p.phase is Phase.FORWARD:
                    p.result.root_views += 1
                return BufferSlot.of(unit, t, base, part)
            if p is not None:
                p.result.saved.update(storage_bytes(t))
        return t

    def _saved_product(self, t: torch.Tensor) -> None:
        """Count a product's output a selectively checkpointed unit saved."""
        if self._current is not None:
            self._current.result.saved.update(storage_bytes(t))

    def _unpack(self, saved: object) -> torch.Tensor:
        if not isinstance(saved, BufferSlot):
            assert isinstance(saved, torch.Tensor)
            return saved
        p = self._current
        if saved.layer == self._root and p is not None and p.phase is Phase.BACKWARD:
            p.result.root_views -= 1
        # A unit whose outputs carry no gradient (a head read by a tiled loss, or inside
        # ``gathered``) enters the backward when its saved weight is unpacked.
        entering = p is not None and p.phase is Phase.BACKWARD and saved.layer not in p.where
        if entering or not self._gatherer.is_gathered(saved.layer):
            self._call(self._enter(saved.layer))
        return saved.view(self._gatherer.gathered_buffer(saved.layer, saved.part))

    def clear_grads(self) -> None:
        """Drop every parameter's ``.grad`` left by a backward that failed part way."""
        for unit in self._units.values():
            for param in unit.parameters():
                param.grad = None

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Remove the hooks, stop the model thread, delete offloaded activations."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._executor.shutdown(wait=True)
        if self.activations is not None:
            self.activations.close()


def _backward(loss: torch.Tensor, gatherer: ParameterGatherer) -> None:
    """``loss``'s backward (on the model thread), its decode scratch allocated first."""
    gatherer.reserve_scratch()
    with warnings.catch_warnings():
        # A released root parameter (empty values) still accumulates into its
        # gradient view, which torch reports as a layout mismatch: expected.
        warnings.filterwarnings("ignore", message=_LAYOUT_WARNING)
        torch.autograd.backward(loss)


def _to_device(tree: T, device: torch.device) -> T:
    """``tree`` (arguments, nested) with every tensor moved to ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Rows of the first tensor argument with a dimension (1 when there is none)."""
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim():
            return int(t.shape[0])
    return 1


def _checkpointed(
    forward: Callable[..., Any],
    context_fn: Callable[[], tuple[Any, Any]],
    saving: Callable[[], contextlib.AbstractContextManager[Any]],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``forward`` under non-reentrant activation checkpointing (recomputed in backward),
    its forward and recomputation in the contexts ``context_fn`` makes; the inputs the
    checkpoint saves go through the hooks of ``saving()``."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with saving():
        return torch.utils.checkpoint.checkpoint(
            forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs
        )
