"""The optimizer a training framework holds: its parameter groups carry the learning rate
its scheduler sets, and its step is the manager's update.

[Note: the framework's optimizer]
A transformers ``Trainer`` or Lightning steps ``optimizer.step()`` once per optimizer
step, after the micro-steps of an accumulation window, and an LR scheduler writes
``param_groups[i]["lr"]`` between steps. :class:`ManagerOptimizer` is a
``torch.optim.Optimizer`` over the model's (sharded) parameters in the framework's
groups, holding no state of its own: the shards' optimizer state lives in the manager.
Each micro-step's :meth:`count_micro_step` and the window's last :meth:`step` call
``optimizer_step(lr)`` with the groups' learning rate, so the manager updates once per
window with the rate the scheduler set for that step. Every group must carry the same
rate (the manager's groups share one; their weight decays are theirs). The update's
global gradient norm before clipping lands in :attr:`grad_norm` (a tensor filled in
place, so a framework that took it before the step reads it after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero3_offload.errors import ConfigError, StateError
from zero3_offload.sync.sync_manager import SyncManager

__all__ = ["ManagerOptimizer"]


class ManagerOptimizer(torch.optim.Optimizer):
    """Steps the manager's update with the groups' learning rate (see [Note: the
    framework's optimizer]).

    Args:
        sync: the manager's synchronous face.
        param_groups: torch's groups over the model's parameters (``"lr"`` and the
            options the manager was built with, e.g. ``"weight_decay"``).
        lr: the default learning rate of a group without one.
    """

    def __init__(
        self, sync: SyncManager, param_groups: Iterable[dict[str, Any]], *, lr: float
    ) -> None:
        groups = [g for g in param_groups if list(g["params"])]
        super().__init__(groups, {"lr": lr})
        self._sync = sync
        self.grad_norm = torch.tensor(float("nan"))
        self.step_was_skipped = False  # accelerate reads it: a non-finite step skipped

    @property
    def learning_rate(self) -> float:
        """The groups' learning rate now.

        Raises:
            ConfigError: when the groups' rates differ.
        """
        rates = {float(g["lr"]) for g in self.param_groups}
        if len(rates) != 1:
            raise ConfigError(
                f"the parameter groups carry learning rates {sorted(rates)}: zero3_offload "
                "updates every group with one learning rate per step; give the groups one rate"
            )
        return rates.pop()

    def count_micro_step(self) -> None:
        """Count a micro-step of the open window (no update: the window is not full).

        Raises:
            StateError: when the manager's window would close here (the framework's
                accumulation differs from the manager's).
        """
        if self._sync.optimizer_step(self.learning_rate):
            raise StateError(
                "the manager updated inside the framework's accumulation window: its "
                "gradient_accumulation_steps must equal the framework's"
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The window's last micro-step: run ``closure`` (with autograd on, as torch's
        optimizers do: Lightning's runs the training step and the backward), then the
        manager updates with :attr:`learning_rate`.

        Returns:
            What ``closure`` returned (None without one).

        Raises:
            StateError: when the window holds fewer micro-steps than the manager's
                ``gradient_accumulation_steps`` (e.g. the short last window of an epoch).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        manager = self._sync.manager
        window = manager.engine.counter.window_calls + 1
        wanted = manager.config.gradient_accumulation_steps
        if window != wanted:
            raise StateError(
                f"the optimizer step came after {window} micro-batch(es), but "
                f"gradient_accumulation_steps is {wanted}: every window must be full (the last "
                "window of an epoch is short when the batches per epoch are not a multiple of "
                "it: drop the last batches, e.g. dataloader_drop_last or max_steps)"
            )
        before = manager.steps_completed
        updated = self._sync.optimizer_step(self.learning_rate)
        if manager.steps_completed == before:
            raise StateError("the manager's optimizer step did not close its window")
        self.step_was_skipped = not updated
        self._opt_called = True  # what torch's LR schedulers check before their first step
        norm = manager.last_grad_norm
        self.grad_norm.fill_(float("nan") if norm is None else norm)
        return loss

    # torch's LR schedulers wrap an optimizer's step to see that it ran before theirs; this
    # step records it itself (``_opt_called``), also under a scheduler rebound to it.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the manager's window starts with zero gradients after each update."""
