"""Full fp32 parameter values gathered from the shards (``full_state_dict``, pretrained saves)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zero3_offload.comm.collectives import Collectives
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.parameter.flat_layout import LayerLayout, param_key
from zero3_offload.parameter.store import ParameterStore

__all__ = ["FullState"]


class FullState:
    """Gathers the fp32 masters of every rank into full parameter values (collectives).

    Every rank takes part in every gather and receives the full values.

    Args:
        layouts: each layer's flat layout (in the model's layer order).
        params: the fp32 master shards.
        optimizer: the optimizer state's tier (a master on disk is read for the gather).
        comm: the group's collectives.
        device: the device the gathers run on.
    """

    def __init__(
        self,
        *,
        layouts: Mapping[str, LayerLayout],
        params: ParameterStore,
        optimizer: ShardOptimizers,
        comm: Collectives,
        device: torch.device,
    ) -> None:
        self._layouts = layouts
        self._params = params
        self._optimizer = optimizer
        self._comm = comm
        self._device = device

    def layers(self) -> list[str]:
        """The layers, in order."""
        return list(self._layouts)

    async def layer(self, name: str, *, frozen: bool = True) -> list[tuple[str, torch.Tensor]]:
        """``(full name, fp32 CPU tensor)`` of ``name``'s parameters (a collective): the
        trainable ones' masters, then (``frozen``) the frozen ones' values as gathers
        decode them."""
        layout = self._layouts[name]
        out: list[tuple[str, torch.Tensor]] = []
        if layout.padded_numel:
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=self._device)
            async with self._optimizer.resident(name, write=False):  # read from the disk tier
                master = self._params.master(name).to(self._device)
                await self._comm.all_gather(full, master, what=f"the values of {name!r}")
            out += [
                (param_key(name, pname), view.detach().to("cpu", copy=True))
                for pname, view in layout.unflatten(full)
            ]
        if frozen and layout.frozen is not None:
            full = await self.frozen(name)
            out += [
                (param_key(name, pname), view.to("cpu", torch.float32, copy=True))
                for pname, view in layout.frozen.unflatten(full)
            ]
        return out

    async def frozen(self, name: str) -> torch.Tensor:
        """``name``'s whole frozen part in the compute dtype, decoded as a gather decodes
        it (a collective; see [Note: frozen parameters])."""
        frozen = self._layouts[name].frozen
        copy = self._params.frozen_copy(name)
        assert frozen is not None and copy is not None
        codec = self._params.frozen_codec
        shard = torch.empty(frozen.shard_numel, dtype=codec.compute_dtype, device=self._device)
        codec.decode_(copy.to(self._device), shard)
        full = torch.empty(frozen.padded_numel, dtype=codec.compute_dtype, device=self._device)
        await self._comm.all_gather(full, shard, what=f"the frozen values of {name!r}")
        return full

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """``{name as in model.named_parameters(): fp32 CPU tensor}`` (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for name in self._layouts:
            out.update(await self.layer(name))
        return out
