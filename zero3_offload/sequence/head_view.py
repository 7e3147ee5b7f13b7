"""An attention module as the attention function sees it on one rank of a sequence group."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["HeadView"]


class HeadView:
    """``module`` with ``num_key_value_groups`` of this rank's heads; every other attribute
    is the module's.

    When the key/value heads are replicated over the group (fewer of them than ranks),
    each rank holds one key/value head for its heads/S query heads, so the attention
    function must repeat it heads/S times, not heads/key-value-heads times.
    """

    def __init__(self, module: nn.Module, *, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
