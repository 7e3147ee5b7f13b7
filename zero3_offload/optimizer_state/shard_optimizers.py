"""Per-shard optimizers: the optimizer state and the step math (the Rust module's
``optimizer_state.rs``).

Each layer's fp32 master shard is driven by torch's own optimizers, so the update is
torch's kernel (fused where the device supports it, else foreach) with exactly
torch.optim's semantics. Without parameter groups, or when one element-wise group
holds a whole layer, one optimizer runs over that one 1-D tensor (the AdamW path of
every default run): every update is element-wise, so updating the shards separately
gives the same numbers as one optimizer over the whole model (a shard's padding has
zero gradient and zero value, and stays zero). Otherwise the shard is stepped as
segments ([Note: segmented shards]) and the parameters of shape-aware optimizers are
updated whole at their owners ([Note: owned parameters], :class:`OwnedParams`, held
here and run by the step runner).

A layer whose shard got no gradient since the last step is skipped, as
torch.optim skips parameters whose ``grad`` is None.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable

import torch

from zero3_offload.config import OptimizerConfig, optimizer_class
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state.disk_tier import NvmeShardTier
from zero3_offload.optimizer_state.optimizer_kind import OptimizerKind, probe_kind
from zero3_offload.optimizer_state.optimizer_plan import OptimizerPlan, ResolvedGroup
from zero3_offload.optimizer_state.owned_params import OwnedParams
from zero3_offload.optimizer_state.segmented_shard import SegmentedShard
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["ShardOptimizers"]

log = get_logger(__name__)


def _fresh_state(kind: OptimizerKind, group: ResolvedGroup | None, master: torch.Tensor) -> dict:
    """What ``kind``'s constructor puts in a new parameter's state (Adagrad's ``sum``),
    on a probe of the master's shape (usually nothing)."""
    probe = master.new_zeros(master.shape)
    overrides = {} if group is None else group.overrides
    return dict(kind.make([{"params": [probe], **overrides}]).state.get(probe, {}))


class ShardOptimizers:
    """Owns the torch optimizers of this rank's layer shards, on the master shards' device.

    Args:
        cfg: optimizer settings.
        masters: (layer, fp32 master shard) pairs; the optimizer updates these
            tensors in place.
        device: where the masters and the state live.
        tier: with ``offload_optimizer_device="nvme"``, the file that holds the masters
            and the full-size state between updates (see [Note: disk tier]); a layer
            must be made :meth:`resident` to be updated or read.
        plan: the parameter groups resolved for this rank (None: the config's optimizer
            over every whole shard).
        owned: the optimizers of the whole parameters this rank owns (with a plan that
            has shape-aware groups).

    Raises:
        ConfigError: when ``cfg.fused`` is True but the device has no fused kernel.
    """

    def __init__(
        self,
        cfg: OptimizerConfig,
        masters: Iterable[tuple[str, torch.Tensor]],
        *,
        device: torch.device,
        tier: NvmeShardTier | None = None,
        plan: OptimizerPlan | None = None,
        owned: OwnedParams | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.tier = tier
        self.owned = owned
        self._plan = plan
        if plan is None:
            default = probe_kind(
                optimizer_class(cfg.kind), cfg.torch_options(), device=device, fused=cfg.fused
            )
        else:
            default = plan.groups[-1].kind
        self.fused = bool(default.kernel.get("fused"))
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._fast: dict[str, tuple[OptimizerKind, ResolvedGroup | None]] = {}
        self._segmented: dict[str, SegmentedShard] = {}
        self._masters: dict[str, torch.Tensor] = {}
        for layer, master in masters:
            self._masters[layer] = master
            lay_plan = None if plan is None else plan.layers[layer]
            if lay_plan is not None and lay_plan.fast is None:
                self._segmented[layer] = SegmentedShard(
                    master, lay_plan.segments, plan.groups, lay_plan.full_keys
                )
                continue
            group = None if lay_plan is None else plan.groups[lay_plan.fast]
            kind = default if group is None else group.kind
            self._fast[layer] = (kind, group)
            self._optimizers[layer] = self._make(layer)

    def _make(self, layer: str) -> torch.optim.Optimizer:
        kind, group = self._fast[layer]
        master = self._masters[layer]
        if group is None or not group.overrides:
            return kind.make([master])
        return kind.make([{"params": [master], **group.overrides}])

    def _state(self, layer: str) -> dict[str, torch.Tensor]:
        """``layer``'s state dict: the one torch's optimizer holds, or the segmented
        layer's (see [Note: segmented shards])."""
        if layer in self._segmented:
            return self._segmented[layer].state
        return self._optimizers[layer].state[self._masters[layer]]

    @contextlib.asynccontextmanager
    async def resident(self, layer: str, *, write: bool) -> AsyncIterator[None]:
        """Hold ``layer``'s master and state in memory for the duration (with the disk
        tier: read before, written back after when ``write``; otherwise nothing to do)."""
        if self.tier is None:
            yield
            return
        master = self._masters[layer]
        async with self.tier.resident(layer, master, self._state(layer), write=write):
            yield

    def step(self, layer: str, grad: torch.Tensor, lr: float) -> None:
        """Update ``layer``'s master shard in place with ``grad`` (fp32, same shape): the
        element-wise parameters; whole-parameter updates are :attr:`owned`'s."""
        master = self._masters[layer]
        grad = grad.to(master.device, torch.float32)
        segmented = self._segmented.get(layer)
        if segmented is not None:
            segmented.step(grad, lr)
            return
        opt = self._optimizers[layer]
        _, group = self._fast[layer]
        scale = 1.0 if group is None else group.lr_scale
        for param_group in opt.param_groups:
            param_group["lr"] = lr * scale
        master.grad = grad
        try:
            opt.step()
        finally:
            master.grad = None

    def state_bytes(self) -> int:
        """Bytes of every optimizer state tensor in memory (moments, step counters; the
        owned parameters' too), counted; the disk tier's resident views count as its
        buffers, not here."""

        def counted(v: object) -> bool:
            return torch.is_tensor(v) and (self.tier is None or not self.tier.owns(v))

        total = sum(s.nbytes(counted) for s in self._segmented.values())
        for opt in self._optimizers.values():
            for state in opt.state.values():
                total += sum(tensor_bytes(v) for v in state.values() if counted(v))
        return total + (0 if self.owned is None else self.owned.nbytes())

    def layer_state(self, layer: str) -> dict[str, torch.Tensor]:
        """The state tensors of ``layer``'s shard (empty before its first step): live, so
        a copy into them changes the state."""
        return {k: v for k, v in self._state(layer).items() if torch.is_tensor(v)}

    def param_optimizers(self) -> dict[str, str]:
        """Each trainable parameter's optimizer class by full name (empty without a plan)."""
        return {} if self._plan is None else self._plan.param_optimizers()

    def uneven_state(self) -> bool:
        """Whether the ranks may keep different state tensors of a layer (segmented
        shards, whole parameters at their owners; see [Note: segmented shards])."""
        return bool(self._segmented) or self.owned is not None

    def owned_state(self, layer: str) -> dict[str, torch.Tensor]:
        """The state of ``layer``'s whole parameters this rank owns (see [Note: owned
        parameters]), ``{"<param>.<key>": tensor}``."""
        return {} if self.owned is None else self.owned.state(layer)

    def owned_names(self, layer: str) -> list[str]:
        """``layer``'s parameters (names in the layer) whose state this rank owns."""
        return [] if self.owned is None else self.owned.owned_names(layer)

    def load_owned_state(self, layer: str, state: dict[str, torch.Tensor]) -> None:
        """Replace the state of ``layer``'s whole parameters this rank owns."""
        if self.owned is not None:
            self.owned.load_state(layer, state)

    def layers(self) -> list[str]:
        """The layers with parameters, in order."""
        return list(self._masters)

    def master(self, layer: str) -> torch.Tensor:
        """``layer``'s fp32 master shard (the tensor the optimizer updates in place)."""
        return self._masters[layer]

    def load_layer_state(self, layer: str, state: dict[str, torch.Tensor]) -> None:
        """Replace ``layer``'s state with ``state`` (tensors are copied to the master's device).

        The state dict is changed in place, so a resident layer's stays the one the disk
        tier writes back. An empty ``state`` is a fresh start: what the optimizer's
        constructor puts in a new parameter's state (Adagrad's ``sum``) is put back."""
        segmented = self._segmented.get(layer)
        if segmented is not None:
            segmented.load(state)
            return
        master = self._masters[layer]
        current = self._optimizers[layer].state[master]
        current.clear()
        if not state:
            current.update(_fresh_state(*self._fast[layer], master))
            return
        current.update({k: v.to(master.device).clone() for k, v in state.items()})

    def reset(self) -> None:
        """Drop all optimizer state (moments and step counts), the owned parameters' too."""
        for layer in self._optimizers:
            self._optimizers[layer] = self._make(layer)
        for segmented in self._segmented.values():
            segmented.load({})
        if self.owned is not None:
            self.owned.reset()
        if self.tier is not None:
            self.tier.forget_state()
