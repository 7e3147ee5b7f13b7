"""Building a transformers causal LM from a local directory, with parameters on the meta device.

[Note: parameters on meta, buffers real]
Building a model under ``torch.device("meta")`` puts buffers on meta too, and
buffers computed in constructors (e.g. rotary ``inv_freq``) would then have to be
recomputed by hand. :func:`parameters_on_meta` instead replaces, while active, each
parameter that a module registers by a meta twin (same class, shape, dtype,
``requires_grad`` and attributes), as accelerate's
``init_empty_weights(include_buffers=False)`` does, so buffers keep their real
values. A parameter registered again (weight tying by assignment, as transformers'
``tie_weights`` does) keeps its twin: a meta parameter is registered unchanged and a
real one registered twice gets the same twin, so tied parameters stay one object.
Each real parameter is allocated (uninitialised) and freed right after: one at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zero3_offload.errors import CheckpointError, ConfigError, InputError
from zero3_offload.integrations.require import require_transformers
from zero3_offload.logging import get_logger

__all__ = ["build_model_from_directory", "parameters_on_meta"]

_log = get_logger(__name__)


def _meta_twin(param: nn.Parameter) -> nn.Parameter:
    twin = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    twin.__dict__.update(param.__dict__)
    return twin


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, parameters that modules register live on the meta device; buffers
    stay real. See [Note: parameters on meta, buffers real].

    Patches ``nn.Module.register_parameter`` for every thread while active, and restores
    it on exit, also when the body raises. Contexts nest.
    """
    original = nn.Module.register_parameter
    twins = WeakIdKeyDictionary()  # real parameter -> its meta twin, while it lives

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if isinstance(param, nn.Parameter) and not param.is_meta:
            twin = twins.get(param)
            if twin is None:
                twin = twins[param] = _meta_twin(param)
            param = twin
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_model_from_directory(
    directory: str | os.PathLike[str],
    *,
    on_meta: bool,
    torch_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build the causal LM that a local transformers model directory's ``config.json``
    describes, without loading its weights.

    Reads the config with ``AutoConfig.from_pretrained`` (local files only, no remote
    code) and builds ``AutoModelForCausalLM.from_config`` with the given dtype.

    Args:
        directory: a directory holding ``config.json``, as written by ``save_pretrained``.
        on_meta: build under :func:`parameters_on_meta`: parameters on the meta device
            (no values), buffers real. Otherwise parameters are allocated and initialised
            by transformers.
        torch_dtype: dtype of the floating-point parameters.

    Returns:
        The model, tied weights tied (one parameter object per tied group).

    Raises:
        ConfigError: when transformers is not installed, or cannot build a causal LM
            from the config.
        CheckpointError: when ``config.json`` is missing or unreadable.
        InputError: when ``torch_dtype`` is not a ``torch.dtype``.
    """
    if not isinstance(torch_dtype, torch.dtype):
        raise InputError(f"torch_dtype must be a torch.dtype, got {torch_dtype!r}")
    transformers = require_transformers()
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (expected a transformers model directory)")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}/config.json: cannot read the model config ({exc})") from exc
    # transformers >= 4.56 names the argument (and the config field) ``dtype``; older,
    # ``torch_dtype``, which later versions accept with a deprecation warning.
    dtype_kwarg = "dtype" if hasattr(config, "dtype") else "torch_dtype"
    with parameters_on_meta() if on_meta else contextlib.nullcontext():
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, **{dtype_kwarg: torch_dtype}
            )
        except ValueError as exc:  # e.g. no causal-LM class for the config's model type
            raise ConfigError(
                f"{path}/config.json: cannot build a causal LM from this config ({exc})"
            ) from exc
    _log.debug(
        "built model from directory",
        directory=str(path),
        model=type(model).__name__,
        on_meta=on_meta,
    )
    return model
