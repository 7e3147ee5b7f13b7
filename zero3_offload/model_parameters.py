"""Description of a model's parameters: names, shapes, dtypes, element and byte counts.

Mirrors ``ModelParameters`` of the Rust ``config.rs``, with one difference: bytes
come from each parameter's real dtype rather than a fixed 4 bytes per element.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import attrs
import torch

from zero3_offload.errors import ConfigError

__all__ = ["ModelParameterStats", "ModelParameters"]


@attrs.frozen(kw_only=True)
class ModelParameterStats:
    """Summary of parameter sizes (in elements); every field is 0 for an empty model."""

    total_parameters: int = 0
    """Number of parameter tensors."""
    total_elements: int = 0
    """Sum of the tensors' element counts."""
    mean_parameter_size: float = 0.0
    """Mean element count per tensor."""
    median_parameter_size: float = 0.0
    """Median element count per tensor (mean of the two middle ones for an even count)."""
    min_parameter_size: int = 0
    """Smallest tensor's element count."""
    max_parameter_size: int = 0
    """Largest tensor's element count."""
    total_memory_bytes: int = 0
    """Sum of the tensors' sizes in bytes."""


def _shape_of(name: str, shape: Iterable[int]) -> tuple[int, ...]:
    dims = tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ConfigError(
            f"shape={dims!r} of parameter {name!r} is invalid: dimensions must be integers >= 0"
        )
    return dims


@attrs.define(kw_only=True)
class ModelParameters:
    """Name → shape/dtype description of a model's parameters, with running totals.

    Change it only through :meth:`add_parameter` so the totals stay consistent.
    """

    parameter_names: list[str] = attrs.field(factory=list)
    """Parameter names in insertion order (``named_parameters()`` order for modules)."""
    parameter_shapes: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    """Shape of each parameter."""
    parameter_dtypes: dict[str, torch.dtype] = attrs.field(factory=dict)
    """Dtype of each parameter."""
    parameter_count: int = 0
    """Total number of elements over all parameters."""
    total_memory_bytes: int = 0
    """Total bytes over all parameters (numel × element size of each)."""

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ModelParameters:
        """Describe ``module``'s parameters as ``module.named_parameters()`` lists them.

        Shared (tied) parameters are counted once; meta tensors are counted from
        their shape and dtype like any other.

        Args:
            module: the model.

        Returns:
            A new description whose byte total is the sum of ``numel × element_size``.
        """
        params = cls()
        for name, param in module.named_parameters():
            params.add_parameter(name, param.shape, param.dtype)
        return params

    def add_parameter(
        self, name: str, shape: Iterable[int], dtype: torch.dtype = torch.float32
    ) -> None:
        """Add a parameter.

        Args:
            name: unique parameter name.
            shape: its dimensions (a tuple, list or ``torch.Size``).
            dtype: its dtype; its element size gives the byte count.

        Raises:
            ConfigError: ``name`` is already present, or ``shape`` has a bad dimension.
        """
        if name in self.parameter_shapes:
            raise ConfigError(
                f"parameter name {name!r} is already present: each parameter must be added once"
            )
        dims = _shape_of(name, shape)
        self.parameter_names.append(name)
        self.parameter_shapes[name] = dims
        self.parameter_dtypes[name] = dtype
        self.parameter_count += math.prod(dims)
        self.total_memory_bytes += math.prod(dims) * dtype.itemsize

    def has_parameter(self, name: str) -> bool:
        """Return True when a parameter called ``name`` has been added."""
        return name in self.parameter_shapes

    def _require(self, name: str) -> tuple[int, ...]:
        try:
            return self.parameter_shapes[name]
        except KeyError:
            raise KeyError(
                f"no parameter named {name!r}; known parameters: {self.parameter_names}"
            ) from None

    def get_parameter_shape(self, name: str) -> tuple[int, ...]:
        """Return the shape of parameter ``name``.

        Raises:
            KeyError: no parameter has that name.
        """
        return self._require(name)

    def get_parameter_size(self, name: str) -> int:
        """Return the number of elements of parameter ``name``.

        Raises:
            KeyError: no parameter has that name.
        """
        return math.prod(self._require(name))

    def get_parameter_bytes(self, name: str) -> int:
        """Return the size in bytes of parameter ``name``.

        Raises:
            KeyError: no parameter has that name.
        """
        return self.get_parameter_size(name) * self.parameter_dtypes[name].itemsize

    def total_parameters(self) -> int:
        """Return the number of parameter tensors."""
        return len(self.parameter_names)

    def memory_usage_mb(self) -> float:
        """Return the total size in MiB (2**20 bytes)."""
        return self.total_memory_bytes / 2**20

    def get_statistics(self) -> ModelParameterStats:
        """Return a summary of parameter sizes (all zeros when there are none)."""
        sizes = [math.prod(self.parameter_shapes[n]) for n in self.parameter_names]
        if not sizes:
            return ModelParameterStats()
        return ModelParameterStats(
            total_parameters=len(sizes),
            total_elements=sum(sizes),
            mean_parameter_size=sum(sizes) / len(sizes),
            median_parameter_size=float(statistics.median(sizes)),
            min_parameter_size=min(sizes),
            max_parameter_size=max(sizes),
            total_memory_bytes=self.total_memory_bytes,
        )
