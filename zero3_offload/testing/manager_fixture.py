"""The ``zero3_manager`` fixture: each rank's ready ``Zero3CpuOffloadManager``.

The test names the model and config with a marker::

    @pytest.mark.ranks(2)
    @pytest.mark.zero3_manager(make_model, Zero3CpuOffloadConfig(prefetch_buffer_size=1))
    async def test_step(rank: RankContext, zero3_manager: Zero3CpuOffloadManager) -> None:
        ...

Each rank seeds torch (``seed=``, default 0), calls the model factory, builds
the manager on the rank's group and closes it after the test, also when the
test failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.manager import Zero3CpuOffloadManager
from zero3_offload.testing.rank_fixture import rank_fixture
from zero3_offload.testing.run_ranks import RankContext

__all__ = ["ManagerSpec", "zero3_manager"]


@attrs.frozen
class ManagerSpec:
    """The ``@pytest.mark.zero3_manager`` arguments, sent to every rank."""

    model: Callable[[], Any]
    config: Zero3CpuOffloadConfig
    seed: int = 0
    units: Sequence[Any] | None = None

    @classmethod
    def of(
        cls,
        model: Callable[[], Any],
        config: Zero3CpuOffloadConfig | None = None,
        *,
        seed: int = 0,
        units: Sequence[Any] | None = None,
    ) -> ManagerSpec:
        if not callable(model):
            raise TypeError(
                f"@pytest.mark.zero3_manager: model must be a callable that builds the model "
                f"in each rank (a class, a module-level function, a functools.partial), "
                f"not {type(model).__name__}"
            )
        return cls(model=model, config=config or Zero3CpuOffloadConfig(), seed=seed, units=units)


@rank_fixture
async def zero3_manager(
    rank: RankContext, _zero3_manager_spec: ManagerSpec
) -> AsyncIterator[Zero3CpuOffloadManager]:
    """This rank's manager for the model and config of ``@pytest.mark.zero3_manager``;
    closed after the test."""
    import torch

    spec = _zero3_manager_spec
    torch.manual_seed(spec.seed)
    manager = Zero3CpuOffloadManager(
        spec.config, rank.group, spec.model(), units=None if spec.units is None else spec.units
    )
    async with manager:
        yield manager
