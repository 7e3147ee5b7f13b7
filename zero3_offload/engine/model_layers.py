"""Which modules of a model are its layers (the units that are sharded and gathered)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from zero3_offload.errors import InputError

__all__ = ["split_layers"]


def split_layers(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The layers of ``model``: its named children, or the mapping itself.

    Raises:
        InputError: when a parameter lives outside every layer, or there is no layer.
    """
    if isinstance(model, nn.Module):
        layers = dict(model.named_children())
        direct = [name for name, _ in model.named_parameters(recurse=False)]
        if direct:
            raise InputError(
                f"parameters {direct} belong to the model itself, not to a layer: every "
                "parameter must live in one of the model's children (the layers)"
            )
    elif isinstance(model, Mapping):
        layers = dict(model)
        bad = [k for k, v in layers.items() if not isinstance(v, nn.Module)]
        if bad:
            raise InputError(f"layers {bad} are not nn.Module instances")
    else:
        raise InputError(
            f"model must be an nn.Module or a Mapping[str, nn.Module], got {type(model).__name__}"
        )
    if not layers:
        raise InputError("the model has no layers: give an nn.Module with children")
    return layers
