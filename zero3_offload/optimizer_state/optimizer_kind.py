"""A torch optimizer class with its options, probed once: how it can run on shards.

[Note: optimizer kinds]
Any ``torch.optim.Optimizer`` subclass can be named (``OptimizerConfig.kind``, or a
parameter group's ``"optimizer"``). How it runs is decided by what it is, never by a
guess from its name alone:

* **Element-wise** optimizers (Adam, AdamW, SGD, RMSprop, Adagrad, Adamax, NAdam,
  RAdam, Adadelta, Rprop, ASGD, ...) update every element from that element's own
  gradient and state, so they run on the flat shards, each rank on its own slice.
  This is *probed*, not assumed: a 6x7 tensor is stepped three times whole, and the
  same values split into three 1-D pieces of unequal length are stepped with the same
  gradients. The results must agree (relative 1e-5), every state tensor must have
  the parameter's shape or none (a 0-dim scalar such as ``step``), and the pieces'
  scalar state must agree. An optimizer that reduces over a tensor (a norm, a mean,
  a trust ratio) fails the probe and is refused, naming the reason.
* **Shape-aware** optimizers need each parameter whole: ``torch.optim.Adafactor``
  (factored second moments over rows and columns, and the parameter's RMS in the step
  size, also for vectors) and ``torch.optim.Muon`` (Newton-Schulz orthogonalisation
  of 2-D matrices), and their subclasses. Their parameters are updated whole at one
  owning rank (see [Note: owned parameters] in ``optimizer_state.owned_params``).
* **Refused**: ``LBFGS`` (its step calls a closure that re-evaluates the loss, and its
  line search reduces over every parameter) and ``SparseAdam`` (sparse gradients
  only; ZeRO-3 reduces dense gradient shards), and anything whose probe fails.

The kernel: ``fused=True`` where the constructor takes ``fused`` and torch has the
kernel for the device (probed), else ``foreach=True`` where it takes ``foreach``;
``OptimizerConfig.fused`` False skips the fused kernel, True requires it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from zero3_offload.config import optimizer_label
from zero3_offload.errors import ConfigError

__all__ = ["OptimizerKind", "probe_kind"]

_SHAPE_AWARE = (torch.optim.Adafactor, torch.optim.Muon)
_REFUSED = {
    torch.optim.LBFGS: "its step calls a closure that re-evaluates the loss, and its line "
    "search reduces over every parameter, which the ranks' shards cannot give it",
    torch.optim.SparseAdam: "it takes sparse gradients only, and ZeRO-3 reduces dense "
    "gradient shards",
}
_PROBE_SHAPE = (6, 7)
_PROBE_PIECES = ((0, 5), (5, 23), (23, 42))
_PROBE_STEPS = 3
_PROBE_LR = 1e-2
# Distinct dimensions of the probe that maps a shape-aware state's shape onto a parameter's.
_DIMS = (5, 7, 11, 13, 17, 19)


def _takes(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


@attrs.frozen(eq=False)
class OptimizerKind:
    """One torch optimizer class with its constructor options, as probed on a device."""

    cls: type[torch.optim.Optimizer]
    options: Mapping[str, Any]  # constructor arguments (not lr, not the kernel flags)
    label: str  # e.g. "torch.optim.RMSprop"
    shape_aware: bool  # needs each parameter whole (see [Note: optimizer kinds])
    full_keys: tuple[str, ...]  # element-wise: the state tensors of the parameter's shape
    scalar_keys: tuple[str, ...]  # element-wise: the 0-dim state tensors (e.g. "step")
    scalar_sizes: tuple[int, ...]  # bytes of each of them
    kernel: Mapping[str, bool]  # {"fused": True}, {"foreach": True} or {}
    device: torch.device

    @property
    def scalar_bytes(self) -> int:
        """Bytes of one parameter's scalar state tensors."""
        return sum(self.scalar_sizes)

    def make(self, groups: Sequence[dict[str, Any]] | Sequence[torch.Tensor]) -> Any:
        """The torch optimizer over ``groups`` (its learning rates are set at each step)."""
        return self.cls(groups, lr=0.0, **self.options, **self.kernel)

    def state_bytes(self, shape: torch.Size) -> int:
        """Bytes of the state a shape-aware optimizer keeps for a parameter of ``shape``
        (fp32): the state of a probe whose dimensions are distinct, each state dimension
        mapped onto the parameter's dimension it equals."""
        probe_shape = _DIMS[: len(shape)]
        param = torch.zeros(probe_shape)
        param.grad = torch.randn(probe_shape, generator=torch.Generator().manual_seed(0))
        opt = self.cls([param], lr=_PROBE_LR, **self.options)
        opt.step()
        total = 0
        for value in opt.state[param].values():
            if not torch.is_tensor(value):
                continue
            numel = 1
            for dim in value.shape:
                if dim in probe_shape:
                    numel *= shape[probe_shape.index(dim)]
                elif dim != 1:
                    numel *= dim
            total += numel * value.element_size()
        return total

    def scalar_trace(self, overrides: Mapping[str, Any], lr_scale: float) -> tuple[float, ...]:
        """The scalar state after each probe step of a group with ``overrides`` and
        ``lr_scale``: groups of one layer must agree on it (they share the layer's
        scalars; see [Note: segmented shards] in ``optimizer_state.segmented_shard``)."""
        param = torch.zeros(7, device=self.device)
        opt = self.make([{"params": [param], **overrides}])
        opt.param_groups[0]["lr"] = _PROBE_LR * lr_scale
        gen = torch.Generator().manual_seed(1)
        trace: list[float] = []
        for _ in range(_PROBE_STEPS):
            param.grad = torch.randn(7, generator=gen).to(self.device)
            opt.step()
            state = opt.state[param]
            trace += [float(state[k]) for k in self.scalar_keys if k in state]
        return tuple(trace)


