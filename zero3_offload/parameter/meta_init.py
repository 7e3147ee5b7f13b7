"""Initial values: materialising meta layers, broadcasting rank 0's values, keeping shards.

[Note: meta initialisation]
A model built under ``torch.device("meta")`` has shapes but no storage. The
manager then materialises one layer at a time: ``to_empty`` on the CPU, the
layer's initialiser, flatten, broadcast rank 0's values, keep this rank's
shard, free the layer. No rank ever holds more than one full layer. The
default initialiser calls ``reset_parameters()`` of every submodule of the
layer, children before parents, in registration order; for modules that
initialise themselves in ``reset_parameters`` (``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm``, and custom modules that call it at the end of ``__init__``)
that draws the same random numbers in the same order as eager construction:
with the same seed the values are identical. Anything initialised elsewhere in a
constructor (custom parameters, computed buffers) needs an ``init_fn``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import InputError
from zero3_offload.parameter.flat_layout import LayerLayout
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.parameter.unit_params import UnitParams

__all__ = [
    "InitFn",
    "ShardSource",
    "reset_own_parameters",
    "reset_parameters_in_order",
    "shard_initial_values",
]


InitFn = Callable[[str, nn.Module], None]

ShardSource = Callable[[str, LayerLayout], torch.Tensor]
"""``source(layer, layout)`` -> this rank's fp32 shard of ``layer``, read from elsewhere
(e.g. pretrained weight files) instead of materialising and broadcasting the layer."""


def _post_order(path: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for child_name, child in module.named_children():
        yield from _post_order(f"{path}.{child_name}", child)
    yield path, module


def _check_resettable(name: str, module: nn.Module) -> None:
    for path, sub in _post_order(name, module):
        has_own = any(True for _ in sub.parameters(recurse=False))
        if has_own and not callable(getattr(sub, "reset_parameters", None)):
            raise InputError(
                f"{path} ({type(sub).__name__}) has parameters but no reset_parameters(): "
                "pass init_fn=... to initialise it after meta construction"
            )


def reset_parameters_in_order(name: str, module: nn.Module) -> None:
    """Default initialiser of a materialised layer. See [Note: meta initialisation].

    Calls ``reset_parameters()`` children first, then the parent, in
    registration order: the order in which a constructor that builds its
    children and then initialises its own parameters draws random numbers.

    Raises:
        InputError: when a submodule owns parameters but has no ``reset_parameters``.
    """
    _check_resettable(name, module)
    for _, sub in _post_order(name, module):
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


def _materialize(name: str, module: nn.Module | UnitParams, init_fn: InitFn) -> None:
    if isinstance(module, UnitParams):
        # Module mode: each module owning the unit's parameters, on its own.
        for path, owner in module.owners():
            if any(t.is_meta for t in owner.parameters(recurse=False)):
                owner.to_empty(device="cpu", recurse=False)
                with torch.no_grad():
                    init_fn(path, owner)
        return
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        module.to_empty(device="cpu")
        with torch.no_grad():
            init_fn(name, module)


def reset_own_parameters(path: str, module: nn.Module) -> None:
    """Module mode's default initialiser: ``module.reset_parameters()`` (its own parameters).

    Raises:
        InputError: when the module has no ``reset_parameters``.
    """
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise InputError(
            f"{path} ({type(module).__name__}) has parameters but no reset_parameters(): "
            "pass init_fn=... to initialise it after meta construction"
        )
    reset()


def _refuse_uninitialisable(layers: Mapping[str, nn.Module | UnitParams], init_fn: InitFn) -> None:
    """Raise before anything is materialised when a default initialiser cannot
    initialise a meta layer, so such a model is left as it was."""
    if init_fn is reset_parameters_in_order:
        for name, module in layers.items():
            if any(t.is_meta for t in module.parameters()):
                assert isinstance(module, nn.Module)
                _check_resettable(name, module)
    elif init_fn is reset_own_parameters:
        for module in layers.values():
            for path, owner in module.owners() if isinstance(module, UnitParams) else ():
                if any(t.is_meta for t in owner.parameters(recurse=False)) and not callable(
                    getattr(owner, "reset_parameters", None)
                ):
                    reset_own_parameters(path, owner)  # raises, naming the module


def shard_initial_values(
    *,
    layers: Mapping[str, nn.Module | UnitParams],
    layouts: Mapping[str, LayerLayout],
    store: ParameterStore,
    gatherer: ParameterGatherer,
    comm: Collectives,
    device: torch.device,
    init_fn: InitFn = reset_parameters_in_order,
    model: nn.Module | None = None,
    source: ShardSource | None = None,
) -> None:
    """Broadcast rank 0's parameters and buffers; keep only this rank's shards.

    Layers built on the meta device are materialised one at a time first (see
    [Note: meta initialisation]). Afterwards the modules hold no parameter
    storage and live on ``device``. In module mode (``model`` given, layers
    are units) the model's buffers are broadcast and moved once, at the end;
    a meta unit is initialised owner module by owner module, by default with
    :func:`reset_own_parameters`. With ``source``, each rank takes its shards
    from it: nothing is materialised or broadcast but the buffers.

    Raises:
        CommunicationError: when a broadcast fails.
        InputError: when a meta layer cannot be initialised.
    """
    if model is not None:
        if init_fn is reset_parameters_in_order:
            init_fn = reset_own_parameters
        meta = [n for n, b in model.named_buffers() if b.is_meta]
        if meta:
            raise InputError(
                f"buffers {meta[:5]} are on the meta device and cannot be initialised: build "
                "the model with only its parameters on meta (zero3_offload.integrations."
                "meta_model.parameters_on_meta()) or eagerly"
            )
    if source is None:  # with a source nothing is initialised here
        _refuse_uninitialisable(layers, init_fn)
    for name, module in layers.items():
        layout = layouts[name]
        frozen = layout.frozen
        if source is not None:
            store.put_master(name, source(name, layout).to(device))
            if frozen is not None:
                store.put_frozen(name, source(name, frozen))
            gatherer.release_views(name)
            continue
        _materialize(name, module, init_fn)
        for part in (layout, frozen):
            if part is None:
                continue
            flat = part.flatten(module, dtype=torch.float32).to(device)
            what = f"the initial values of {name!r}"
            comm.start_broadcast(flat, src=0, what=what).wait_blocking()
            shard = flat[part.shard_start : part.shard_end].clone()
            if part is layout:
                store.put_master(name, shard)
            else:
                store.put_frozen(name, shard)
            del flat
        if model is None:
            _broadcast_buffers(module, comm, device)
        gatherer.release_views(name)  # this layer's full values are not kept
    if model is not None:
        _broadcast_buffers(model, comm, device)
        model.to(device)
        return
    for module in layers.values():
        assert isinstance(module, nn.Module)
        module.to(device)


def _broadcast_buffers(module: nn.Module, comm: Collectives, device: torch.device) -> None:
    for name, buf in module.named_buffers():
        staged = buf.detach().to(device)
        comm.start_broadcast(staged, src=0, what=f"the buffer {name!r}").wait_blocking()
        buf.data = staged
