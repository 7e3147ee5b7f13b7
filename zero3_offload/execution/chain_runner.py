"""Running a chain of layers under ZeRO-3: ``forward_pass`` and ``backward_pass`` (chain mode).

A chain is a sequence of named layers, each called as ``layer(x)`` on the
previous one's output. The forward gathers each layer through the prefetch
scheduler (the next ones are prefetched in the pass's order), runs it with
:class:`LayerRunner` and releases it; a training forward saves what each
layer's backward needs (see [Note: saved activations] and [Note: backward by
recomputation] in ``execution.layer_runner``). The backward runs the layers in
reverse: each is gathered again, its gradients computed with autograd and
reduce-scattered, the reduce-scatter of one layer overlapping the backward of
the next; :class:`GradientLanding` lands them (see its module).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from zero3_offload.errors import InputError, StateError, Zero3Error
from zero3_offload.execution.activation_offload import ActivationOffload
from zero3_offload.execution.arguments import check_backward_args, resolve_layer_names
from zero3_offload.execution.gradient_landing import GradientLanding
from zero3_offload.execution.layer_runner import LayerRunner, check_has_values
from zero3_offload.execution.pass_result import PassResult
from zero3_offload.execution.saved_step import SavedStep
from zero3_offload.gradient.reducer import GradientReducer
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.parameter.flat_layout import LayerLayout
from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.stats.pass_clock import PassClock
from zero3_offload.stats.phase import Phase

__all__ = ["ChainRunner", "forward_phase"]


def forward_phase() -> Phase:
    """The kind of forward the caller's autograd mode asks for: training or inference."""
    training = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    return Phase.FORWARD if training else Phase.INFERENCE


