"""Which slice of each flat, padded layer buffer a rank owns.

See [Note: flat layout] in ``parameter.flat_layout``: a layer's flat buffer is
padded to a multiple of ``world_size`` and rank ``r`` owns the contiguous slice
``[r*S, (r+1)*S)``.
"""

from __future__ import annotations

import attrs

from zero3_offload.config import fail, int_rule
from zero3_offload.errors import ConfigError

__all__ = ["Zero3RankMapping"]


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name}={value!r} is invalid: must be an integer >= 0")


@attrs.frozen
class Zero3RankMapping:
    """This rank's place in the data-parallel group, and the slices it owns.

    Raises:
        ConfigError: for a rank outside ``[0, world_size)`` or a negative count.
    """

    rank: int = attrs.field(validator=int_rule(0))
    """This process's rank in the data-parallel group."""
    world_size: int = attrs.field(validator=int_rule(1))
    """Number of ranks in the data-parallel group."""

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            fail("rank", self.rank, f"must be in [0, world_size={self.world_size})")

    def padded_numel(self, numel: int) -> int:
        """Return ``numel`` rounded up to a multiple of ``world_size`` (0 stays 0)."""
        _check_count("numel", numel)
        return -(-numel // self.world_size) * self.world_size

    def shard_numel(self, numel: int) -> int:
        """Return the elements each rank holds of a flat buffer of ``numel`` elements."""
        return self.padded_numel(numel) // self.world_size

    def shard_bounds(self, numel: int) -> tuple[int, int]:
        """Return this rank's ``[start, end)`` in the padded flat buffer of ``numel`` elements."""
        size = self.shard_numel(numel)
        return self.rank * size, (self.rank + 1) * size