_CACHE: dict[tuple[Any, ...], OptimizerKind] = {}


def probe_kind(
    cls: type[torch.optim.Optimizer],
    options: Mapping[str, Any],
    *,
    device: torch.device,
    fused: bool | None,
) -> OptimizerKind:
    """``cls`` with ``options``, classified and given its kernel (see [Note: optimizer
    kinds]); cached per class, options, device and ``fused``.

    Raises:
        ConfigError: for a refused optimizer or one whose probe fails, naming the reason;
            for ``fused=True`` where torch has no fused kernel of ``cls`` for the device.
    """
    key = (cls, repr(sorted(options.items())), str(device), fused)
    if key not in _CACHE:
        _CACHE[key] = _probe(cls, dict(options), device, fused)
    return _CACHE[key]


def _probe(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    device: torch.device,
    fused: bool | None,
) -> OptimizerKind:
    label = optimizer_label(cls)
    for refused, reason in _REFUSED.items():
        if issubclass(cls, refused):
            raise ConfigError(f"optimizer {label} is not supported: {reason}")
    if issubclass(cls, _SHAPE_AWARE):
        kernel = {"foreach": True} if _takes(cls, "foreach") else {}
        kind = OptimizerKind(cls, options, label, True, (), (), (), kernel, device)
        _run(kind, lambda: kind.make([torch.zeros(_PROBE_SHAPE, device=device)]), label)
        return kind
    kernel = _kernel(cls, options, device, fused, label)
    full, scalars, sizes = _check_elementwise(cls, options, kernel, device, label)
    return OptimizerKind(cls, options, label, False, full, scalars, sizes, kernel, device)


def _run(kind: OptimizerKind, fn: Any, label: str) -> Any:
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError, KeyError, NotImplementedError) as exc:
        raise ConfigError(
            f"optimizer {label} with options {dict(kind.options)} failed on a probe: {exc}"
        ) from exc


def _step_probe(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    opt.step()


def _kernel(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    device: torch.device,
    fused: bool | None,
    label: str,
) -> dict[str, bool]:
    if fused is not False and _takes(cls, "fused"):
        probe = torch.zeros(3, device=device)
        try:
            _step_probe(cls([probe], lr=0.0, **options, fused=True), [probe], [probe.clone()])
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            # Capability probe: no fused kernel for this optimizer/device; foreach is used.
            pass
        else:
            return {"fused": True}
    if fused:
        raise ConfigError(
            f"optimizer.fused=True is invalid here: torch has no fused {label} kernel "
            f"for {device.type}; set fused=None or False"
        )
    return {"foreach": True} if _takes(cls, "foreach") else {}


def _check_elementwise(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    kernel: dict[str, bool],
    device: torch.device,
    label: str,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """Step a tensor whole and in pieces; the full-size and scalar state keys and the
    scalars' bytes, or ConfigError when the optimizer is not element-wise."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(_PROBE_SHAPE, generator=gen)
    grads = [torch.randn(_PROBE_SHAPE, generator=gen) for _ in range(_PROBE_STEPS)]
    whole = start.clone().to(device)
    pieces = [start.view(-1)[a:b].clone().to(device) for a, b in _PROBE_PIECES]
    probe = OptimizerKind(cls, options, label, False, (), (), (), kernel, device)
    opt_whole = _run(probe, lambda: cls([whole], lr=_PROBE_LR, **options, **kernel), label)
    opt_pieces = _run(probe, lambda: cls(pieces, lr=_PROBE_LR, **options, **kernel), label)
    for grad in grads:
        g = grad.to(device)
        _run(probe, lambda g=g: _step_probe(opt_whole, [whole], [g]), label)
        split = [g.view(-1)[a:b] for a, b in _PROBE_PIECES]
        _run(probe, lambda split=split: _step_probe(opt_pieces, pieces, split), label)
    joined = torch.cat([p.detach().cpu() for p in pieces])
    if not torch.allclose(whole.detach().cpu().view(-1), joined, rtol=1e-5, atol=1e-7):
        raise ConfigError(
            f"optimizer {label} is not supported: it is not element-wise (a tensor updated "
            "in pieces differs from the tensor updated whole, so it reduces over the "
            "tensor), and only torch.optim.Adafactor and torch.optim.Muon are run on whole "
            "parameters"
        )
    full: list[str] = []
    scalars: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for piece in pieces:
        for key, value in opt_pieces.state[piece].items():
            if not torch.is_tensor(value):
                continue
            if value.dim() == 0:
                if key in scalars and scalars[key] != float(value):
                    raise ConfigError(
                        f"optimizer {label} is not supported: its scalar state {key!r} "
                        "differs between tensors stepped together"
                    )
                sizes[key] = value.element_size()
                scalars[key] = float(value)
            elif value.shape == piece.shape:
                if key not in full:
                    full.append(key)
            else:
                raise ConfigError(
                    f"optimizer {label} is not supported: its state {key!r} has shape "
                    f"{tuple(value.shape)} for a parameter of shape {tuple(piece.shape)} "
                    "(not element-wise)"
                )
    return tuple(full), tuple(scalars), tuple(sizes[k] for k in scalars)
