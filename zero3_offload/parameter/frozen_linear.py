"""The forward of a frozen ``nn.Linear`` whose weight is decoded at use."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zero3_offload.parameter.frozen_rows import FrozenRows

__all__ = ["FrozenLinearForward"]


class FrozenLinearForward:
    """``module.forward`` of a frozen ``nn.Linear`` whose weight stays in its stored format
    while gathered (see [Note: frozen weights decoded at use] in ``parameter.frozen_rows``).

    ``F.linear(input, weight, bias)`` with the weight decoded from the unit's gathered
    wire into scratch, by blocks of output rows when it is large; autograd saves the
    wire (on a node before the product), and backward decodes the weight again for the
    input's gradient. The bias is
    the module's own parameter (bound as usual; trainable or not).

    Args:
        module: the linear layer.
        rows: where its weight lies in its unit's wire.
    """

    def __init__(self, module: nn.Linear, rows: FrozenRows) -> None:
        self._module = module
        self.rows = rows

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        wire = self.rows.wire()
        kept = None
        if input.requires_grad and torch.is_grad_enabled():
            # The wire is saved by a node before the product (see _WireKept).
            input = _WireKept.apply(input, wire)
            kept = input.grad_fn
        return _DecodedLinear.apply(input, self._module.bias, wire, self.rows, kept)


class _WireKept(torch.autograd.Function):
    """The identity on a decoded linear's input that saves the weight's wire for the
    linear's backward.

    Saved here, before the product, and not by :class:`_DecodedLinear` after it: a
    checkpointed unit's recomputation stops once its last saved tensor is rebuilt, so a
    product whose wire is the unit's last saved tensor (the MLP's down-projection, its
    adapter's branch run first: see [Note: adapter branch first] in
    ``execution.lora_forward``) is not computed again for nothing.
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, wire: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(wire)
        return input.view_as(input)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _DecodedLinear(torch.autograd.Function):
    """``F.linear`` with a weight decoded from stored bytes, forward and backward."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        bias: torch.Tensor | None,
        wire: torch.Tensor,
        rows: FrozenRows,
        kept: Any,
    ) -> torch.Tensor:
        ctx.rows = rows
        ctx.kept = kept  # the _WireKept node holding the wire (None: no input gradient)
        if rows.whole:
            return F.linear(input, rows.decode(wire, 0, rows.rows), bias)
        out = input.new_empty(*input.shape[:-1], rows.rows)
        for first, end in rows.blocks():
            part = None if bias is None else bias[first:end]
            out[..., first:end] = F.linear(input, rows.decode(wire, first, end), part)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows: FrozenRows = ctx.rows
        grad_input = grad_bias = None
        if ctx.needs_input_grad[0]:
            (wire,) = ctx.kept.saved_tensors
            if rows.whole:
                grad_input = grad.matmul(rows.decode(wire, 0, rows.rows))
            else:
                for first, end in rows.blocks():
                    part = grad[..., first:end].matmul(rows.decode(wire, first, end))
                    grad_input = part if grad_input is None else grad_input.add_(part)
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, rows.rows).sum(0)
        return grad_input, grad_bias, None, None, None
