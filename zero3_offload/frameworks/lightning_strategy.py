"""``Zero3Strategy``: Lightning's ``Trainer(strategy=Zero3Strategy(config=...))`` trains the
LightningModule with ZeRO-3 and offload. Importing this module imports Lightning.

[Note: Lightning under ZeRO-3]
The strategy is Lightning's DDP strategy (its launcher, its process group, its
``DistributedSampler``, its ``reduce``/``barrier``/``broadcast``) with the parameters
handed to a module-mode manager instead of a DDP wrapper:

* at ``setup`` the module's ``configure_optimizers`` runs as under DDP; its optimizer
  (any ``torch.optim`` optimizer: its class, its defaults and each parameter group's
  own options) becomes the manager's optimizer config and parameter groups, and the
  manager takes the module (each rank keeps its shards). Lightning then holds a
  :class:`~zero3_offload.frameworks.manager_optimizer.ManagerOptimizer` over the same
  groups; the LR schedulers are rebound to it, so they drive the manager's rate.
  ``accumulate_grad_batches`` and ``gradient_clip_val`` (by norm) are the manager's
  accumulation and clipping;
* calling the module (``self(x)`` in ``training_step``/``validation_step``) runs its
  ``forward`` through the manager (see [Note: the synchronous face]); the manager's
  model thread calls the module's own ``forward``. A step must call the module itself:
  a submodule called directly holds no values (the manager raises ``StateError``
  naming the parameter);
* ``backward`` is the manager's backward of ``A * loss`` (Lightning divides the loss by
  ``A``, the accumulation; DDP sums the micro-steps and averages the ranks, the manager
  averages both), and counts the micro-steps of the window;
* a checkpoint is Lightning's file (loops, schedulers, callbacks; no weights) written by
  rank 0 and the manager's checkpoint in ``<file>.zero3/``, written by every rank and
  loadable at any world size; ``ckpt_path=`` loads both.

Refused, naming the setting: several optimizers, ``gradient_clip_algorithm="value"``,
precision other than ``"32-true"``, ``"bf16-true"`` and ``"16-true"``, manual
optimization.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from zero3_offload.config import (
    OptimizerConfig,
    Zero3CpuOffloadConfig,
    optimizer_label,
    optimizer_option_names,
)
from zero3_offload.engine.model_units import UnitSpec
from zero3_offload.errors import ConfigError
from zero3_offload.frameworks.managed_model import ManagedModel
from zero3_offload.frameworks.manager_group import manager_group
from zero3_offload.frameworks.manager_optimizer import ManagerOptimizer
from zero3_offload.logging import get_logger
from zero3_offload.sync.sync_manager import SyncManager

__all__ = ["Zero3Strategy"]

log = get_logger(__name__)

try:
    import lightning.pytorch as _pl
except ImportError as exc:
    raise ConfigError(
        f"Zero3Strategy needs Lightning, which could not be imported ({exc}); install it "
        "with: pip install 'zero3_offload[lightning]'"
    ) from exc
_DDPStrategy = _pl.strategies.DDPStrategy
_PRECISION = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}
_SUFFIX = ".zero3"  # the manager's checkpoint beside Lightning's file


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def optimizer_mapping(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]
) -> tuple[OptimizerConfig, list[dict[str, Any]]]:
    """The manager's optimizer config and parameter groups for ``optimizer``: its class and
    defaults, and each group's parameters (by name) with the options it sets otherwise."""
    cls = type(optimizer)
    options = [n for n in optimizer_option_names(cls) if n in optimizer.defaults]
    config = OptimizerConfig(
        kind=optimizer_label(cls),
        options={n: _plain(optimizer.defaults[n]) for n in options},
    )
    groups = []
    for group in optimizer.param_groups:
        own = {n: _plain(group[n]) for n in options if group[n] != optimizer.defaults[n]}
        groups.append({"params": [names[p] for p in group["params"]], **own})
    return config, groups


def _default_units(module: nn.Module) -> list[UnitSpec]:
    """Transformers' ``_no_split_modules`` classes of any submodule; else each child of
    the module that holds parameters."""
    classes: set[str] = set()
    for sub in module.modules():
        classes.update(getattr(sub, "_no_split_modules", None) or ())
    if classes:
        return [type(m) for m in module.modules() if type(m).__name__ in classes]
    return [n for n, child in module.named_children() if next(child.parameters(), None) is not None]


