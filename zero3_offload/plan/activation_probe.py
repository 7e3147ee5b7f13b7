"""``LayerActivations``: what one decoder layer saves for backward, measured.

A one-layer copy of the model (its config with ``num_hidden_layers=1`` and a vocabulary
of 8 tokens; the run's LoRA adapters and frozen globs applied) runs a real forward on
the CPU in the compute dtype at three short sequence lengths. Every tensor autograd
saves inside the decoder layer is counted once per storage (``saved_tensors_hooks``),
parameters left out, and so are the outputs of the matrix products a selectively
checkpointed layer keeps (the rule of ``execution.product_saving``) and what the
layer's ``mlp`` saves. A quadratic through the three points gives the bytes at any
length: linear for attention kernels that save O(T) (SDPA, flash), quadratic for eager
attention's [T, T] weights.
"""

from __future__ import annotations

import copy
import fnmatch
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zero3_offload.errors import ConfigError
from zero3_offload.execution.product_saving import saves_product
from zero3_offload.integrations.require import require_transformers
from zero3_offload.train.freeze import freeze_parameters

__all__ = ["LayerActivations", "probe_layer"]

_PROBE_VOCAB = 8
_POINTS = 3


@attrs.frozen
class Quadratic:
    """Bytes as ``a + b*T + c*T**2`` of a sequence's ``T`` tokens."""

    a: float
    b: float
    c: float

    def at(self, tokens: int) -> int:
        return max(0, round(self.a + self.b * tokens + self.c * tokens * tokens))

    @classmethod
    def through(cls, points: list[tuple[int, int]]) -> Quadratic:
        (x0, y0), (x1, y1), (x2, y2) = points
        # Divided differences: exact for the three points.
        d01 = (y1 - y0) / (x1 - x0)
        d12 = (y2 - y1) / (x2 - x1)
        c = (d12 - d01) / (x2 - x0)
        b = d01 - c * (x0 + x1)
        return cls(a=y0 - b * x0 - c * x0 * x0, b=b, c=c)


@attrs.frozen(kw_only=True)
class LayerActivations:
    """One decoder layer's saved bytes for one sequence of T tokens (batch 1)."""

    saved: Quadratic  # everything the layer saves without checkpointing
    products: Quadratic  # the outputs a selectively checkpointed layer saves
    mlp: Quadratic  # what its ``mlp`` saves (all of it goes with a tiled MLP)
    temporaries: Quadratic  # what its forward allocates and frees again (not saved)
    hidden_bytes_per_token: int  # one token's hidden state in the compute dtype


class _Products(TorchDispatchMode):
    """Counts the bytes of the product outputs a selective layer would save, and of every
    op's output (what the layer's forward allocates)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.allocated = 0
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active:
            if saves_product(func, args):
                self.bytes += out.numel() * out.element_size()
            outs = out if isinstance(out, (tuple, list)) else (out,)
            fresh = [t for t in outs if isinstance(t, torch.Tensor) and not _is_view(func)]
            self.allocated += sum(t.numel() * t.element_size() for t in fresh)
        return out


def _is_view(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema and any(r.alias_info is not None for r in schema.returns))


@contextmanager
def _inside(module: nn.Module, flags: dict[str, bool], key: str) -> Iterator[None]:
    def enter(*_: Any) -> None:
        flags[key] = True

    def leave(*_: Any) -> None:
        flags[key] = False

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _one_layer_model(
    directory: str | os.PathLike[str], dtype: torch.dtype, peft_config: Any, freeze: Any
) -> tuple[nn.Module, nn.Module, int]:
    transformers = require_transformers()
    config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    config.num_hidden_layers = 1
    config.vocab_size = _PROBE_VOCAB
    for name in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the count
        value = getattr(config, name, None)
        if isinstance(value, list) and value:
            setattr(config, name, value[:1])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(peft_config))
    if freeze is not None:
        # Only the globs that name a parameter of this one layer (others name layers
        # the probe does not have).
        names = [name for name, _ in model.named_parameters()]
        here = [p for p in freeze if any(fnmatch.fnmatchcase(n, p) for n in names)]
        if here:
            freeze_parameters(model, here)
    layers = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    if not layers:
        raise ConfigError(f"{type(model).__name__}: no decoder layer to measure")
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    return model, layers[0], positions


def probe_layer(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    peft_config: Any = None,
    freeze: Any = None,
    tokens: int = 32,
) -> LayerActivations:
    """Measure one decoder layer of the model in ``directory`` (see the module docstring).

    Raises:
        ConfigError: transformers missing, or a model without decoder layers.
    """
    model, layer, positions = _one_layer_model(directory, dtype, peft_config, freeze)
    mlp = getattr(layer, "mlp", None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    lengths = [tokens * 2**i for i in range(_POINTS)]
    if positions and lengths[-1] > positions:
        lengths = [max(4, positions // 4 * 2**i // 2) for i in range(_POINTS)]
    points: dict[str, list[tuple[int, int]]] = {
        "saved": [],
        "products": [],
        "mlp": [],
        "temporaries": [],
    }
    for length in lengths:
        flags = {"layer": False, "mlp": False}
        seen: dict[str, dict[int, int]] = {"saved": {}, "mlp": {}}

        def pack(t: torch.Tensor, flags: dict[str, bool] = flags, seen: dict = seen) -> Any:
            storage = t.untyped_storage()
            if flags["layer"] and storage.data_ptr() not in params:
                seen["saved"][storage.data_ptr()] = storage.nbytes()
                if flags["mlp"]:
                    seen["mlp"][storage.data_ptr()] = storage.nbytes()
            return t

        products = _Products()
        ids = torch.randint(0, _PROBE_VOCAB, (1, length))
        with (
            _inside(layer, flags, "layer"),
            _inside(mlp, flags, "mlp") if mlp is not None else contextmanager(lambda: iter([0]))(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            products.active = True
            with products:
                _run(model, layer, ids, products)
        points["saved"].append((length, sum(seen["saved"].values())))
        points["mlp"].append((length, sum(seen["mlp"].values())))
        points["products"].append((length, products.bytes))
        temporaries = products.allocated - sum(seen["saved"].values())
        points["temporaries"].append((length, max(temporaries, 0)))
    hidden = int(getattr(model.config, "hidden_size", 0) or 0)
    item = torch.empty((), dtype=dtype).element_size()
    return LayerActivations(
        saved=Quadratic.through(points["saved"]),
        products=Quadratic.through(points["products"]),
        mlp=Quadratic.through(points["mlp"]),
        temporaries=Quadratic.through(points["temporaries"]),
        hidden_bytes_per_token=hidden * item,
    )


def _run(model: nn.Module, layer: nn.Module, ids: torch.Tensor, products: _Products) -> None:
    def enter(*_: Any) -> None:
        products.active = True

    def leave(*_: Any) -> None:
        products.active = False

    products.active = False

    def trained_input(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # A layer past the first gets hidden states that carry a gradient (from the
        # layers before it); the probe's only layer must see the same.
        enter()
        if args:
            return (args[0].detach().requires_grad_(), *args[1:]), kwargs
        hidden = kwargs["hidden_states"].detach().requires_grad_()
        return args, {**kwargs, "hidden_states": hidden}

    handles = [
        layer.register_forward_pre_hook(trained_input, with_kwargs=True),
        layer.register_forward_hook(leave),
    ]
    try:
        with torch.enable_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
