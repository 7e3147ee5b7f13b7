"""Turning a model into layers and its initial values into this rank's shards."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from zero3_offload.comm import Collectives
from zero3_offload.errors import Zero3Error
from zero3_offload.parameter_management import CpuParameterStore, GpuParameterCache, LayerLayout

__all__ = ["shard_initial_values", "split_layers"]


def split_layers(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The layers of ``model``: its named children, or the mapping itself.

    Raises:
        Zero3Error: when a parameter lives outside every layer, or there is no layer.
    """
    if isinstance(model, nn.Module):
        layers = dict(model.named_children())
        direct = [name for name, _ in model.named_parameters(recurse=False)]
        if direct:
            raise Zero3Error(
                f"parameters {direct} belong to the model itself, not to a layer: every "
                "parameter must live in one of the model's children (the layers)"
            )
    elif isinstance(model, Mapping):
        layers = dict(model)
        bad = [k for k, v in layers.items() if not isinstance(v, nn.Module)]
        if bad:
            raise Zero3Error(f"layers {bad} are not nn.Module instances")
    else:
        raise Zero3Error(
            f"model must be an nn.Module or a Mapping[str, nn.Module], got {type(model).__name__}"
        )
    if not layers:
        raise Zero3Error("the model has no layers: give an nn.Module with children")
    return layers


def shard_initial_values(
    *,
    layers: Mapping[str, nn.Module],
    layouts: Mapping[str, LayerLayout],
    store: CpuParameterStore,
    cache: GpuParameterCache,
    comm: Collectives,
    device: torch.device,
) -> None:
    """Broadcast rank 0's parameters and buffers; keep only this rank's shards.

    Afterwards the modules hold no parameter storage and live on ``device``.

    Raises:
        CommunicationError: when a broadcast fails.
    """
    for name, module in layers.items():
        layout = layouts[name]
        flat = layout.flatten(module, dtype=torch.float32).to(device)
        comm.broadcast_blocking(flat, src=0)
        store.put_master(name, flat[layout.shard_start : layout.shard_end].clone())
        for buf in module.buffers():
            staged = buf.detach().to(device)
            comm.broadcast_blocking(staged, src=0)
            buf.data = staged
    cache.release_all_views()
    for module in layers.values():
        module.to(device)
