"""Catching a read of a sharded parameter outside any gather (module mode).

[Note: released reads]
Between its unit's gathers a parameter's ``.data`` is an empty tensor (see
``ParameterGatherer``). Code that reads a parameter without calling its module (a fused
cross-entropy reading ``lm_head.weight``, weights tied by hand, a custom kernel) would
get that empty tensor and fail far from the cause (``size mismatch, got input (12), mat
(12x32), vec (0)``). While a module-mode forward runs, :class:`ReleasedReadCheck` (a
``TorchFunctionMode`` on the model thread, whose modes are per thread) looks at the
top-level arguments of every torch call: an ``nn.Parameter`` with no elements whose unit
is not gathered raises :class:`~zero3_offload.errors.StateError` naming the parameter and
``manager.gathered`` as the fix. Reading a released parameter's metadata (dtype, device,
``requires_grad``: transformers reads them) is allowed. The check costs a type test per
argument of every torch call, on top of the mode's dispatch to Python (about 3-4 us a
call on a 2-core CPU machine; a tiny Llama's training forward makes ~350 calls).

Forward passes only: the autograd engine runs a backward's nodes (a checkpointed block
recomputed among them) without the calling thread's torch-function modes. A block that
runs again in the backward ran in the forward first, where a missing gather was caught.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zero3_offload.errors import StateError

__all__ = ["ReleasedReadCheck"]

_PROPERTIES = (
    "data",
    "device",
    "dtype",
    "grad",
    "grad_fn",
    "is_cuda",
    "is_leaf",
    "is_meta",
    "is_sparse",
    "layout",
    "nbytes",
    "ndim",
    "itemsize",
    "requires_grad",
    "shape",
    "_version",
)
_METHODS = (
    "__format__",
    "__hash__",
    "__repr__",
    "data_ptr",
    "dim",
    "element_size",
    "get_device",
    "is_complex",
    "is_contiguous",
    "is_floating_point",
    "numel",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "requires_grad_",
    "size",
    "storage_offset",
    "stride",
    "untyped_storage",
)


def _metadata() -> frozenset[Any]:
    """The torch functions that read a tensor's metadata, not its values."""
    found: set[Any] = set()
    for name in _PROPERTIES:
        prop = getattr(torch.Tensor, name)
        for accessor in ("__get__", "__set__"):
            if hasattr(prop, accessor):
                found.add(getattr(prop, accessor))
    found.update(getattr(torch.Tensor, name) for name in _METHODS)
    return frozenset(found)


_METADATA = _metadata()


class ReleasedReadCheck(TorchFunctionMode):
    """Raises when a torch call reads a released parameter of a unit that is not gathered.

    See [Note: released reads].

    Args:
        names: ``id(parameter)`` -> its name in the model (``lm_head.weight``).
        units: ``id(parameter)`` -> the unit it belongs to.
        is_gathered: whether a unit's parameters hold their values now.
    """

    def __init__(
        self,
        *,
        names: Mapping[int, str],
        units: Mapping[int, str],
        is_gathered: Callable[[str], bool],
    ) -> None:
        super().__init__()
        self._names = names
        self._units = units
        self._is_gathered = is_gathered

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # The common case first and cheap: no argument is an empty parameter.
        for arg in args:
            if type(arg) is nn.Parameter and arg.numel() == 0 and func not in _METADATA:
                self._check(arg)
        if not kwargs:
            return func(*args)
        for arg in kwargs.values():
            if type(arg) is nn.Parameter and arg.numel() == 0 and func not in _METADATA:
                self._check(arg)
        return func(*args, **kwargs)

    def _check(self, param: nn.Parameter) -> None:
        unit = self._units.get(id(param))
        if unit is None or self._is_gathered(unit):
            return
        name = self._names.get(id(param), "a parameter")
        module = name.rpartition(".")[0] or name
        raise StateError(
            f"{name} was read while sharded: it was read without its module being called, "
            "so ZeRO-3 did not gather it (a released parameter holds an empty tensor). "
            f"Read it inside `with manager.gathered(model.{module}):` (or pass the "
            "parameter itself to manager.gathered)"
        )
