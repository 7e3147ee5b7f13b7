"""The manager's state and lifecycle: full state dict, reset, close, ``async with``."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zero3_offload.manager import Zero3CpuOffloadManager

__all__ = ["LifecycleMixin"]


class LifecycleMixin:
    """State and lifecycle methods of :class:`Zero3CpuOffloadManager`."""

    async def full_state_dict(self: Zero3CpuOffloadManager) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value, on every rank (a collective).

        Returns:
            ``{name as in model.named_parameters(): fp32 CPU tensor}``.
        """
        self._check_open()
        out: dict[str, torch.Tensor] = {}
        for name, layout in self.layouts.items():
            if not layout.padded_numel:
                continue
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=self.device)
            await self.comm.all_gather(full, self.params.master(name).to(self.device))
            for pname, view in layout.unflatten(full):
                out[f"{name}.{pname}"] = view.detach().to("cpu", copy=True)
        return out

    async def reset_state(self: Zero3CpuOffloadManager) -> None:
        """Drop optimizer state, gradients, loss scale and the pending forward; keep parameters."""
        self._check_open()
        await self.prefetch.release_all()
        self.optimizer.reset()
        self.grads.clear()
        self._record = None
        self._calls_since_update = 0
        self._early_lr = None
        self.updater.reset()

    async def close(self: Zero3CpuOffloadManager) -> None:
        """Release gathered parameters and pending state. Idempotent."""
        if self._closed:
            return
        await self.prefetch.release_all(keep_persistent=False)
        self._record = None
        self._closed = True

    async def __aenter__(self: Zero3CpuOffloadManager) -> Zero3CpuOffloadManager:
        return self

    async def __aexit__(
        self: Zero3CpuOffloadManager,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
