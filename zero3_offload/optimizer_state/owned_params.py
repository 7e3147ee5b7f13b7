"""Whole-parameter updates of shape-aware optimizers (Adafactor, Muon) at owning ranks.

[Note: owned parameters]
An optimizer that needs a parameter's shape (see [Note: optimizer kinds]) cannot run
on the flat shards. Each of its parameters is owned by one rank (``plan_optimizer``
balances the owners by size, from facts every rank shares), which alone keeps the
parameter's optimizer state: the state is partitioned across the ranks by parameter.
At each update, after the gradients are final (scaled, clipped, checked for inf), for
every layer holding such parameters, in layer order:

1. two all-gathers give every rank the layer's full fp32 master and reduced gradient
   (the concatenation of the ranks' shards);
2. each owner points its torch optimizer's full-shape parameter at the parameter's
   place in the gathered master, its gradient at the gathered gradient, and steps
   (in a worker thread): torch's own update of the whole parameter;
3. a third all-gather, of each rank's block (its owned parameters of the layer,
   updated, end to end, padded to the largest owner's block), gives every rank the
   new values, and each copies its slice of every such parameter into its master.

Collectives are launched from one coroutine in a fixed order (the next layer's
gathers before this layer's block), so every rank launches the same ones in the same
order while one layer steps and the next one's gathers are in flight; at most two
layers' gathered buffers are held. The element-wise parameters of the same layer are
updated on the shard as usual. The cost per such layer and update: about three times
its fp32 size received per rank, and the owners' update time. A layer holding such
parameters never updates during backward (its collectives would interleave with the
backward's): the step runner leaves it to ``optimizer_step``. The disk tier
(``offload_optimizer_device="nvme"``) refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zero3_offload.comm.collectives import Collectives, PendingCollective
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.errors import StateError
from zero3_offload.optimizer_state.optimizer_plan import OptimizerPlan, OwnedSlot, ResolvedGroup
from zero3_offload.parameter.flat_layout import LayerLayout
from zero3_offload.stats.phase import Phase
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["OwnedParams"]

_Part = tuple[ResolvedGroup, Any, list[tuple[OwnedSlot, torch.Tensor]]]


class OwnedParams:
    """This rank's optimizers of the whole parameters it owns, and the layers' exchange.

    Args:
        plan: the resolved parameter groups (who owns what).
        layouts: the layers' flat layouts.
        comm: the group's collectives.
        workers: CPU worker threads (the owners' steps run there).
        device: where the masters and the owned state live.
    """

    def __init__(
        self,
        *,
        plan: OptimizerPlan,
        layouts: Mapping[str, LayerLayout],
        comm: Collectives,
        workers: WorkerThreads,
        device: torch.device,
    ) -> None:
        self._plan = plan
        self._layouts = layouts
        self._comm = comm
        self._workers = workers
        self._device = device
        self._owned = {name: lp.owned for name, lp in plan.layers.items() if lp.owned}
        self._mine: dict[str, list[_Part]] = {}
        self._build()

    def _build(self) -> None:
        self._mine = {}
        for layer, owned in self._owned.items():
            by_group: dict[int, list[OwnedSlot]] = {}
            for o in owned:
                if o.owner == self._comm.rank:
                    by_group.setdefault(o.group, []).append(o)
            parts: list[_Part] = []
            for index, slots in by_group.items():
                group = self._plan.group(index)
                # Allocated for the constructor's checks (e.g. Muon's 2-D rule), then
                # pointed at nothing until a step points it at the gathered master.
                items = [(o, torch.empty(o.slot.shape, device=self._device)) for o in slots]
                opt = group.kind.make([{"params": [p for _, p in items], **group.overrides}])
                for _, p in items:
                    p.set_(torch.empty(0, device=self._device))
                parts.append((group, opt, items))
            if parts:
                self._mine[layer] = parts

    def layers(self) -> list[str]:
        """The layers with parameters updated whole."""
        return list(self._owned)

    def has(self, layer: str) -> bool:
        return layer in self._owned

    async def update(
        self,
        layers: Sequence[str],
        master: Callable[[str], torch.Tensor],
        grad: Callable[[str], torch.Tensor],
        lr: float,
    ) -> None:
        """Update the owned parameters of ``layers`` (every rank passes the same, in the
        same order) and copy the new values into each rank's masters (see the note).

        Args:
            layers: the layers to update.
            master: a layer's fp32 master shard.
            grad: a layer's final gradient shard.
            lr: the learning rate (times each group's lr_scale).
        """
        wanted = set(layers)
        todo = [name for name in self._owned if name in wanted]  # the same order on every rank
        if not todo:
            return
        inbound: dict[str, tuple[torch.Tensor, torch.Tensor, list[PendingCollective[None]]]] = {}
        outbound: list[tuple[str, torch.Tensor, PendingCollective[None]]] = []

        def gather(name: str) -> None:
            lay, dev = self._layouts[name], self._comm.device
            full_m = torch.empty(lay.padded_numel, dtype=torch.float32, device=dev)
            full_g = torch.empty(lay.padded_numel, dtype=torch.float32, device=dev)
            what = f"the whole parameters of {name}"
            pending = [
                self._comm.start_all_gather(full_m, master(name).to(dev), what=f"{what} (master)"),
                self._comm.start_all_gather(full_g, grad(name).to(dev), what=f"{what} (gradient)"),
            ]
            inbound[name] = (full_m, full_g, pending)

        failure: Exception | None = None

        def step(name: str, m: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> None:
            nonlocal failure
            if failure is not None:
                return
            try:
                self._step(name, m, g, b, lr)
            except Exception as exc:  # raised below, once every rank knows (agree)
                failure = exc

        gather(todo[0])
        for i, name in enumerate(todo):
            if i + 1 < len(todo):
                gather(todo[i + 1])
            full_m, full_g, pending = inbound.pop(name)
            for p in pending:
                await p.wait()
            block_numel = self._plan.layers[name].block
            block = torch.zeros(block_numel, dtype=torch.float32, device=self._device)
            await self._workers.run(
                "cpu-optimizer",
                name,
                Phase.STEP,
                lambda name=name, m=full_m, g=full_g, b=block: step(name, m, g, b),
            )
            del full_m, full_g
            recv = torch.empty(
                self._comm.world_size * block_numel, dtype=torch.float32, device=self._comm.device
            )
            send = block.to(self._comm.device)
            outbound.append(
                (name, recv, self._comm.start_all_gather(recv, send, what=f"{name}'s updates"))
            )
            if len(outbound) > 1:
                await self._land(*outbound.pop(0), master)
        for item in outbound:
            await self._land(*item, master)
        # An owner's failure is every rank's: the others copied its old values.
        if not await self._comm.agree(failure is None, what="the whole-parameter updates"):
            if failure is not None:
                raise StateError(f"a whole-parameter update failed on this rank: {failure}")
            raise StateError("a whole-parameter update failed on another rank")

    def _step(
        self,
        name: str,
        full_m: torch.Tensor,
        full_g: torch.Tensor,
        block: torch.Tensor,
        lr: float,
    ) -> None:
        """The owner's update of ``name``'s owned parameters, written into ``block``."""
        parts = self._mine.get(name, [])
        if not parts:
            return
        full_m = full_m.to(self._device)
        full_g = full_g.to(self._device)
        for _, _, items in parts:  # the old values, kept should an update fail
            for o, _ in items:
                lo = o.slot.offset
                block[o.position : o.position + o.slot.numel] = full_m[lo : lo + o.slot.numel]
        for group, opt, items in parts:
            try:
                for o, p in items:
                    lo, hi = o.slot.offset, o.slot.offset + o.slot.numel
                    p.set_(full_m[lo:hi].view(o.slot.shape))
                    p.grad = full_g[lo:hi].view(o.slot.shape)
                opt.param_groups[0]["lr"] = lr * group.lr_scale
                opt.step()
                for o, p in items:
                    block[o.position : o.position + o.slot.numel] = p.reshape(-1)
            finally:
                for _, p in items:
                    p.grad = None
                    p.set_(torch.empty(0, device=self._device))

    async def _land(
        self,
        name: str,
        recv: torch.Tensor,
        pending: PendingCollective[None],
        master: Callable[[str], torch.Tensor],
    ) -> None:
        """Copy this rank's slice of every updated parameter of ``name`` into its master."""
        await pending.wait()
        lay, block = self._layouts[name], self._plan.layers[name].block
        shard = master(name)
        values = recv.to(shard.device)
        for o in self._owned[name]:
            lo, hi = lay.owned_span(o.slot)
            if lo >= hi:
                continue
            src = o.owner * block + o.position + (lo - o.slot.offset)
            shard[lo - lay.shard_start : hi - lay.shard_start] = values[src : src + hi - lo]

    def state(self, layer: str) -> dict[str, torch.Tensor]:
        """The state of ``layer``'s parameters this rank owns, as
        ``{"<param name in the layer>.<state key>": tensor}`` (empty before a step)."""
        out: dict[str, torch.Tensor] = {}
        for _, opt, items in self._mine.get(layer, []):
            for o, p in items:
                for key, value in opt.state.get(p, {}).items():
                    if torch.is_tensor(value):
                        out[f"{o.slot.name}.{key}"] = value
        return out

    def owned_names(self, layer: str) -> list[str]:
        """Names (in the layer) of ``layer``'s parameters this rank owns."""
        return [o.slot.name for _, _, items in self._mine.get(layer, []) for o, _ in items]

    def load_state(self, layer: str, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the state of ``layer``'s parameters this rank owns with ``state`` (in
        the form :meth:`state` returns; copies on the state's device)."""
        for _, opt, items in self._mine.get(layer, []):
            for o, p in items:
                prefix = f"{o.slot.name}."
                mine = {
                    k.removeprefix(prefix): v.to(self._device).clone()
                    for k, v in state.items()
                    if k.startswith(prefix) and "." not in k.removeprefix(prefix)
                }
                opt.state[p].clear()
                opt.state[p].update(mine)
                if not mine:
                    opt.state.pop(p, None)

    def nbytes(self) -> int:
        """Bytes of the owned parameters' state tensors, counted."""
        return sum(
            tensor_bytes(v)
            for parts in self._mine.values()
            for _, opt, _ in parts
            for state in opt.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )

    def reset(self) -> None:
        """Drop the owned parameters' state (the optimizers are made again)."""
        self._build()
