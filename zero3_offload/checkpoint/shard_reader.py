"""Reading element ranges of saved flat buffers from a checkpoint's per-rank files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zero3_offload.checkpoint.format import open_for_reading, shard_file
from zero3_offload.errors import CheckpointError

__all__ = ["ShardReader"]


class ShardReader:
    """Reads ranges of the flat buffers that a checkpoint's per-rank files hold in shards.

    Args:
        directory: the checkpoint directory.
        world: the world size it was saved at.
    """

    def __init__(self, directory: Path, world: int) -> None:
        self._files = [directory / shard_file(r, world) for r in range(world)]
        self._handles: dict[int, Any] = {}
        self.world = world

    def _open(self, rank: int) -> Any:
        if rank not in self._handles:
            try:
                self._handles[rank] = open_for_reading(self._files[rank])
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{self._files[rank]}: unreadable shard ({exc})") from exc
        return self._handles[rank]

    def keys(self, rank: int) -> set[str]:
        return set(self._open(rank).keys())

    def file(self, rank: int) -> Path:
        """The file of ``rank``'s shards."""
        return self._files[rank]

    def shape(self, rank: int, key: str) -> list[int]:
        """The shape ``rank``'s file gives ``key`` (read from its header)."""
        try:
            return list(self._open(rank).get_slice(key).get_shape())
        except Exception as exc:
            raise CheckpointError(f"{self._files[rank]}: cannot read {key} ({exc})") from exc

    def layer_keys(self) -> set[str]:
        """The tensors of every rank's file (a rank whose shard of a layer had no segment
        of some optimizer, or owned no whole parameter, lacks their keys)."""
        return set().union(*(self.keys(rank) for rank in range(self.world)))

    def _holder(self, key: str) -> int:
        for rank in range(self.world):
            if key in self.keys(rank):
                return rank
        raise CheckpointError(f"{self._files[0].parent}: no shard file holds {key}")

    def scalar(self, key: str) -> torch.Tensor:
        """A scalar state tensor, from the first rank's file that holds it (every rank
        that holds one holds the same value)."""
        return self.whole(key)

    def whole(self, key: str) -> torch.Tensor:
        """The tensor ``key`` of the first rank's file that holds it, whole."""
        rank = self._holder(key)
        try:
            return self._open(rank).get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{self._files[rank]}: cannot read {key} ({exc})") from exc

    def flat_range(self, key: str, old_shard: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flat buffer that ``key``'s shards make up.

        Elements beyond the saved buffer (padding of a larger world size) are zero.
        Memory: the result plus one shard's slice at a time; the result is not
        zero-filled where the files cover it, so its pages are touched only as
        the slices land.
        """
        out = torch.empty(end - start, dtype=torch.float32)
        saved = self.world * old_shard  # the saved flat buffer's padded length
        out[max(0, saved - start) :].zero_()
        if old_shard == 0:
            return out
        for q in range(start // old_shard, min(self.world, -(-end // old_shard))):
            lo, hi = max(start, q * old_shard), min(end, (q + 1) * old_shard)
            if lo >= hi:
                continue
            try:
                piece = self._open(q).get_slice(key)[lo - q * old_shard : hi - q * old_shard]
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{self._files[q]}: cannot read {key} ({exc})") from exc
            if piece.numel() != hi - lo:
                raise CheckpointError(f"{self._files[q]}: {key} is truncated")
            out[lo - start : hi - start] = piece
            del piece  # not alive while the next slice is read
        return out
