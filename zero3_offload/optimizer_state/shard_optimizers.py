"""Per-shard optimizers: the optimizer state and the step math (the Rust module's
``optimizer_state.rs``).

Each layer's fp32 master shard is driven by its own ``torch.optim`` optimizer
(AdamW, Adam or SGD) over that one 1-D tensor, so the update is torch's own
kernel (fused where the device supports it, else foreach) with exactly
torch.optim's semantics. Every update is elementwise, so updating the shards
separately gives the same numbers as one optimizer over the whole model: a
shard's padding has zero gradient and zero value, and stays zero.

A layer whose shard got no gradient since the last step is skipped, as
torch.optim skips parameters whose ``grad`` is None.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable

import torch

from zero3_offload.config import OptimizerConfig
from zero3_offload.errors import ConfigError
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state.disk_tier import NvmeShardTier
from zero3_offload.stats.tensor_bytes import tensor_bytes

__all__ = ["ShardOptimizers"]

log = get_logger(__name__)


def _make_optimizer(
    cfg: OptimizerConfig, param: torch.Tensor, *, fused: bool | None
) -> torch.optim.Optimizer:
    kernel: dict[str, bool] = {"fused": True} if fused else {"foreach": True}
    if cfg.kind == "sgd":
        return torch.optim.SGD(
            [param],
            lr=0.0,
            momentum=cfg.momentum,
            dampening=cfg.dampening,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
            **kernel,
        )
    cls = torch.optim.AdamW if cfg.kind == "adamw" else torch.optim.Adam
    return cls(
        [param],
        lr=0.0,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        amsgrad=cfg.amsgrad,
        **kernel,
    )


def _fused_supported(cfg: OptimizerConfig, device: torch.device) -> bool:
    probe = torch.zeros(1, device=device)
    probe.grad = torch.zeros(1, device=device)
    try:
        _make_optimizer(cfg, probe, fused=True).step()
    except (RuntimeError, ValueError, NotImplementedError):
        # Capability probe: no fused kernel for this optimizer/device; foreach is used.
        return False
    return True


class ShardOptimizers:
    """Owns one torch optimizer per layer shard, on the master shards' device.

    Args:
        cfg: optimizer settings.
        masters: (layer, fp32 master shard) pairs; the optimizer updates these
            tensors in place.
        device: where the masters and the state live.
        tier: with ``offload_optimizer_device="nvme"``, the file that holds the masters
            and the full-size state between updates (see [Note: disk tier]); a layer
            must be made :meth:`resident` to be updated or read.

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
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.tier = tier
        fused = cfg.fused
        if fused is None:
            fused = _fused_supported(cfg, device)
        elif fused and not _fused_supported(cfg, device):
            raise ConfigError(
                f"optimizer.fused=True is invalid here: torch has no fused {cfg.kind} kernel "
                f"for {device.type}; set fused=None or False"
            )
        self.fused = fused
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._masters: dict[str, torch.Tensor] = {}
        for layer, master in masters:
            self._masters[layer] = master
            self._optimizers[layer] = _make_optimizer(cfg, master, fused=fused)

    @contextlib.asynccontextmanager
    async def resident(self, layer: str, *, write: bool) -> AsyncIterator[None]:
        """Hold ``layer``'s master and state in memory for the duration (with the disk
        tier: read before, written back after when ``write``; otherwise nothing to do)."""
        if self.tier is None:
            yield
            return
        master = self._masters[layer]
        state = self._optimizers[layer].state[master]
        async with self.tier.resident(layer, master, state, write=write):
            yield

    def step(self, layer: str, grad: torch.Tensor, lr: float) -> None:
        """Update ``layer``'s master shard in place with ``grad`` (fp32, same shape)."""
        master = self._masters[layer]
        opt = self._optimizers[layer]
        for group in opt.param_groups:
            group["lr"] = lr
        master.grad = grad.to(master.device, torch.float32)
        try:
            opt.step()
        finally:
            master.grad = None

    def state_bytes(self) -> int:
        """Bytes of every optimizer state tensor in memory (moments, step counters),
        counted; the disk tier's resident views count as its buffers, not here."""
        total = 0
        for opt in self._optimizers.values():
            for state in opt.state.values():
                total += sum(
                    tensor_bytes(v)
                    for v in state.values()
                    if torch.is_tensor(v) and (self.tier is None or not self.tier.owns(v))
                )
        return total

    def layer_state(self, layer: str) -> dict[str, torch.Tensor]:
        """The state tensors of ``layer``'s shard (empty before its first step)."""
        opt = self._optimizers[layer]
        master = self._masters[layer]
        return {k: v for k, v in opt.state.get(master, {}).items() if torch.is_tensor(v)}

    def layers(self) -> list[str]:
        return list(self._optimizers)

    def master(self, layer: str) -> torch.Tensor:
        """``layer``'s fp32 master shard (the tensor the optimizer updates in place)."""
        return self._masters[layer]

    def load_layer_state(self, layer: str, state: dict[str, torch.Tensor]) -> None:
        """Replace ``layer``'s state with ``state`` (tensors are copied to the master's device).

        The state dict is changed in place, so a resident layer's stays the one the disk
        tier writes back."""
        master = self._masters[layer]
        current = self._optimizers[layer].state[master]
        current.clear()
        current.update({k: v.to(master.device).clone() for k, v in state.items()})

    def reset(self) -> None:
        """Drop all optimizer state (moments and step counts)."""
        for opt in self._optimizers.values():
            opt.state.clear()
        if self.tier is not None:
            self.tier.forget_state()
