"""Running one layer: forward, and backward through its saved graph or by recomputation.

[Note: saved activations]
By default (``activation_checkpointing=False``) forward runs each layer with
autograd on, from a detached leaf copy of its input, and saves the layer's
graph until backward, as plain PyTorch, FSDP2 and DeepSpeed do. The graph
must not keep the layer's gathered parameters alive, though: they are
released right after the layer ran. So forward runs under
``saved_tensors_hooks``: a tensor autograd saves whose storage is the layer's
gathered flat buffer (a parameter, or a view of one such as ``weight.t()``)
is packed as its place in that buffer (size, stride, offset), not as the
tensor; every other saved tensor (the activations) is saved as is. Backward
gathers the layer again and the unpack hook rebuilds the saved view from the
new buffer, which has the same layout. Parameter gradients still flow to the
layer's ``nn.Parameter`` objects (rebound to the new buffer), so
``param.grad`` ends up as with plain autograd.

[Note: backward by recomputation]
With ``activation_checkpointing=True`` forward runs every layer under
``torch.no_grad()`` and keeps only the layer's input (and the RNG state it ran
with). Backward gathers the layer again, reruns its forward from the saved
input with autograd on and the same RNG state (so dropout draws the same mask),
and backpropagates the incoming gradient through that one layer. The cost is
one extra forward per layer (about a third more compute); the saving is that
only layer inputs are saved between the passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zero3_offload.errors import InputError, LayerExecutionError, StateError, Zero3Error
from zero3_offload.execution.activation_offload import ActivationOffload
from zero3_offload.execution.buffer_slot import BufferSlot
from zero3_offload.execution.product_saving import ProductSaving
from zero3_offload.execution.saved_step import RngState, SavedStep
from zero3_offload.stats.tensor_bytes import storage_bytes

__all__ = ["LayerRunner", "check_has_values"]


class LayerRunner:
    """Runs single layers on ``device`` in ``compute_dtype``.

    Args:
        device: the compute device.
        compute_dtype: dtype of parameters and floating activations.
        recompute: True for [Note: backward by recomputation], False for
            [Note: saved activations].
        gathered_flat: layer name -> its gathered flat buffer now (raises
            KeyError when the layer is not gathered).
        products: with ``recompute``, picks the layers (the last ones of a chain) that
            also save their products (but low-rank ones); see [Note: saved products] in
            ``execution.product_saving``. None: every layer recomputes its whole forward.
        activations: with ``recompute``, where the layers' saved inputs go until their
            recomputation (see [Note: activation offload] in
            ``execution.activation_offload``). None: they stay on the device.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        recompute: bool,
        gathered_flat: Callable[[str], torch.Tensor],
        products: ProductSaving | None = None,
        activations: ActivationOffload | None = None,
    ) -> None:
        self.device = device
        self.compute_dtype = compute_dtype
        self.recompute = recompute
        self._gathered_flat = gathered_flat
        self._products = products
        self._activations = activations

    def saving_products(self, names: Sequence[str]) -> frozenset[str]:
        """The layers of a training forward over ``names`` that save their products."""
        if not self.recompute or self._products is None:
            return frozenset()
        return self._products.chosen(names)

    def to_compute(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the device; floating tensors in the compute dtype.

        Raises:
            InputError: when ``x`` is on the meta device (it holds no values to copy).
        """
        check_has_values(x)
        dtype = self.compute_dtype if x.is_floating_point() else x.dtype
        return x.to(self.device, dtype)

    def rng_state(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return RngState(cpu=torch.get_rng_state(), cuda=cuda)

    # ---------------------------------------------------------------- forward

    def forward(
        self,
        name: str,
        module: nn.Module,
        x: torch.Tensor,
        *,
        keep: bool = True,
        save_products: bool = False,
    ) -> tuple[torch.Tensor, SavedStep | None]:
        """Run ``module(x)``; with recomputation and ``save_products`` the outputs of the
        layer's products are saved for backward too (see [Note: saved products]).

        Returns:
            The output (without autograd history) and what backward needs (None
            without ``keep``: an evaluation forward keeps nothing).

        Raises:
            LayerExecutionError: when the layer raises or returns no Tensor.
        """
        if self.recompute and keep and save_products:
            return self._forward_saving_products(name, module, x)
        if self.recompute or not keep:
            rng = self.rng_state() if keep else None
            inp = x.detach()
            try:
                with torch.no_grad():
                    out = module(inp)
            except Exception as exc:
                raise LayerExecutionError(f"layer {name!r} raised in forward: {exc}") from exc
            _check_output(name, out)
            if not keep:
                return out, None
            return out, self._kept_input(inp, SavedStep(inp=inp, out=None, rng=rng, saved={}))
        leaf = x.detach().requires_grad_(x.is_floating_point())
        pack, unpack, saved = self._param_hooks(name)
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = module(leaf)
        except Exception as exc:
            raise LayerExecutionError(f"layer {name!r} raised in forward: {exc}") from exc
        _check_output(name, out)
        saved.update(storage_bytes(leaf))
        return out.detach(), SavedStep(inp=leaf, out=out, rng=None, saved=saved)

    def _forward_saving_products(
        self, name: str, module: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, SavedStep]:
        """Run ``module(x)`` as its recomputation will (autograd on, from a leaf), saving
        its products; the graph is dropped, only the input and products stay."""
        assert self._products is not None
        rng = self.rng_state()
        inp = x.detach()
        saved: dict[int, int] = {}
        forward, recompute = self._products.contexts(lambda t: saved.update(storage_bytes(t)))
        try:
            # The same grad mode and leaf as the recomputation: ops dispatch the same way.
            with torch.enable_grad(), forward:
                out = module(inp.detach().requires_grad_(inp.is_floating_point()))
        except Exception as exc:
            raise LayerExecutionError(f"layer {name!r} raised in forward: {exc}") from exc
        _check_output(name, out)
        step = SavedStep(inp=inp, out=None, rng=rng, saved=saved, products=recompute)
        return out.detach(), self._kept_input(inp, step)

    def _kept_input(self, inp: torch.Tensor, step: SavedStep) -> SavedStep:
        """``step`` keeping ``inp`` for the recomputation: on the device (its bytes counted
        as saved), or offloaded (``stored`` stands for it)."""
        if self._activations is None:
            step.saved.update(storage_bytes(inp))
            return step
        step.inp, step.stored = None, self._activations.offload(inp)
        return step

    def _param_hooks(
        self, name: str
    ) -> tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor], dict[int, int]]:
        """Saved-tensor hooks for ``name``'s forward. See [Note: saved activations]."""
        # Where the gathered buffer lives (device, storage pointer, offset), not the
        # buffer itself: autograd keeps these hooks with the graph, and a reference
        # to the buffer here would keep every layer's gathered parameters alive.
        where: tuple[torch.device, int, int] | None = None
        try:
            flat = self._gathered_flat(name)
            if flat.numel():
                where = (flat.device, flat.untyped_storage().data_ptr(), flat.storage_offset())
            del flat
        except KeyError:
            pass
        saved: dict[int, int] = {}  # storage pointer -> bytes, of saved activations

        def pack(t: torch.Tensor) -> object:
            in_flat = (
                where is not None
                and t.device == where[0]
                and not t.is_sparse
                and t.untyped_storage().data_ptr() == where[1]
            )
            if in_flat:
                assert where is not None
                return BufferSlot.of(name, t, where[2])
            saved.update(storage_bytes(t))
            return t

        def unpack(saved: object) -> torch.Tensor:
            if not isinstance(saved, BufferSlot):
                assert isinstance(saved, torch.Tensor)
                return saved
            try:
                now = self._gathered_flat(name)
            except KeyError:
                raise StateError(
                    f"layer {name!r}'s backward needs its parameters but they are not gathered"
                ) from None
            return saved.view(now)

        return pack, unpack, saved

    # ---------------------------------------------------------------- backward

    def backward(
        self, name: str, module: nn.Module, step: SavedStep, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """Backpropagate ``grad`` through ``name``'s forward (saved or recomputed).

        Leaves the parameter gradients in ``param.grad``. The layer must be
        gathered (its parameters bound).

        Returns:
            The gradient with respect to the layer's input, or None if it is not floating.

        Raises:
            LayerExecutionError: when the layer raises or its output shape changed.
        """
        if step.out is None:
            leaf, out = self._recompute(name, module, step)
        else:
            assert step.inp is not None
            leaf, out = step.inp, step.out
        try:
            if out.shape != grad.shape:
                raise LayerExecutionError(
                    f"layer {name!r} produced an output of shape {tuple(out.shape)} but the "
                    f"incoming gradient has shape {tuple(grad.shape)}"
                )
            if out.requires_grad:
                torch.autograd.backward(out, grad.to(out.dtype))
        except Zero3Error:
            raise
        except Exception as exc:
            raise LayerExecutionError(f"layer {name!r} raised in backward: {exc}") from exc
        return leaf.grad if leaf.requires_grad else None

    def _recompute(
        self, name: str, module: nn.Module, step: SavedStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rerun ``module`` on the saved input with the saved RNG state, autograd on."""
        assert step.rng is not None
        inp = step.inp
        if inp is None:
            assert self._activations is not None
            inp = self._activations.restore(step.stored)
        leaf = inp.detach().requires_grad_(inp.is_floating_point())
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(step.rng.cpu)
                if step.rng.cuda is not None:
                    torch.cuda.set_rng_state(step.rng.cuda, self.device)
                with torch.enable_grad(), step.products or contextlib.nullcontext():
                    out = module(leaf)
        except Exception as exc:
            raise LayerExecutionError(f"layer {name!r} raised in backward: {exc}") from exc
        _check_output(name, out)
        return leaf, out


def check_has_values(x: torch.Tensor) -> None:
    """Raise :class:`InputError` when ``x`` is on the meta device (it holds no values)."""
    if x.is_meta:
        raise InputError(
            f"got a tensor of shape {tuple(x.shape)} on the meta device, which holds no "
            "values: pass a tensor with data (e.g. on the CPU)"
        )


def _check_output(name: str, out: object) -> None:
    if not isinstance(out, torch.Tensor):
        raise LayerExecutionError(
            f"layer {name!r} returned {type(out).__name__}: layers must return a Tensor"
        )
