"""``--freeze PATTERN``: parameters of ``--model`` that training leaves unchanged.

``PATTERN`` is a comma-separated list of shell-style globs matched against the whole
names of the model's ``named_parameters()`` (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``; tied parameters under
their first name), case-sensitively, with :func:`fnmatch.fnmatchcase`: ``*`` matches
any run of characters, dots included, ``?`` one character, ``[01]`` one of a set.
A parameter matching any glob is frozen (``requires_grad=False`` before the manager
is built; see docs/fine_tuning.md). Every glob must match at least one parameter.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from zero3_offload.errors import ConfigError

__all__ = ["freeze_parameters", "freeze_patterns"]


def freeze_patterns(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """The globs of a ``--freeze`` string (comma-separated) or a ``--config`` list.

    Raises:
        ConfigError: ``freeze=... is invalid`` for an empty glob or a value of another type.
    """
    if value is None:
        return None
    if isinstance(value, str):
        globs = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        globs = [v.strip() for v in value]
    else:
        raise ConfigError(f"freeze={value!r} is invalid: give globs, e.g. 'model.embed_tokens.*'")
    if not globs or not all(globs):
        raise ConfigError(
            f"freeze={value!r} is invalid: an empty pattern (two commas, or one at an end)"
        )
    return tuple(globs)


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of ``model`` whose name matches one
    of ``patterns``; the names frozen, in ``named_parameters()`` order.

    Raises:
        ConfigError: ``--freeze`` naming a pattern that matches no parameter (with some
            of the names there are), or patterns that leave nothing to train.
    """
    named = dict(model.named_parameters())
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in named):
            shown = ", ".join(list(named)[:4])
            raise ConfigError(
                f"--freeze {pattern!r} matches no parameter of the model (names are like "
                f"{shown}; a glob matches the whole name: '*' for any run of characters)"
            )
    frozen = [n for n in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if len(frozen) == len(named):
        raise ConfigError(
            f"--freeze {','.join(patterns)} freezes every parameter: nothing to train"
        )
    for name in frozen:
        named[name].requires_grad_(False)
    return frozen
