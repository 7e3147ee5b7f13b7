"""Checkpoints: the format, atomic save, load at any world size, consolidation.

- ``format``: names, metadata and the [Note: checkpoint format];
- ``atomic_save``: every rank writes, rank 0 commits (write, fsync, rename);
- ``reshard_load``: each rank reads the slices it owns now, at any world size;
- ``checkpointer``: one rank's training state in and out of a checkpoint;
- ``consolidate``: one full fp32 state dict from the shards, streamed.
"""

from zero3_offload.checkpoint.checkpointer import ShardCheckpointer
from zero3_offload.checkpoint.consolidate import consolidate_checkpoint, iter_full_parameters
from zero3_offload.checkpoint.reshard_load import LoadedShards, read_shards

__all__ = [
    "LoadedShards",
    "ShardCheckpointer",
    "consolidate_checkpoint",
    "iter_full_parameters",
    "read_shards",
]