class Zero3Strategy(_DDPStrategy):  # type: ignore[misc,valid-type]
    """Lightning's strategy for ZeRO-3 with offload (see [Note: Lightning under ZeRO-3]).

    Args:
        config: the manager's config; ``accumulate_grad_batches``, ``gradient_clip_val``,
            the precision and the optimizer come from the Lightning ``Trainer`` and the
            module.
        units: submodule names or ``nn.Module`` classes sharded and gathered as units
            (default: a transformers model's ``_no_split_modules``, else each child of
            the module holding parameters).
        kwargs: DDPStrategy's (``process_group_backend``, ``timeout``, ...).

    Example::

        trainer = L.Trainer(strategy=Zero3Strategy(config=Zero3CpuOffloadConfig()),
                            accelerator="cpu", devices=2)
    """

    strategy_name = "zero3_offload"

    def __init__(
        self,
        config: Zero3CpuOffloadConfig | None = None,
        *,
        units: Sequence[UnitSpec] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._zero3_config = config or Zero3CpuOffloadConfig()
        self._units = units
        self._sync: SyncManager | None = None
        self._manager_optimizer: ManagerOptimizer | None = None
        self._pending_load: str | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"zero3_offload"`` (its default config)."""
        strategy_registry.register(
            cls.strategy_name, cls, description="ZeRO-3 with CPU offload (zero3_offload)"
        )

    @property
    def zero3(self) -> SyncManager:
        """The manager's synchronous face (after ``setup``)."""
        if self._sync is None:
            raise ConfigError("Zero3Strategy: the manager is built in setup (trainer.fit)")
        return self._sync

    # ------------------------------------------------------------------ setup

    def _checked_config(self, trainer: Any) -> Zero3CpuOffloadConfig:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ConfigError("Zero3Strategy: manual optimization is not honoured")
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ConfigError(
                f"Zero3Strategy: gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} "
                "is not honoured: the manager clips by the global norm"
            )
        precision = str(trainer.precision)
        if precision not in _PRECISION:
            raise ConfigError(
                f"Zero3Strategy: precision={precision!r} is not honoured: use one of "
                f"{', '.join(_PRECISION)} (the manager keeps fp32 masters)"
            )
        return attrs.evolve(
            self._zero3_config,
            gradient_accumulation_steps=int(trainer.accumulate_grad_batches),
            gradient_clipping=float(trainer.gradient_clip_val or 0.0),
            compute_dtype=_PRECISION[precision],
            device="cpu" if self.root_device.type == "cpu" else str(self.root_device),
        )

    def setup(self, trainer: Any) -> None:
        """Build the manager over the module (see [Note: Lightning under ZeRO-3])."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        config = self._checked_config(trainer)
        groups = None
        fitting = trainer.state.fn == _pl.trainer.states.TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)  # the module's configure_optimizers, as under DDP
            if len(self.optimizers) != 1:
                raise ConfigError(
                    f"Zero3Strategy: {len(self.optimizers)} optimizers are not honoured: "
                    "configure_optimizers must return one optimizer"
                )
            names = {p: n for n, p in module.named_parameters()}
            optimizer_config, groups = optimizer_mapping(self.optimizers[0], names)
            config = attrs.evolve(config, optimizer=optimizer_config)
        units = self._units if self._units is not None else _default_units(module)
        self._sync = SyncManager(
            config, manager_group(config.device), module, units=units, param_groups=groups
        )
        self._route_forward(module)
        if fitting:
            user = self.optimizers[0]
            ours = ManagerOptimizer(
                self._sync,
                [dict(group) for group in user.param_groups],
                lr=float(user.defaults.get("lr", 0.0)),
            )
            for scheduler in self.lr_scheduler_configs:
                scheduler.scheduler.optimizer = ours
            self.optimizers = [ours]
            self._manager_optimizer = ours
        if self._pending_load is not None:
            self._sync.load_checkpoint(self._pending_load)
            self._pending_load = None
        self.setup_precision_plugin()
        log.info("lightning_ready", rank=self._sync.rank, world_size=self._sync.world_size)

    def _route_forward(self, module: nn.Module) -> None:
        """Calling ``module`` from the training thread runs the manager's forward."""
        sync, inner, owner = self._sync, module.forward, threading.get_ident()
        assert sync is not None
        managed = ManagedModel(sync)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner:
                return managed(*args, **kwargs)
            return inner(*args, **kwargs)  # the manager's model thread

        module.forward = forward

    def configure_ddp(self) -> None:
        """Nothing: the manager reduces the gradients (no DDP wrapper)."""

    def model_to_device(self) -> None:
        """Nothing: the manager moves each unit to the device while it is gathered."""

    # ------------------------------------------------------ backward, step

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """The manager's backward of ``A * loss`` (see [Note: Lightning under ZeRO-3])."""
        sync, ours = self.zero3, self._manager_optimizer
        assert ours is not None
        window = sync.config.gradient_accumulation_steps
        sync.backward(closure_loss * window)
        if sync.manager.engine.counter.window_calls + 1 < window:
            ours.count_micro_step()
        return closure_loss

    # ------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing in Lightning's file: the weights are in the manager's checkpoint."""
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """The manager's checkpoint in ``<filepath>.zero3`` (every rank), then Lightning's
        file (rank 0)."""
        self.zero3.save_checkpoint(f"{os.fspath(filepath)}{_SUFFIX}")
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(f"{os.fspath(filepath)}{_SUFFIX}", ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Lightning's file; the manager's checkpoint beside it is loaded now or, before
        ``setup``, when the manager is built."""
        ours = f"{os.fspath(checkpoint_path)}{_SUFFIX}"
        if not Path(ours).is_dir():
            raise ConfigError(f"{checkpoint_path}: no {ours}: not saved by Zero3Strategy")
        if self._sync is None:
            self._pending_load = ours
        else:
            self._sync.load_checkpoint(ours)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: the manager's checkpoint holds the weights."""

    def teardown(self) -> None:
        """Close the manager, then Lightning's teardown."""
        if self._sync is not None:
            self._sync.close()
        super().teardown()


Zero3Strategy.register_strategies(_pl.strategies.StrategyRegistry)  # strategy="zero3_offload"
