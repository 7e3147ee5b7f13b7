"""Argument and call-order checks of the runners' passes and the manager's calls.

Every check runs before any state changes, so a call that raises leaves the
manager as it was.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch

from zero3_offload.errors import ConfigError, InputError, LayerNotFoundError, StateError
from zero3_offload.execution.pass_result import PassResult

__all__ = [
    "check_backward_args",
    "check_lr",
    "check_step_call",
    "check_tokens",
    "resolve_layer_names",
]


def check_lr(learning_rate: object) -> float:
    """``learning_rate`` as a float, if it is a finite number >= 0."""
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, (int, float))
        or not 0 <= learning_rate < float("inf")
    ):
        raise ConfigError(
            f"learning_rate={learning_rate!r} is invalid: must be a finite number >= 0"
        )
    return float(learning_rate)


def check_step_call(
    learning_rate: object, backward_passes: int, window_calls: int, early_lr: float | None
) -> float:
    """The learning rate of an ``optimizer_step`` call, if the call may run now.

    Args:
        learning_rate: the call's learning rate.
        backward_passes: backward passes accumulated since the last update.
        window_calls: ``optimizer_step`` calls since the last update.
        early_lr: the learning rate the last backward's early updates ran with (None:
            none ran).
    """
    lr = check_lr(learning_rate)
    if backward_passes <= window_calls:
        raise StateError(
            "optimizer_step called without a backward_pass (module mode: backward) since "
            "the last call: call forward_pass and backward_pass (forward and backward) for "
            "each micro-batch first"
        )
    if early_lr is not None and lr != early_lr:
        raise ConfigError(
            f"learning_rate={lr!r} differs from the learning_rate={early_lr!r} given "
            "to backward_pass, whose updates already started: pass the same value"
        )
    return lr


def check_tokens(tokens: object, *, micro_steps: int, weighted: bool) -> int | None:
    """The ``tokens=`` of a backward as an int (None: not token-weighted), if it may run now.

    Args:
        tokens: the call's ``tokens`` (an int >= 0, a one-element integer tensor, or None).
        micro_steps: backward passes committed in the open accumulation window.
        weighted: whether they were token-weighted (meaningful when ``micro_steps > 0``).

    A window is token-weighted or not as a whole: a backward that differs from the
    window's earlier ones is refused (every rank makes the same calls, so every
    rank refuses it; a rank whose call differs from the others' is caught by the
    divergence check before the backward's first collective).
    """
    count: int | None = None
    if tokens is not None:
        if isinstance(tokens, torch.Tensor):
            if tokens.numel() != 1 or tokens.is_floating_point() or tokens.is_complex():
                raise InputError(
                    f"tokens must be an int or a one-element integer tensor, got a tensor of "
                    f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}: pass e.g. "
                    "int((labels != -100).sum())"
                )
            tokens = int(tokens.item())
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
            raise InputError(
                f"tokens={tokens!r} is invalid: it must be the number (an int >= 0) of valid "
                "tokens whose mean is this rank's loss"
            )
        count = int(tokens)
    if micro_steps and weighted != (count is not None):
        had, now = ("with", "without") if weighted else ("without", "with")
        raise InputError(
            f"this backward is {now} tokens= but the {micro_steps} earlier backward(s) of this "
            f"accumulation window were {had} it: within a window pass tokens= to every "
            "backward or to none (nothing changed; the window is as it was)"
        )
    return count


def resolve_layer_names(
    layers: Mapping[str, object], layer_names: Sequence[str]
) -> tuple[str, ...]:
    """``layer_names`` as a tuple, checked against the known ``layers``."""
    if isinstance(layer_names, str) or not isinstance(layer_names, Sequence):
        raise InputError(
            f"layer_names must be a sequence of layer names, got {type(layer_names).__name__}"
        )
    names = tuple(layer_names)
    if not names:
        raise InputError("layer_names is empty: give at least one layer")
    unknown = [n for n in names if n not in layers]
    if unknown:
        raise LayerNotFoundError(f"unknown layer(s) {unknown}; known layers are {list(layers)}")
    return names


def check_backward_args(
    forward: PassResult | None, names: tuple[str, ...], grad_output: object
) -> PassResult:
    """The training forward a backward over ``names`` with ``grad_output`` may go through."""
    if forward is None:
        raise StateError(
            "backward_pass called without a forward_pass to go back through: call "
            "forward_pass(x, layer_names) first (each forward is used by one backward; a "
            "forward under torch.no_grad() keeps nothing for one)"
        )
    if list(names) != forward.layers:
        raise StateError(
            f"backward_pass layer_names {list(names)} differ from the last forward_pass's "
            f"{forward.layers}: pass the same names"
        )
    if not isinstance(grad_output, torch.Tensor):
        raise InputError(f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}")
    if grad_output.is_complex():
        # Plain autograd refuses it too; a cast would drop the imaginary part silently.
        raise InputError(
            f"grad_output has the complex dtype {grad_output.dtype}: the forward output is "
            "real, so its gradient must be real"
        )
    if grad_output.shape != forward.output_shape:
        shape = tuple(forward.output_shape) if forward.output_shape is not None else None
        raise InputError(
            f"grad_output has shape {tuple(grad_output.shape)} but the forward output had "
            f"shape {shape}: they must be equal"
        )
    return forward
