"""Which partitions and which slice of each flat, padded layer buffer a rank owns.

:class:`Zero3RankMapping` is re-exported by :mod:`zero3_offload.config`; this module
must not import ``config`` (``config`` imports it).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from zero3_offload._validation import _fail, _int_rule, _is_int

__all__ = ["Zero3RankMapping"]


def _check_index(name: str, value: int) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 0")


@attrs.frozen
class Zero3RankMapping:
    """Which partitions and which slice of each flat padded buffer a rank owns.

    Partition methods mirror the Rust round-robin mapping; ``padded_numel``,
    ``shard_numel`` and ``shard_bounds`` give the contiguous slice ``[r*S, (r+1)*S)``
    the data layout uses. Every method raises ``ValueError`` for a negative index/count.
    """

    rank: int = attrs.field(validator=_int_rule(0))
    """This process's rank in the data-parallel group."""
    world_size: int = attrs.field(validator=_int_rule(1))
    """Number of ranks in the data-parallel group."""

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            _fail("rank", self.rank, f"must be in [0, world_size={self.world_size})")

    def owns_partition(self, index: int) -> bool:
        """Return True when partition ``index`` is owned by this rank (round robin)."""
        _check_index("index", index)
        return index % self.world_size == self.rank

    def get_parameter_owner(self, index: int) -> int:
        """Return the rank owning partition ``index``."""
        _check_index("index", index)
        return index % self.world_size

    def owned_partitions(self, total: int) -> list[int]:
        """Return the global indices, ascending, of this rank's partitions among ``total``."""
        _check_index("total", total)
        return list(range(self.rank, total, self.world_size))

    def owned_partition_count(self, total: int) -> int:
        """Return how many of ``total`` partitions this rank owns."""
        _check_index("total", total)
        return len(range(self.rank, total, self.world_size))

    def global_to_local_partition(self, index: int) -> int | None:
        """Return the local index of global partition ``index``, or None if not owned."""
        return index // self.world_size if self.owns_partition(index) else None

    def local_to_global_partition(self, local_index: int) -> int:
        """Return the global index of this rank's ``local_index``-th partition."""
        _check_index("local_index", local_index)
        return local_index * self.world_size + self.rank

    def communication_group(self, indices: Iterable[int]) -> list[int]:
        """Return the sorted, unique ranks owning any of the partitions ``indices``."""
        return sorted({self.get_parameter_owner(i) for i in indices})

    def padded_numel(self, numel: int) -> int:
        """Return ``numel`` rounded up to a multiple of ``world_size`` (0 stays 0)."""
        _check_index("numel", numel)
        return -(-numel // self.world_size) * self.world_size

    def shard_numel(self, numel: int) -> int:
        """Return the elements each rank holds of a flat buffer of ``numel`` elements."""
        return self.padded_numel(numel) // self.world_size

    def shard_bounds(self, numel: int) -> tuple[int, int]:
        """Return this rank's ``[start, end)`` in the padded flat buffer of ``numel`` elements."""
        size = self.shard_numel(numel)
        return self.rank * size, (self.rank + 1) * size