class ChainRunner:
    """Runs the chain passes: the layer loop, the saved inputs, recomputation, the landing.

    Args:
        layers: layer name -> module (the chain's layers).
        layouts: each layer's flat layout.
        layer_runner: runs one layer's forward and backward.
        prefetch: gathers the layers, in the pass's order, under the budget.
        reducer: reduce-scatters each layer's gradients.
        landing: lands the reduce-scatters, or abandons a failed backward.
        steps: the loss scale, and the early updates' bookkeeping.
        clock: counts passes and layers' compute.
        after_forward: called with the phase at the end of every forward (the C heap
            trimmed after a training one, when ``trim_heap_after_forward`` is on).
        activations: where the layers' saved inputs go under recomputation (the one
            ``layer_runner`` offloads through; see [Note: activation offload] in
            ``execution.activation_offload``): a training forward begins and ends its
            pass here, a backward drops what it offloaded. None: nothing is offloaded.
    """

    def __init__(
        self,
        *,
        layers: Mapping[str, nn.Module],
        layouts: Mapping[str, LayerLayout],
        layer_runner: LayerRunner,
        prefetch: PrefetchScheduler,
        reducer: GradientReducer,
        landing: GradientLanding,
        steps: StepRunner,
        clock: PassClock,
        after_forward: Callable[[Phase], None],
        activations: ActivationOffload | None = None,
    ) -> None:
        self.activations = activations
        self._layers = layers
        self._layouts = layouts
        self._runner = layer_runner
        self._prefetch = prefetch
        self._reducer = reducer
        self._landing = landing
        self._steps = steps
        self._clock = clock
        self._after_forward = after_forward

    def check_forward(self, x: object, layer_names: Sequence[str]) -> tuple[str, ...]:
        """The layers a forward over ``layer_names`` on ``x`` runs (raises on bad input)."""
        names = resolve_layer_names(self._layers, layer_names)
        if not isinstance(x, torch.Tensor):
            raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_has_values(x)
        return names

    def check_backward(
        self, forward: PassResult | None, layer_names: Sequence[str], grad_output: object
    ) -> PassResult:
        """The training forward a backward over ``layer_names`` goes through (raises on bad
        input or without one)."""
        names = resolve_layer_names(self._layers, layer_names)
        checked = check_backward_args(forward, names, grad_output)
        assert isinstance(grad_output, torch.Tensor)  # checked above
        check_has_values(grad_output)
        return checked

    async def forward(
        self, x: torch.Tensor, names: tuple[str, ...]
    ) -> tuple[torch.Tensor, PassResult]:
        """Run ``names`` in order on ``x`` (checked by :meth:`check_forward`).

        A training forward (autograd on) saves what backward needs; under
        ``torch.no_grad()`` nothing is saved and nothing stays gathered for a backward.

        Returns:
            The last layer's output (no autograd history) and the pass's result.

        Raises:
            InputError: when ``x`` is on the meta device.
            LayerExecutionError: when a layer raises (nothing stays in flight).
            CommunicationError: when a gather fails.
        """
        phase = forward_phase()
        h = self._runner.to_compute(x)
        started = self._clock.start(phase)
        training = phase.trains
        steps: list[SavedStep | None] = []
        offload = self.activations if training else None
        if offload is not None:
            offload.begin_forward()
        try:
            # An evaluation forward has its own trace, so it does not disturb the
            # prediction that a training forward is followed by its backward.
            await self._prefetch.begin_pass(phase, names)
            next_order = self._prefetch.next_after_forward(names) if training else ()
            no_backward: set[str] = set()
            selective = self._runner.saving_products(names) if training else frozenset()
            for i, name in enumerate(names):
                module = await self._prefetch.acquire(names, i)
                t0 = time.perf_counter()
                if i == 0 and not h.is_floating_point() and not self._reducer.has_gradients(name):
                    no_backward.add(name)  # frozen, on token ids: no gradient goes through
                h, saved = self._runner.forward(
                    name, module, h, keep=training, save_products=name in selective
                )
                steps.append(saved)
                self._clock.compute(name, phase, t0)
                self._prefetch.finish(names, i, next_order=next_order)
            if offload is not None:
                offload.end_forward()  # raises when a write failed (its file deleted)
        except BaseException:
            if offload is not None:
                offload.abandon_forward()  # the pending forward before it stays
            await self._prefetch.release_all()  # nothing stays in flight
            raise
        self._prefetch.end_pass(phase, names)
        self._after_forward(phase)
        result = PassResult(
            phase=phase,
            layers=list(names),
            samples=x.shape[0] if x.dim() else 1,
            steps=steps if training else [],
            output_shape=h.shape,
            no_backward=no_backward,
        )
        self._clock.finish(phase, started, samples=result.samples)
        return h, result

    async def backward(
        self,
        grad_output: torch.Tensor,
        forward: PassResult,
        *,
        early_lr: float | None = None,
        tokens: int | None = None,
    ) -> tuple[torch.Tensor | None, PassResult]:
        """Backpropagate ``grad_output`` through ``forward``'s layers in reverse.

        Each layer's gradient is reduce-scattered (mean over ranks) as soon as the
        layer is done; with ``early_lr`` each layer's update starts as its shard
        lands (see [Note: optimizer update during backward]), else the shards are
        committed when the whole pass succeeded. ``forward`` is used up either way.
        With ``tokens`` the pass is token-weighted (see [Note: token-weighted
        gradients] in ``gradient.store``).

        Returns:
            The gradient with respect to the forward's input (None when the input is
            not floating point) and the pass's result.

        Raises:
            StateError: when a layer after a non-floating input needs a gradient.
            LayerExecutionError: when a layer raises.
            CommunicationError: when a collective fails.
        """
        names = forward.layers
        started = self._clock.start(Phase.BACKWARD)
        g: torch.Tensor | None = self._runner.to_compute(grad_output)
        scaler = self._steps.loss_scaler
        if scaler is not None:
            g = g * scaler.scale
        result = PassResult(phase=Phase.BACKWARD)
        self._reducer.begin_pass(tokens=tokens)
        try:
            # A first layer no gradient goes through is not gathered again (see
            # [Note: frozen parameters]); the input's gradient is then None.
            skip = 1 if names and names[0] in forward.no_backward else 0
            order = names[::-1][: len(names) - skip]
            if skip:
                forward.steps[0] = None
            await self._prefetch.begin_pass(Phase.BACKWARD, order)
            for i in range(len(order)):
                g = await self._backward_layer(forward, order, i, g, result, early_lr)
            if skip:
                g = None
            self._reducer.end_pass()
            self._prefetch.end_pass(Phase.BACKWARD, order)
            await self._landing.land(result, early=early_lr is not None, tokens=tokens)
        except BaseException as exc:
            forward.steps.clear()  # the graphs are (partly) consumed: a new forward is needed
            if self.activations is not None:
                self.activations.end_backward()
            await self._landing.abandon(result)
            if self._steps.stepped and isinstance(exc, Zero3Error):
                raise type(exc)(
                    f"{exc} (layers {sorted(self._steps.stepped)} were already updated by this "
                    "backward's early optimizer step)"
                ) from exc
            raise
        if self.activations is not None:
            self.activations.end_backward()  # every input was brought back
        self._clock.finish(Phase.BACKWARD, started)
        return g, result

    async def _backward_layer(
        self,
        forward: PassResult,
        order: list[str],
        i: int,
        g: torch.Tensor | None,
        result: PassResult,
        early_lr: float | None,
    ) -> torch.Tensor | None:
        """Backpropagate ``g`` through ``order[i]``; launch its reduce-scatter and landing."""
        name = order[i]
        step = len(forward.steps) - 1 - i
        if g is None:
            raise StateError(
                f"layer {order[i - 1]!r} has a non-floating input, so no gradient "
                f"reaches layer {name!r}: it must come first in layer_names"
            )
        module = await self._prefetch.acquire(order, i)
        result.layers.append(name)
        has_params = self._layouts[name].numel > 0
        if has_params:
            slot = await self._reducer.prepare(name, module)
        t0 = time.perf_counter()
        saved = forward.steps[step]
        forward.steps[step] = None  # its activations go as soon as the layer is done
        assert saved is not None
        g = self._runner.backward(name, module, saved, g)
        self._clock.compute(name, Phase.BACKWARD, t0)
        # The values go first: the reduce-scatter may receive into their buffer.
        self._prefetch.finish(order, i, keep_grads=True)
        if has_params:
            pending = await self._reducer.start_reduce_scatter(name, module, slot)
            self._landing.start(result, pending, early_lr=early_lr)
        return g
