"""The process group of this rank's sequence: S consecutive ranks of the world."""

from __future__ import annotations

import datetime as _dt

import torch.distributed as dist

from zero3_offload.errors import ConfigError

__all__ = ["sequence_group"]


def sequence_group(group: dist.ProcessGroup, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A group of its own for the all-to-alls of this rank's sequence (a collective).

    Every rank creates every sequence group, in order (``dist.new_group`` needs every
    rank of the default group), and keeps its own: ranks ``[k*S, (k+1)*S)``.

    Raises:
        ConfigError: when ``size`` does not divide the group's size, or ``group`` is not
            the default (world) group.
    """
    world = group.size()
    if world % size:
        raise ConfigError(
            f"sequence_parallel_size={size} is invalid with {world} ranks: it must divide "
            "the world size (each sequence is split over that many consecutive ranks, and "
            "the groups of them are data parallel); pick a divisor of the world size"
        )
    if dist.get_world_size() != world or dist.get_process_group_ranks(group) != list(range(world)):
        raise ConfigError(
            f"sequence_parallel_size={size} needs the manager's process group to be the "
            "default (world) group, as init_process_group builds it: the sequence groups "
            "are made from the world's ranks"
        )
    rank = group.rank()
    timeout = _dt.timedelta(seconds=timeout_s)
    backend = dist.get_backend(group)
    own: dist.ProcessGroup | None = None
    for first in range(0, world, size):
        made = dist.new_group(list(range(first, first + size)), timeout=timeout, backend=backend)
        if first <= rank < first + size:
            own = made
    assert own is not None
    return own
