"""Tiled MLP: a decoder layer's MLP run over chunks of tokens, recomputed in backward.

[Note: tiled MLP]
At long sequence lengths a decoder layer's MLP intermediate (``tokens x
intermediate_size``, several times the hidden states, and more than one of them:
the gate's and up-projection's outputs, the activation's) is the largest thing the
layer's forward and backward hold. With ``mlp_chunk_tokens`` each unit's ``mlp``
submodule runs through :class:`TiledMlp` (DeepSpeed ALST's TiledMLP): one autograd
node whose forward computes the output chunk by chunk (the tokens of every row,
flattened, ``mlp_chunk_tokens`` at a time, the last chunk ragged) without autograd,
saving only its input; its backward computes each chunk again under autograd and
takes ``torch.autograd.grad`` of it with respect to the chunk's input and the MLP's
trainable parameters (LoRA adapters included: every parameter of the module that
requires a gradient), summing the parameters' gradients over the chunks. The
parameters are inputs of the node, so autograd accumulates each one's gradient once
(module mode's post-accumulate-grad hooks see one gradient per parameter). So only
one chunk's intermediates exist at a time, in the forward and in the backward.

The random state of the forward is restored before the backward's recomputation
(dropout draws the same masks). Under activation checkpointing the node is part of
the unit's recomputation: its forward runs again there (tiled), and its backward
after it. The MLP's weights are read from the module when each chunk runs: the unit
is gathered then (its forward, its recomputation or its backward), and nothing the
node saves refers to them. Results equal those of the untiled MLP up to the rounding
of summing the parameters' gradients per chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from zero3_offload.errors import ConfigError, InputError
from zero3_offload.logging import get_logger

__all__ = ["TiledMlp"]

log = get_logger(__name__)

_MLP = "mlp"  # the attribute of a transformers decoder layer that holds its MLP


class TiledMlp:
    """Runs the ``mlp`` submodule of each given unit over chunks of ``chunk_tokens``
    tokens (see [Note: tiled MLP]).

    Args:
        chunk_tokens: tokens per chunk (> 0).
        unit_modules: unit name -> its module; each one with an ``mlp`` submodule is
            tiled (its ``forward`` is replaced on the instance).

    Raises:
        ConfigError: when no unit has an ``mlp`` submodule (the units found are named).
    """

    def __init__(self, chunk_tokens: int, unit_modules: Mapping[str, nn.Module]) -> None:
        if chunk_tokens <= 0:
            raise ConfigError(f"mlp_chunk_tokens={chunk_tokens} is invalid: must be > 0")
        self.chunk_tokens = chunk_tokens
        self.tiled: dict[str, nn.Module] = {}
        untiled = []
        for name, module in unit_modules.items():
            mlp = getattr(module, _MLP, None)
            if isinstance(mlp, nn.Module):
                self.tiled[name] = mlp
                mlp.forward = functools.partial(self._run, mlp, mlp.forward)
            else:
                untiled.append(name)
        if not self.tiled:
            raise ConfigError(
                f"mlp_chunk_tokens={chunk_tokens} found no unit with an `mlp` submodule "
                f"(units: {', '.join(unit_modules) or 'none'}): tiling runs a transformers "
                "decoder layer's `mlp`; leave mlp_chunk_tokens at 0 for this model"
            )
        log.info(
            "tiled_mlp",
            chunk_tokens=chunk_tokens,
            tiled=list(self.tiled),
            untiled=untiled,  # units without an `mlp` submodule run as they are
        )

    def _run(self, mlp: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``mlp``'s forward, tiled while autograd records (as it is otherwise)."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise InputError(
                "mlp_chunk_tokens tiles an `mlp` called with one tensor (the hidden states); "
                f"{type(mlp).__name__} was called with {len(args)} positional and "
                f"{sorted(kwargs)} keyword arguments: set mlp_chunk_tokens=0 for this model"
            )
        params = [p for p in mlp.parameters() if p.requires_grad]
        return _TiledFunction.apply(forward, self.chunk_tokens, args[0], *params)


class _TiledFunction(torch.autograd.Function):
    """``forward(x)`` chunk by chunk; backward recomputes each chunk (see [Note: tiled MLP])."""

    @staticmethod
    def forward(
        ctx: Any,
        forward: Callable[[torch.Tensor], torch.Tensor],
        chunk: int,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.forward, ctx.chunk, ctx.params = forward, chunk, params
        ctx.cpu_rng = torch.get_rng_state()
        ctx.devices, ctx.device_rng = get_device_states(x)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor | None = None
        for start in range(0, flat.shape[0], chunk):
            y = _chunk_output(forward, flat[start : start + chunk], x)
            if out is None:
                out = y.new_empty((flat.shape[0], y.shape[-1]))
            out[start : start + y.shape[0]] = y
        assert out is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        forward, chunk, params = ctx.forward, ctx.chunk, ctx.params
        wants_x = ctx.needs_input_grad[2]
        wanted = [p for p, needs in zip(params, ctx.needs_input_grad[3:], strict=True) if needs]
        flat = x.detach().reshape(-1, x.shape[-1])
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        with (
            torch.random.fork_rng(devices=ctx.devices),
            torch.enable_grad(),
        ):
            torch.set_rng_state(ctx.cpu_rng)
            set_device_states(ctx.devices, ctx.device_rng)
            for start in range(0, flat.shape[0], chunk):
                piece = flat[start : start + chunk].detach().requires_grad_(wants_x)
                y = _chunk_output(forward, piece, x)
                inputs = [piece, *wanted] if wants_x else wanted
                got = torch.autograd.grad(
                    y, inputs, grads[start : start + chunk].reshape(y.shape), allow_unused=True
                )
                if wants_x:
                    assert grad_x is not None
                    grad_x[start : start + piece.shape[0]] = _or_zeros(got[0], piece)
                    got = got[1:]
                for i, g in enumerate(got):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        by_param = dict(zip(map(id, wanted), sums, strict=True))
        param_grads = [_or_zeros(by_param[id(p)], p) if id(p) in by_param else None for p in params]
        grad_input = grad_x.view(x.shape) if grad_x is not None else None
        return (None, None, grad_input, *param_grads)


def _chunk_output(
    forward: Callable[[torch.Tensor], torch.Tensor], piece: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``forward`` of one chunk (tokens x hidden), run as one row; its output as tokens x out."""
    y = forward(piece.unsqueeze(0))
    if not isinstance(y, torch.Tensor) or y.shape[:-1] != (1, piece.shape[0]):
        raise InputError(
            "mlp_chunk_tokens tiles an `mlp` whose output is one tensor of the tokens of its "
            f"input (input {tuple(x.shape)}); this one returned "
            + (f"shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__)
            + ": set mlp_chunk_tokens=0 for this model"
        )
    return y.squeeze(0)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad
