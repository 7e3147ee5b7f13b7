"""Running async code on N real local ranks, for tests and examples.

:func:`run_ranks` runs an async function on ``world_size`` gloo ranks on this
machine and returns each rank's result. The pytest plugin (``pytest_plugin``,
installed as the ``pytest11`` entry point ``zero3_offload``) runs a
``@pytest.mark.ranks(n)`` test's body in every rank instead, with
:func:`rank_fixture` for fixtures computed in the ranks; see ``docs/testing.md``.
"""

from zero3_offload.testing.rank_fixture import rank_fixture
from zero3_offload.testing.run_ranks import (
    RankContext,
    RankFailedError,
    free_port,
    rank_pids_alive,
    run_ranks,
)

__all__ = [
    "RankContext",
    "RankFailedError",
    "free_port",
    "rank_fixture",
    "rank_pids_alive",
    "run_ranks",
]
