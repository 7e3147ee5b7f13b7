"""Argument and call-order checks of the manager's public methods.

Every check runs before any state changes, so a call that raises leaves the
manager as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from zero3_offload.errors import ConfigError, InputError, LayerNotFoundError, StateError
from zero3_offload.execution.forward_record import ForwardRecord

__all__ = ["check_backward_args", "check_lr", "resolve_layer_names"]


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
    record: ForwardRecord | None, names: tuple[str, ...], grad_output: object
) -> ForwardRecord:
    """The forward record a backward over ``names`` with ``grad_output`` may use."""
    if record is None:
        raise StateError(
            "backward_pass called without a forward_pass to go back through: call "
            "forward_pass(x, layer_names) first (each forward is used by one backward; a "
            "forward under torch.no_grad() keeps nothing for one)"
        )
    if names != record.layer_names:
        raise StateError(
            f"backward_pass layer_names {list(names)} differ from the last forward_pass's "
            f"{list(record.layer_names)}: pass the same names"
        )
    if not isinstance(grad_output, torch.Tensor):
        raise InputError(f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}")
    if grad_output.is_complex():
        # Plain autograd refuses it too; a cast would drop the imaginary part silently.
        raise InputError(
            f"grad_output has the complex dtype {grad_output.dtype}: the forward output is "
            "real, so its gradient must be real"
        )
    if grad_output.shape != record.output_shape:
        raise InputError(
            f"grad_output has shape {tuple(grad_output.shape)} but the forward output had "
            f"shape {tuple(record.output_shape)}: they must be equal"
        )
    return record
