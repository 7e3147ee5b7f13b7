"""Running one layer: forward without a graph, backward by recomputation.

[Note: backward by recomputation]
Forward runs every layer under ``torch.no_grad()`` with its parameters gathered
just for that layer, and keeps only the layer's input (and the RNG state it ran
with). Backward gathers the layer again, reruns its forward from the saved input
with autograd on and the same RNG state (so dropout draws the same mask), and
backpropagates the incoming gradient through that one layer: this gives the
layer's input gradient and its parameter gradients with real autograd, while no
autograd graph ever refers to released parameter storage. The cost is one extra
forward per layer, the same trade as activation checkpointing per layer; the
saving is that only layer inputs are kept between the passes.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from zero3_offload.errors import LayerExecutionError, Zero3Error

__all__ = ["ForwardRecord", "LayerExecutor", "RngState"]


@attrs.frozen
class RngState:
    """The generator states a layer's forward ran with."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


@attrs.frozen
class ForwardRecord:
    """What backward needs from the last forward. See [Note: backward by recomputation]."""

    layer_names: tuple[str, ...]
    inputs: tuple[torch.Tensor, ...]  # input of each step, detached, on the device
    rng: tuple[RngState, ...]  # RNG state each step ran with
    output_shape: torch.Size


class LayerExecutor:
    """Runs single layers on ``device`` in ``compute_dtype``.

    Args:
        device: the compute device.
        compute_dtype: dtype of parameters and floating activations.
    """

    def __init__(self, device: torch.device, compute_dtype: torch.dtype) -> None:
        self.device = device
        self.compute_dtype = compute_dtype

    def to_compute(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the device; floating tensors in the compute dtype."""
        dtype = self.compute_dtype if x.is_floating_point() else x.dtype
        return x.to(self.device, dtype)

    def rng_state(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return RngState(cpu=torch.get_rng_state(), cuda=cuda)

    def forward(self, name: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` without autograd history.

        Raises:
            LayerExecutionError: when the layer raises or returns no Tensor.
        """
        try:
            with torch.no_grad():
                out = module(x)
        except Exception as exc:
            raise LayerExecutionError(f"layer {name!r} raised in forward: {exc}") from exc
        if not isinstance(out, torch.Tensor):
            raise LayerExecutionError(
                f"layer {name!r} returned {type(out).__name__}: layers must return a Tensor"
            )
        return out

    def backward(
        self, name: str, module: nn.Module, inp: torch.Tensor, rng: RngState, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """Recompute ``module(inp)`` with ``rng`` and backpropagate ``grad`` through it.

        Leaves the parameter gradients in ``param.grad``.

        Returns:
            The gradient with respect to ``inp``, or None if ``inp`` is not floating.

        Raises:
            LayerExecutionError: when the layer raises or its output shape changed.
        """
        leaf = inp.detach().requires_grad_(inp.is_floating_point())
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(rng.cpu)
                if rng.cuda is not None:
                    torch.cuda.set_rng_state(rng.cuda, self.device)
                with torch.enable_grad():
                    out = module(leaf)
            if out.shape != grad.shape:
                raise LayerExecutionError(
                    f"layer {name!r} recomputed an output of shape {tuple(out.shape)} but the "
                    f"incoming gradient has shape {tuple(grad.shape)}"
                )
            torch.autograd.backward(out, grad.to(out.dtype))
        except Zero3Error:
            raise
        except Exception as exc:
            raise LayerExecutionError(f"layer {name!r} raised in backward: {exc}") from exc
        return leaf.grad if leaf.requires_grad else None
