"""The process group a framework's manager runs on: its own group over every rank.

The framework (transformers' accelerate, Lightning) runs its own collectives on the
default group from the caller's thread (a loss gathered for logging, a sampler's seed),
while the manager's launcher may still run prefetched gathers on its loop's thread (see
[Note: the synchronous face] in ``sync.loop_thread``). Two threads enqueueing on one
group could interleave differently on two ranks; on a group of its own the manager's
collectives keep their order. Outside any launcher (one process, no group yet) a
one-rank gloo group is started first, on an in-process store.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from zero3_offload.errors import ConfigError

__all__ = ["manager_group"]


def manager_group(device: str) -> dist.ProcessGroup:
    """A new group over every rank of the default group, for a manager computing on
    ``device`` (gloo for ``"cpu"``, the default group's backend otherwise). Every rank
    calls it, in the same order as its other groups.

    Raises:
        ConfigError: when ``WORLD_SIZE`` says several ranks but no group was started.
    """
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            raise ConfigError(
                f"WORLD_SIZE={world} but no process group was started: build the framework's "
                "arguments (e.g. TrainingArguments) before the trainer, under torchrun"
            )
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    backend = "gloo" if device == "cpu" else None
    return dist.new_group(ranks=list(range(dist.get_world_size())), backend=backend)
