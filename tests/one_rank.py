"""A real one-rank gloo group made inside the test process, for the unit tests.

``dist.init_process_group`` would make it the process's default group, global state
that other tests in the same process would meet. This builds the group as
``torch.distributed.new_group`` does inside (a gloo backend registered on a
``ProcessGroup`` over an in-memory store) without registering it anywhere, so
``dist.is_initialized()`` stays False. Its collectives run the real gloo backend
(with one rank, each is a local copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero3_offload.comm.collectives import Collectives

__all__ = ["one_rank_collectives", "one_rank_group"]


def one_rank_group() -> dist.ProcessGroup:
    """A gloo process group of one rank (this process), registered nowhere."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    gloo = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(gloo)
    group._register_backend(torch.device("cpu"), gloo, dist.ProcessGroupGloo(store, 0, 1))
    return group


def one_rank_collectives(timeout_s: float = 30.0) -> Collectives:
    """:class:`Collectives` over a fresh :func:`one_rank_group` on the CPU.

    Each one holds two daemon threads (its launcher and waiter) for the rest of the
    process, so a test module builds one and shares it.
    """
    return Collectives(one_rank_group(), device=torch.device("cpu"), timeout_s=timeout_s)
