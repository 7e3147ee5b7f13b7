"""The API fuzz's model of the manager: which calls must succeed, which must be refused
and with which error, and what each successful call does to the step state.

The rules are the documented ones (the manager's docstrings, docs/architecture.md):
arguments are checked before anything changes, calls out of order raise
``StateError``, a bad learning rate ``ConfigError``, a bad tensor ``InputError``,
a layer that raises on its input ``LayerExecutionError`` (exactly when plain
PyTorch raises on that input). When a call breaks several rules, the error of any
one of them is accepted (the order of the checks is not part of the contract).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import torch
from fuzz_calls import MODELS, build_model, make_input

__all__ = ["GRAD_KINDS", "Expect", "ModelState", "plain_forward_error"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def plain_forward_error(kind: str, x_kind: str, order: tuple[str, ...], dtype: str) -> bool:
    """Whether plain PyTorch raises running ``order`` of model ``kind`` on such an input,
    cast as the manager casts it (floating inputs to the compute dtype). The manager
    must then raise ``LayerExecutionError``, and run otherwise: an empty batch, NaN and
    inf run in PyTorch, so they run here too (and train to NaN)."""
    model = build_model(kind, 0, 0.0)
    layers = model if isinstance(model, dict) else dict(model.named_children())
    x = make_input(kind, x_kind, 0, 0)
    if x.is_floating_point():
        x = x.to(_DTYPES[dtype])
    try:
        with torch.no_grad():
            for name in order:
                x = layers[name].to(_DTYPES[dtype])(x)
    except Exception:  # what the layer's own code raises on this input
        return True
    return False


# What a backward does with each kind of output gradient, given a pending forward
# with the same layer names (None: it runs).
GRAD_OUTCOMES: dict[str, str | None] = {
    "good": None,
    "zeros": None,
    "nan": None,  # values: they run, and the step trains to NaN (fp16 skips it)
    "inf": None,
    "float64": None,  # cast to the compute dtype
    "int": None,  # cast, as plain autograd casts it
    "complex": "InputError",
    "wrong_shape": "InputError",
    "scalar": "InputError",  # a shape mismatch too
    "meta": "InputError",
    "not_tensor": "InputError",
}
GRAD_KINDS = tuple(GRAD_OUTCOMES)

# Special layer_names values (anything else is a tuple of layer names).
LAYERS_STR = "<str>"  # a single name as a str, not a sequence
LAYERS_NONE = "<none>"
LAYERS_EMPTY = "<empty>"
LAYERS_UNKNOWN = "<unknown>"  # a valid order plus a name that is no layer
UNKNOWN_LAYER = "no_such_layer"


def layer_names_arg(choice: Any, spec_layers: tuple[str, ...], order: tuple[str, ...]) -> Any:
    """The ``layer_names`` argument a layer choice stands for."""
    if choice == LAYERS_STR:
        return spec_layers[0]
    if choice == LAYERS_NONE:
        return None
    if choice == LAYERS_EMPTY:
        return ()
    if choice == LAYERS_UNKNOWN:
        return (*order, UNKNOWN_LAYER)
    return tuple(choice)


def valid_lr(lr: Any) -> bool:
    return (
        not isinstance(lr, bool) and isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0
    )


@attrs.frozen
class Expect:
    """What a call must do: succeed (``errors`` empty) or raise one of ``errors``."""

    errors: frozenset[str] = frozenset()

    @property
    def succeeds(self) -> bool:
        return not self.errors


def _refused(*names: str) -> Expect:
    return Expect(frozenset(names))


@attrs.define
class ModelState:
    """What the driver knows of the manager's state between calls (one example's run)."""

    model: str
    dtype: str  # compute_dtype
    k: int  # gradient_accumulation_steps
    early_allowed: bool  # overlap_computation, and speculative_step or no clipping/fp16
    closed: bool = False
    pending: tuple[str, ...] | None = None  # layer names of the kept training forward
    early_lr: float | None = None  # updates of the window already ran with this lr
    calls: int = 0  # optimizer_step calls in the open window
    micro: int = 0  # backward passes since the last update
    saved: dict[int, tuple[int, int]] = attrs.Factory(dict)  # checkpoint -> (calls, micro)

    @classmethod
    def from_config(cls, model: str, config: dict[str, Any]) -> ModelState:
        return cls(
            model=model,
            dtype=config["compute_dtype"],
            k=config["gradient_accumulation_steps"],
            early_allowed=config["overlap_computation"]
            and (
                config.get("speculative_step", False)
                or (config["gradient_clipping"] == 0 and config["compute_dtype"] != "float16")
            ),
        )

    # ------------------------------------------------------------ expectations

    def _names_error(self, layers: Any) -> str | None:
        if layers is None or isinstance(layers, str):
            return "InputError"
        if not layers:
            return "InputError"
        if any(n not in MODELS[self.model].layers for n in layers):
            return "LayerNotFoundError"
        return None

    def forward(self, x: str, layers: Any) -> Expect:
        if self.closed:
            return _refused("StateError")
        refused = {e for e in (self._names_error(layers),) if e}
        if x in ("meta", "not_tensor"):
            refused.add("InputError")
        if refused:
            return Expect(frozenset(refused))
        if plain_forward_error(self.model, x, tuple(layers), self.dtype):
            return _refused("LayerExecutionError")
        return Expect()

    def backward(self, grad: str, layers: Any, lr: Any) -> Expect:
        if self.closed:
            return _refused("StateError")
        refused = set()
        names_error = self._names_error(layers)
        if names_error:
            refused.add(names_error)
        elif self.pending is None or tuple(layers) != self.pending:
            refused.add("StateError")
        if GRAD_OUTCOMES[grad]:
            refused.add(GRAD_OUTCOMES[grad])
        if lr is not None and not valid_lr(lr):
            refused.add("ConfigError")
        if self.early_lr is not None:  # its updates ran: optimizer_step must come first
            refused.add("StateError")
        return Expect(frozenset(refused))

    def step(self, lr: Any) -> Expect:
        if self.closed:
            return _refused("StateError")
        refused = set()
        if not valid_lr(lr):
            refused.add("ConfigError")
        if self.micro <= self.calls:
            refused.add("StateError")
        if self.early_lr is not None and valid_lr(lr) and float(lr) != self.early_lr:
            refused.add("ConfigError")
        return Expect(frozenset(refused))

    def step_updates(self) -> bool:
        """Whether a successful optimizer_step now closes the window (updates)."""
        return self.calls + 1 == self.k

    def save(self) -> Expect:
        if self.closed or self.early_lr is not None:
            return _refused("StateError")
        return Expect()

    def load(self, index: int) -> Expect:
        if self.closed:
            return _refused("StateError")
        return Expect() if index in self.saved else _refused("CheckpointError")

    def plain(self) -> Expect:
        """reset, adapt, force, state_dict: refused only once closed."""
        return _refused("StateError") if self.closed else Expect()

    # ---------------------------------------------------------------- effects

    def did_forward(self, layers: Any, training: bool) -> None:
        # An evaluation forward keeps nothing: a kept training forward is dropped too.
        self.pending = tuple(layers) if training else None

    def did_backward(self, layers: Any, lr: Any) -> None:
        self.pending = None
        self.micro += 1
        early = (
            lr is not None
            and self.early_allowed
            and self.calls == self.k - 1
            and len(set(layers)) == len(layers)
        )
        self.early_lr = float(lr) if early else None

    def did_step(self) -> None:
        self.calls += 1
        if self.calls == self.k:
            self.calls = self.micro = 0
            self.early_lr = None

    def did_save(self, index: int) -> None:
        self.saved[index] = (self.calls, self.micro)

    def did_load(self, index: int) -> None:
        self.calls, self.micro = self.saved[index]
        self.pending = None
        self.early_lr = None

    def did_reset(self) -> None:
        self.calls = self.micro = 0
        self.pending = None
        self.early_lr = None

    def did_close(self) -> None:
        # close() forgets the step state; the gradient store keeps its count.
        self.closed = True
        self.calls = 0
        self.pending = None
        self.early_lr = None

    def counters(self) -> dict[str, str]:
        """The fingerprint entries this model predicts (see fuzz_rank.fingerprint)."""
        return {
            "calls_since_update": str(self.calls),
            "micro_steps": str(self.micro),
            "early_lr": "None" if self.early_lr is None else self.early_lr.hex(),
            "closed": str(self.closed),
        }
