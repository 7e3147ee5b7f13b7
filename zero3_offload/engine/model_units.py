"""Which parts of a model are its units in module mode (see [Note: module mode]).

A unit is a submodule whose parameters are sharded, gathered and released
together (a decoder layer, typically); the *root unit* holds every other
parameter (a final norm, say) and every parameter that more than one unit
uses, such as an embedding tied to the LM head. By default a transformers
model's units are its ``_no_split_modules`` and, when they are not tied to
each other, its input and output embeddings: the largest tensors of most
language models, which the forward needs only at its two ends, so neither is
held gathered through the whole pass. A tied parameter is
one tensor and one slot in one unit, so both uses add into one gradient, once.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from zero3_offload.errors import InputError
from zero3_offload.parameter.flat_layout import ROOT_UNIT
from zero3_offload.parameter.unit_params import UnitParams

__all__ = ["ROOT_UNIT", "default_unit_classes", "embedding_modules", "split_units"]

UnitSpec = str | type[nn.Module]


def default_unit_classes(model: nn.Module) -> tuple[str, ...]:
    """Class names listed in a transformers model's ``_no_split_modules`` (empty otherwise).

    A wrapper that exposes the model it wraps through ``get_base_model()`` (a peft
    model) is looked through: its units are those of the base model.
    """
    names = getattr(model, "_no_split_modules", None)
    base = getattr(model, "get_base_model", None)
    if not names and callable(base):
        inner = base()
        if isinstance(inner, nn.Module) and inner is not model:
            return default_unit_classes(inner)
    return tuple(str(n) for n in names or ())


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    """A transformers model's input and output embeddings (through a peft wrapper).

    Empty when they share a parameter (tied weights belong to the root unit)
    or the model has neither.
    """
    base = getattr(model, "get_base_model", None)
    inner = base() if callable(base) else model
    found: list[nn.Module] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(inner, getter, None)
        try:
            module = get() if callable(get) else None
        except NotImplementedError:  # transformers' default for models without one
            module = None
        if isinstance(module, nn.Module) and next(module.parameters(), None) is not None:
            found.append(module)
    if len(found) == 2:
        first = {id(p) for p in found[0].parameters()}
        if found[0] is found[1] or any(id(p) in first for p in found[1].parameters()):
            return []
    return found


def _choose(model: nn.Module, units: Sequence[UnitSpec] | None) -> dict[str, nn.Module]:
    extra: set[int] = set()
    if units is None:
        classes = default_unit_classes(model)
        if not classes:
            raise InputError(
                f"{type(model).__name__} names no units: pass units=[submodule names or "
                "module classes] (transformers models default to their _no_split_modules)"
            )
        specs: list[UnitSpec] = list(classes)
        by_class_name = True
        extra = {id(m) for m in embedding_modules(model)}
    else:
        if isinstance(units, (str, type)) or not isinstance(units, Sequence) or not units:
            raise InputError(
                "units must be a non-empty list of submodule names or nn.Module classes, "
                f"got {units!r}"
            )
        specs = list(units)
        by_class_name = False
    names = {s for s in specs if isinstance(s, str)} if not by_class_name else set()
    classes = tuple(s for s in specs if isinstance(s, type))
    class_names = set(specs) if by_class_name else set()
    bad = [s for s in specs if not isinstance(s, (str, type))]
    if bad:
        raise InputError(f"units entries must be submodule names or nn.Module classes: {bad}")
    modules = dict(model.named_modules())
    missing = sorted(n for n in names if n not in modules or n == "")
    if missing:
        raise InputError(f"units {missing} are not submodules of {type(model).__name__}")
    chosen: dict[str, nn.Module] = {}
    for path, module in modules.items():
        if not path:
            continue
        inside = next((u for u in chosen if path.startswith(u + ".")), None)
        wanted = (
            path in names
            or (classes and isinstance(module, classes))
            or type(module).__name__ in class_names
            or id(module) in extra
        )
        if not wanted:
            continue
        if inside is not None:
            if path in names:
                raise InputError(f"unit {path!r} is inside unit {inside!r}: units may not nest")
            continue  # a class match inside a chosen unit belongs to that unit
        chosen[path] = module
    if not chosen:
        raise InputError(f"no submodule of {type(model).__name__} matches units {specs}")
    return chosen


def split_units(
    model: nn.Module, units: Sequence[UnitSpec] | None = None
) -> tuple[dict[str, UnitParams], dict[str, nn.Module]]:
    """The units of ``model``: their parameters, and the submodule of each non-root unit.

    Args:
        model: the whole model.
        units: submodule names or module classes; None takes the class names in
            a transformers model's ``_no_split_modules``.

    Returns:
        ``(params, modules)``: unit name -> its :class:`UnitParams` (the root
        unit, named ``ROOT_UNIT``, first when it has parameters), and unit name
        -> its submodule for every non-root unit, in the model's order.

    Raises:
        InputError: when no submodule matches, units nest, or a name is unknown.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be an nn.Module, got {type(model).__name__}")
    chosen = _choose(model, units)

    def unit_of(name: str) -> str:
        return next((u for u in chosen if name.startswith(u + ".")), ROOT_UNIT)

    # Every place a parameter is registered, tied copies included: a parameter
    # registered under one unit only belongs to it, anything else to the root.
    places: dict[int, set[str]] = {}
    for full, param in model.named_parameters(remove_duplicate=False):
        places.setdefault(id(param), set()).add(unit_of(full))
    unit_params: dict[str, list[tuple[str, nn.Parameter]]] = {path: [] for path in chosen}
    root: list[tuple[str, nn.Parameter]] = []
    for full, param in model.named_parameters():
        (unit,) = places[id(param)] if len(places[id(param)]) == 1 else (ROOT_UNIT,)
        if unit == ROOT_UNIT:
            root.append((full, param))
        else:
            unit_params[unit].append((full.removeprefix(unit + "."), param))
    owners: dict[str, list[tuple[str, nn.Module]]] = {path: [] for path in chosen}
    root_owners: list[tuple[str, nn.Module]] = []
    in_root = {id(p) for _, p in root}
    for path, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        unit = unit_of(path + ".")
        if unit != ROOT_UNIT and any(id(p) not in in_root for p in own):
            owners[unit].append((path, module))
        if unit == ROOT_UNIT or any(id(p) in in_root for p in own):
            root_owners.append((path, module))
    out: dict[str, UnitParams] = {}
    if root:
        out[ROOT_UNIT] = UnitParams(root, root_owners)
    for path in chosen:
        out[path] = UnitParams(unit_params[path], owners[path])
    return out, chosen
