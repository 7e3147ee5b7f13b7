"""``LayerActivations``: what one decoder layer saves for backward, measured.

A one-layer copy of the model (its config with ``num_hidden_layers=1`` and a vocabulary
of 8 tokens; the run's LoRA adapters and frozen globs applied) runs a real forward on
the CPU in the compute dtype at three short sequence lengths. Every tensor autograd
saves inside the decoder layer is counted once per storage (``saved_tensors_hooks``),
parameters left out, and so are the outputs of the matrix products a selectively
checkpointed layer keeps (the rule of ``execution.product_saving``) and what the
layer's ``mlp`` saves. A quadratic through the three points gives the bytes at any
length: linear for attention kernels that save O(T) (SDPA, flash), quadratic for eager
attention's [T, T] weights. The layer's backward runs too (from a gradient of ones on
its output), and each new tensor of the forward and of the backward gets its own
quadratic: the planner sums those at or above the mmap threshold of a training process
(new memory each, see ``plan.calibration``'s fresh-memory figure).

The same one-layer model's training step (forward, backward) is timed on two lengths (up
to 1,024 tokens or 2e10 FLOPs, and a quarter of that) with a rank's threads, its minor
page faults counted: the planner draws a line through the two (seconds against FLOPs: a
fixed cost per layer and step, and this model's FLOP/s; see ``planner._StepTime``).
Gradients are let go as they are computed, so the probe never holds a second copy of the
layer.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import resource
import time
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
# A timed step's FLOPs at most (6 per parameter and token), within these tokens: steps
# long enough that the line drawn through them barely moves from one process to the next
# (the compute term of one plan: 7.6-11.9 s over four runs with 4e9 and 256, 9.4-9.8 s).
_TIMED_FLOPS = 2e10
_MIN_TIMED, _MAX_TIMED = 16, 1024
_TIMED_TRIES = 5
_WARM_S = 0.2  # warm-up steps for at least this long (2 to _TIMED_TRIES of them)


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
    forward_outputs: tuple[Quadratic, ...]  # each new tensor its forward makes, in order
    backward_outputs: tuple[Quadratic, ...]  # the same for its backward
    layer_params: int  # the decoder layer's parameters (adapters included)
    step_tokens: tuple[int, int]  # the timed training steps' tokens (two lengths)
    step_seconds: tuple[float, float]  # the one-layer model's step on them (best of a few)
    step_faulted_bytes: tuple[int, int]  # the pages each step faulted in, in bytes

    def large_outputs(self, tokens: int, threshold: int) -> tuple[int, int]:
        """Bytes of the tensors of ``threshold`` bytes or more that the layer's forward
        and its backward make for a sequence of ``tokens`` tokens: each a new memory
        mapping when the C heap serves blocks that large with mmap."""
        return (
            sum(n for q in self.forward_outputs if (n := q.at(tokens)) >= threshold),
            sum(n for q in self.backward_outputs if (n := q.at(tokens)) >= threshold),
        )


class _Products(TorchDispatchMode):
    """Counts the bytes of the product outputs a selective layer would save, and of every
    op's output (what the layer's forward allocates), and lists each new output's bytes
    in order, per pass (``forward``, ``backward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.allocated = 0
        self.active = False
        self.outputs: dict[str, list[int]] = {"forward": [], "backward": []}
        self.backward = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active or self.backward:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            fresh = [t for t in outs if isinstance(t, torch.Tensor) and not _is_view(func)]
            sizes = [t.numel() * t.element_size() for t in fresh]
            self.outputs["backward" if self.backward else "forward"].extend(sizes)
            if self.active:
                if saves_product(func, args):
                    self.bytes += out.numel() * out.element_size()
                self.allocated += sum(sizes)
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
    threads: int = 1,
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
    outputs: dict[str, list[list[int]]] = {"forward": [], "backward": []}
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
        for name, sizes in products.outputs.items():
            outputs[name].append(sizes)
        points["saved"].append((length, sum(seen["saved"].values())))
        points["mlp"].append((length, sum(seen["mlp"].values())))
        points["products"].append((length, products.bytes))
        temporaries = products.allocated - sum(seen["saved"].values())
        points["temporaries"].append((length, max(temporaries, 0)))
    hidden = int(getattr(model.config, "hidden_size", 0) or 0)
    item = torch.empty((), dtype=dtype).element_size()
    layer_params = sum(p.numel() for p in layer.parameters())
    step_tokens = max(_MIN_TIMED, min(_MAX_TIMED, int(_TIMED_FLOPS / (6 * max(layer_params, 1)))))
    if positions:
        step_tokens = min(step_tokens, positions)
    timed_lengths = (step_tokens // 4, step_tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timed = [_step_seconds(model, layer, n) for n in timed_lengths]
    finally:
        torch.set_num_threads(before)
    return LayerActivations(
        saved=Quadratic.through(points["saved"]),
        products=Quadratic.through(points["products"]),
        mlp=Quadratic.through(points["mlp"]),
        temporaries=Quadratic.through(points["temporaries"]),
        hidden_bytes_per_token=hidden * item,
        forward_outputs=_each(lengths, outputs["forward"]),
        backward_outputs=_each(lengths, outputs["backward"]),
        layer_params=layer_params,
        step_tokens=timed_lengths,
        step_seconds=(timed[0][0], timed[1][0]),
        step_faulted_bytes=(timed[0][1], timed[1][1]),
    )


def _each(lengths: list[int], sizes: list[list[int]]) -> tuple[Quadratic, ...]:
    """One quadratic per tensor when every length made the same tensors in the same
    order, else one for their sum."""
    if len({len(s) for s in sizes}) == 1:
        columns = zip(*sizes, strict=True)
        return tuple(Quadratic.through(list(zip(lengths, c, strict=True))) for c in columns)
    return (Quadratic.through([(n, sum(s)) for n, s in zip(lengths, sizes, strict=True)]),)


def _step_seconds(model: nn.Module, layer: nn.Module, tokens: int) -> tuple[float, int]:
    """Seconds of a training step (forward, backward) of the one-layer model on
    ``tokens`` tokens, its layer's input carrying a gradient as a middle layer's does
    (the best of a few after a warm-up), and the bytes of the pages that step faulted in
    (the process's minor faults)."""
    ids = torch.randint(0, _PROBE_VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    handles = [layer.register_forward_pre_hook(_trained_input, with_kwargs=True)]
    handles += _dropping_gradients(model)

    def step() -> None:
        with torch.enable_grad():
            out = model(input_ids=ids, use_cache=False).logits
            out.float().sum().backward()

    try:
        warm = time.perf_counter()
        for done in range(_TIMED_TRIES):  # warm up: thread pools, the heap, the caches
            step()
            if done and time.perf_counter() - warm > _WARM_S:
                break
        best = (float("inf"), 0)
        for _ in range(_TIMED_TRIES):
            faults = _minor_faults()
            start = time.perf_counter()
            step()
            best = min(best, (time.perf_counter() - start, _minor_faults() - faults))
    finally:
        for handle in handles:
            handle.remove()
    return best[0], best[1] * resource.getpagesize()


def _dropping_gradients(model: nn.Module) -> list[Any]:
    """Hooks that let each parameter's gradient go as soon as it is computed: the probe
    holds one gradient at a time, not a second copy of the layer."""

    def drop(param: torch.Tensor) -> None:
        param.grad = None

    return [
        p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad
    ]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _trained_input(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A layer past the first gets hidden states that carry a gradient (from the layers
    before it); the probe's only layer must see the same."""
    if args:
        return (args[0].detach().requires_grad_(), *args[1:]), kwargs
    hidden = kwargs["hidden_states"].detach().requires_grad_()
    return args, {**kwargs, "hidden_states": hidden}


def _run(model: nn.Module, layer: nn.Module, ids: torch.Tensor, products: _Products) -> None:
    """The layer's forward under ``products``, then its backward alone (from a gradient
    of ones on its output)."""
    outputs: list[torch.Tensor] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        products.active = True
        return _trained_input(module, args, kwargs)

    def leave(_: nn.Module, __: Any, out: Any) -> None:
        products.active = False
        outputs.append(out[0] if isinstance(out, (tuple, list)) else out)

    products.active = False
    handles = [
        layer.register_forward_pre_hook(enter, with_kwargs=True),
        layer.register_forward_hook(leave),
        *_dropping_gradients(model),
    ]
    try:
        with torch.enable_grad():
            model(input_ids=ids, use_cache=False)
        out = outputs[0]
        grad = torch.ones_like(out)
        products.backward = True
        torch.autograd.backward(out, grad)
    finally:
        products.backward = False
        for handle in handles:
            handle.remove()
