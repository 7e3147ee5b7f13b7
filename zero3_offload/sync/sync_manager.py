"""The manager's synchronous face (see [Note: the synchronous face] in ``sync.loop_thread``).

:class:`SyncManager` builds a :class:`~zero3_offload.manager.Zero3CpuOffloadManager` on
a :class:`~zero3_offload.sync.loop_thread.LoopThread` and exposes its methods as plain
calls: ``sync.forward(**batch)`` is ``await manager.forward(**batch)`` run on that loop,
with the caller's grad mode, returning its result or raising its exception. Every rank
calls the same methods in the same order, as with the async API, which stays the primary
one (its docstrings hold the details each method here refers to).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.engine.model_units import UnitSpec
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.memory.memory_stats import Zero3MemoryStats
from zero3_offload.optimizer_state.optimizer_plan import ParamGroup
from zero3_offload.parameter.meta_init import InitFn, ShardSource, reset_parameters_in_order
from zero3_offload.stats.performance import Zero3PerformanceStats
from zero3_offload.sync.loop_thread import LoopThread

__all__ = ["SyncManager"]


class SyncManager:
    """A :class:`Zero3CpuOffloadManager` driven by synchronous calls.

    The constructor takes the manager's arguments (see
    :class:`~zero3_offload.manager.Zero3CpuOffloadManager`); the manager is built on
    the face's own event loop. Close it (``close()`` or a ``with`` block) to release
    the manager and stop the loop.

    Example::

        with SyncManager(config, group, model) as sync:
            out = sync.forward(input_ids=x, labels=x)
            sync.backward(out.loss)
            sync.optimizer_step(1e-3)

    Raises:
        The manager's constructor's errors (``ConfigError``, ``InputError``,
        ``MemoryBudgetError``, ``CommunicationError``), as it raises them.
    """

    def __init__(
        self,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        *,
        init_fn: InitFn = reset_parameters_in_order,
        units: Sequence[UnitSpec] | None = None,
        shard_source: ShardSource | None = None,
        param_groups: Sequence[ParamGroup] | None = None,
    ) -> None:
        def build() -> Zero3CpuOffloadManager:
            return Zero3CpuOffloadManager(
                config,
                process_group,
                model,
                init_fn=init_fn,
                units=units,
                shard_source=shard_source,
                param_groups=param_groups,
            )

        self._loop, self._manager = _built(build)

    @classmethod
    def from_manager_factory(cls, factory: Callable[[], Zero3CpuOffloadManager]) -> SyncManager:
        """The face of the manager ``factory()`` builds (called on the face's loop), e.g.
        ``lambda: Zero3CpuOffloadManager.from_pretrained(config, group, path)``."""
        face = cls.__new__(cls)
        face._loop, face._manager = _built(factory)
        return face

    @classmethod
    def from_meta(
        cls,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        model: nn.Module | Mapping[str, nn.Module],
        *,
        seed: int | None = None,
        init_fn: InitFn = reset_parameters_in_order,
        param_groups: Sequence[ParamGroup] | None = None,
    ) -> SyncManager:
        """:meth:`Zero3CpuOffloadManager.from_meta`'s manager, synchronously."""
        return cls.from_manager_factory(
            lambda: Zero3CpuOffloadManager.from_meta(
                config, process_group, model, seed=seed, init_fn=init_fn, param_groups=param_groups
            )
        )

    @classmethod
    def from_pretrained(
        cls,
        config: Zero3CpuOffloadConfig,
        process_group: dist.ProcessGroup,
        path: str | os.PathLike[str],
        *,
        units: Sequence[UnitSpec] | None = None,
        param_groups: Sequence[ParamGroup] | None = None,
        peft_config: Any = None,
        seed: int = 0,
    ) -> SyncManager:
        """:meth:`Zero3CpuOffloadManager.from_pretrained`'s manager, synchronously."""
        return cls.from_manager_factory(
            lambda: Zero3CpuOffloadManager.from_pretrained(
                config,
                process_group,
                path,
                units=units,
                param_groups=param_groups,
                peft_config=peft_config,
                seed=seed,
            )
        )

    # -------------------------------------------------------------- accessors

    @property
    def manager(self) -> Zero3CpuOffloadManager:
        """The async manager (its coroutines belong to :attr:`loop_thread`'s loop)."""
        return self._manager

    @property
    def loop_thread(self) -> LoopThread:
        """The thread and loop the calls run on."""
        return self._loop

    @property
    def config(self) -> Zero3CpuOffloadConfig:
        """The configuration the manager runs with."""
        return self._manager.config

    @property
    def model(self) -> nn.Module | None:
        """The whole model in module mode; None for a chain of layers."""
        return self._manager.model

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return self._manager.device

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._manager.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._manager.world_size

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The model's layers, in order."""
        return self._manager.layer_names

    @property
    def steps_completed(self) -> int:
        """Optimizer steps completed (see the manager's)."""
        return self._manager.steps_completed

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless ``compute_dtype`` is float16)."""
        return self._manager.loss_scale

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping at the last closed step (clipping on)."""
        return self._manager.last_grad_norm

    def get_performance_stats(self) -> Zero3PerformanceStats:
        """A snapshot of this rank's timings and counts."""
        return self._manager.get_performance_stats()

    def get_memory_stats(self) -> Zero3MemoryStats:
        """Bytes this rank holds now, counted from the tensors."""
        return self._manager.get_memory_stats()

    def gathered(
        self, *modules_or_parameters: nn.Module | torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        """:meth:`Zero3CpuOffloadManager.gathered` (in the model's code, on the model thread)."""
        return self._manager.gathered(*modules_or_parameters)

    # ----------------------------------------------------------------- passes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``await manager.forward(*args, **kwargs)`` (module mode), under the caller's
        grad mode: a training forward, or under ``torch.no_grad()`` an evaluation."""
        return self._loop.run(lambda: self._manager.forward(*args, **kwargs))

    def backward(self, loss: torch.Tensor, *, tokens: int | torch.Tensor | None = None) -> None:
        """``await manager.backward(loss, tokens=tokens)`` (module mode)."""
        self._loop.run(lambda: self._manager.backward(loss, tokens=tokens))

    def forward_pass(self, x: torch.Tensor, layer_names: Sequence[str]) -> torch.Tensor:
        """``await manager.forward_pass(x, layer_names)`` (a chain of layers)."""
        return self._loop.run(lambda: self._manager.forward_pass(x, layer_names))

    def backward_pass(
        self,
        grad_output: torch.Tensor,
        layer_names: Sequence[str],
        *,
        learning_rate: float | None = None,
        tokens: int | torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``await manager.backward_pass(...)`` (a chain of layers)."""
        return self._loop.run(
            lambda: self._manager.backward_pass(
                grad_output, layer_names, learning_rate=learning_rate, tokens=tokens
            )
        )

    def optimizer_step(self, learning_rate: float) -> bool:
        """``await manager.optimizer_step(learning_rate)``: True when it updated."""
        return self._loop.run(lambda: self._manager.optimizer_step(learning_rate))

    def generate(
        self, input_ids: torch.Tensor, *, keep_gathered: bool = True, **kwargs: Any
    ) -> Any:
        """``await manager.generate(input_ids, ...)`` (module mode)."""
        return self._loop.run(
            lambda: self._manager.generate(input_ids, keep_gathered=keep_gathered, **kwargs)
        )

    def abandon_step(self, error: BaseException) -> NoReturn:
        """``await manager.abandon_step(error)``: raises ``StepAbandonedError`` here too."""
        self._loop.run(lambda: self._manager.abandon_step(error))
        raise AssertionError("abandon_step always raises")  # pragma: no cover

    # ----------------------------------------------------------- state, stats

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``await manager.full_state_dict()`` (a collective)."""
        return self._loop.run(self._manager.full_state_dict)

    def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_bytes: int = 5 * 2**30,
        dtype: torch.dtype = torch.float32,
        merged: bool = False,
    ) -> Path:
        """``await manager.save_pretrained(directory, ...)`` (a collective)."""
        return self._loop.run(
            lambda: self._manager.save_pretrained(
                directory, max_shard_bytes=max_shard_bytes, dtype=dtype, merged=merged
            )
        )

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        include_frozen: bool = True,
        training_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """``await manager.save_checkpoint(path, ...)`` (a collective)."""
        return self._loop.run(
            lambda: self._manager.save_checkpoint(
                path, include_frozen=include_frozen, training_state=training_state
            )
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """``await manager.load_checkpoint(path)`` (a collective; any world size)."""
        return self._loop.run(lambda: self._manager.load_checkpoint(path))

    def reset_state(self) -> None:
        """``await manager.reset_state()``."""
        self._loop.run(self._manager.reset_state)

    def force_memory_optimization(self) -> int:
        """``await manager.force_memory_optimization()``: bytes released."""
        return self._loop.run(self._manager.force_memory_optimization)

    def adapt_performance(self) -> int:
        """``await manager.adapt_performance()`` (a collective): the new prefetch depth."""
        return self._loop.run(self._manager.adapt_performance)

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the manager (``await manager.close()``), then stop the loop. Idempotent;
        the loop stops even when closing the manager raised."""
        if self._loop.thread.is_alive():
            try:
                self._loop.run(self._manager.close)
            finally:
                self._loop.close()

    def __enter__(self) -> SyncManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SyncManager(rank={self.rank}, world_size={self.world_size})"


def _built(factory: Callable[[], Zero3CpuOffloadManager]) -> tuple[LoopThread, Any]:
    """A new loop thread and the manager ``factory()`` builds on it (the loop is stopped
    when building fails)."""
    loop = LoopThread()

    async def build() -> Zero3CpuOffloadManager:
        return factory()

    try:
        return loop, loop.run(build)
    except BaseException:
        loop.close()
        raise
