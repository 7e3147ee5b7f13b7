"""What the API fuzz's driver and its rank processes exchange: models, setups, calls, outcomes.

The driver (``fuzz_machine``, where hypothesis runs) sends the same :class:`Call`
to every rank (SPMD: a bad input is bad on every rank alike); each rank runs it
on its manager (``fuzz_rank``) and answers with an :class:`Outcome`. Everything
here pickles, and is small: tensors never cross, only their digests.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from helpers import SEQ, VOCAB, TinyGPT
from torch import nn

__all__ = [
    "MODELS",
    "X_KINDS",
    "Call",
    "ModelSpec",
    "Outcome",
    "Setup",
    "build_model",
    "input_shape",
    "layer_numels",
    "make_input",
    "vocab",
    "with_first",
]


@attrs.frozen
class ModelSpec:
    """A small model the fuzz trains, and which inputs and layer orders it takes."""

    layers: tuple[str, ...]
    token_input: bool  # token ids (an embedding first) or float features
    batch: int  # rows of one rank's micro-batch
    orders: tuple[tuple[str, ...], ...]  # layer sequences a good input runs through
    bad_orders: tuple[tuple[str, ...], ...]  # sequences a good input cannot run through


_MLP_WIDTH = 8

MODELS: dict[str, ModelSpec] = {
    # TinyGPT from helpers: embed (token + position), 2 blocks, final norm, head.
    "gpt": ModelSpec(
        layers=("embed", "block0", "block1", "ln_f", "head"),
        token_input=True,
        batch=2,
        orders=(
            ("embed", "block0", "block1", "ln_f", "head"),
            ("embed", "block0", "head"),
            ("embed", "block1", "block1", "ln_f", "head"),  # a layer used twice
            ("embed",),
        ),
        bad_orders=(("block0", "head"), ("head",)),  # token ids into a float layer
    ),
    # A mapping of layers, all width -> width, so any order is valid; two have no
    # parameters (act, drop).
    "mlp": ModelSpec(
        layers=("inp", "act", "norm", "drop", "out"),
        token_input=False,
        batch=3,
        orders=(
            ("inp", "act", "norm", "drop", "out"),
            ("out", "inp"),
            ("inp", "inp", "act"),  # a layer used twice
            ("act",),  # no parameters at all
            ("norm", "drop", "out"),
        ),
        bad_orders=(),
    ),
}


def build_model(kind: str, seed: int, dropout: float) -> nn.Module | dict[str, nn.Module]:
    """The model ``kind``, initialised from ``seed`` (every rank builds the same one)."""
    torch.manual_seed(seed)
    if kind == "gpt":
        return TinyGPT(d=16, heads=2, n_blocks=2, dropout=dropout)
    w = _MLP_WIDTH
    return {
        "inp": nn.Linear(w, w),
        "act": nn.GELU(),
        "norm": nn.LayerNorm(w),
        "drop": nn.Dropout(dropout),
        "out": nn.Linear(w, w),
    }


def layer_numels(kind: str) -> dict[str, int]:
    """Parameter elements of each layer of model ``kind``."""
    model = build_model(kind, 0, 0.0)
    layers = model.items() if isinstance(model, dict) else model.named_children()
    return {name: sum(p.numel() for p in module.parameters()) for name, module in layers}


def input_shape(kind: str, rows: int) -> tuple[int, ...]:
    """The shape of a good input of ``rows`` rows for model ``kind``."""
    return (rows, SEQ) if MODELS[kind].token_input else (rows, _MLP_WIDTH)


def vocab() -> int:
    return VOCAB


# Kinds of forward input (see make_input). Which of them a model refuses is what
# plain PyTorch does with them (fuzz_expect.plain_forward_error), but "meta" and
# "not_tensor", which the manager refuses itself.
X_KINDS = (
    "good",
    "empty",  # a batch of 0 rows
    "nan",  # a float copy with a NaN (token ids as floats for the GPT)
    "inf",
    "float64",
    "int32",
    "complex",
    "bad_value",  # a token id past the vocabulary; one feature too many
    "scalar",  # a 0-d tensor
    "meta",  # no data
    "not_tensor",  # a nested list
)


def with_first(t: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of ``t`` whose first element is ``value`` (when it has one)."""
    t = t.clone()
    if t.numel():
        t.view(-1)[0] = value
    return t


def make_input(kind: str, x_kind: str, seed: int, rank: int) -> Any:
    """Rank ``rank``'s forward input of kind ``x_kind`` for model ``kind``."""
    spec = MODELS[kind]
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    rows = 0 if x_kind == "empty" else spec.batch
    shape = input_shape(kind, rows)
    if spec.token_input:
        x = torch.randint(0, VOCAB, shape, generator=g)
    else:
        x = torch.randn(shape, generator=g)
    if x_kind in ("good", "empty"):
        return x
    if x_kind in ("nan", "inf"):
        return with_first(x.float(), math.nan if x_kind == "nan" else math.inf)
    if x_kind == "float64":
        return x.double()
    if x_kind == "int32":
        return x.int() if spec.token_input else (x * 10).int()
    if x_kind == "complex":
        return x.to(torch.complex64)
    if x_kind == "bad_value":
        if spec.token_input:
            return x + VOCAB
        return torch.randn((rows, shape[1] + 1), generator=g)
    if x_kind == "scalar":
        return x.reshape(-1)[0]
    if x_kind == "meta":
        return torch.empty(shape, dtype=x.dtype, device="meta")
    if x_kind == "not_tensor":
        return x.tolist()
    raise ValueError(f"unknown input kind {x_kind!r}")


@attrs.frozen
class Setup:
    """One example's run: the model, its seed and the manager's config (as a dict)."""

    model: str
    seed: int
    dropout: float
    config: dict[str, Any]  # Zero3CpuOffloadConfig.to_dict()
    directory: str  # checkpoints go under it (the fuzzed run and its replay apart)


@attrs.frozen
class Call:
    """One call of the public API, described so every rank can build its arguments.

    ``op`` is the manager's method (``forward``, ``backward``, ``step``, ``save``,
    ``load``, ``reset``, ``adapt``, ``force``, ``state_dict``, ``close``); ``args``
    names the inputs by kind (e.g. ``x="nan"``), the ranks build the tensors.
    """

    op: str
    args: dict[str, Any] = attrs.Factory(dict)

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"{self.op}({inner})"


@attrs.frozen
class Outcome:
    """What one rank saw of one call: its result or its error, and the state around it.

    ``before`` and ``after`` are the rank's training-state fingerprints (component
    name -> digest or counter, see ``fuzz_rank.fingerprint``).
    """

    ok: bool
    result: Any  # small and comparable: digests, bools, names (None for errors)
    error: str | None  # the exception's class name
    zero3: bool  # the exception is a Zero3Error
    message: str
    detail: str  # the traceback, for reports
    before: dict[str, str]
    after: dict[str, str]

    def changed(self) -> list[str]:
        """Fingerprint components that differ between before and after."""
        keys = sorted(set(self.before) | set(self.after))
        return [k for k in keys if self.before.get(k) != self.after.get(k)]
