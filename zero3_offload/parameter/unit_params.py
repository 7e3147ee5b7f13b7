"""The parameters of one unit of a model run in module mode: a view over modules' own parameters.

In module mode (see [Note: module mode] in ``execution.module_runner``) a unit
is either a submodule (e.g. a decoder layer) or the *root unit*: every
parameter of the model outside the other units, plus parameters shared by
several units. A unit is sharded, gathered and released as one flat buffer
exactly like a chain layer; :class:`UnitParams` gives the gatherer, the
layout and the reducer the ``named_parameters()`` they need, without being a
module itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

__all__ = ["UnitParams"]


class UnitParams:
    """The parameters of one unit, in a fixed order, each under one name.

    Args:
        params: ``(name, parameter)`` in layout order; names are relative to
            the unit's module (the full name for the root unit).
        owners: ``(path, module)`` of every module owning one of the
            parameters (materialised and initialised together on meta models).
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        owners: Sequence[tuple[str, nn.Module]],
    ) -> None:
        self._params = tuple(params)
        self._owners = tuple(owners)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` in layout order."""
        return iter(self._params)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self._params)

    def owners(self) -> tuple[tuple[str, nn.Module], ...]:
        """``(path, module)`` of the modules that own these parameters."""
        return self._owners

    def __len__(self) -> int:
        return len(self._params)
