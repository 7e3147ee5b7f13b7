"""Fixtures whose body runs in every rank process (``@rank_fixture``).

In the pytest process such a fixture's value is only a :class:`RankSide`
token naming the function; each rank of a ``@pytest.mark.ranks`` test calls the
function itself, with its own arguments resolved there: ``rank`` (the
:class:`~zero3_offload.testing.run_ranks.RankContext`), other rank fixtures, and
any ordinary fixture or parameter, whose value the pytest process sends.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from zero3_offload.testing.code_location import CodeLocation

__all__ = ["RankSide", "rank_fixture", "rank_function"]

_F = TypeVar("_F", bound=Callable[..., Any])

# The functions decorated in this process, by (file, qualified name): how a rank
# finds the function again once it has imported the module that defines it.
_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {}


@attrs.frozen
class RankSide:
    """The pytest process's value of a rank fixture: what a rank calls instead.

    ``location`` is None for the ``rank`` fixture itself (the rank's context).
    """

    name: str
    location: CodeLocation | None
    argnames: tuple[str, ...]


def rank_function(location: CodeLocation) -> Callable[..., Any]:
    """The undecorated function of the rank fixture at ``location`` (imported here)."""
    key = (location.path, location.qualname)
    if key not in _FUNCTIONS:
        location.load_module()
    try:
        return _FUNCTIONS[key]
    except KeyError:
        raise LookupError(
            f"no @rank_fixture {location.qualname} in {location.path} in this rank process"
        ) from None


def rank_fixture(fn: _F | None = None, *, name: str | None = None) -> Any:
    """Declare a pytest fixture whose body runs in each rank, not in the pytest process.

    Use it where a value cannot be sent to a rank (a model bound to the rank's
    group, an open file) or should be built once per rank. The function may be
    a plain function, a coroutine function, or a (async) generator whose code
    after ``yield`` runs in the rank after the test, also when it failed::

        @rank_fixture
        async def manager(rank: RankContext):
            async with Zero3CpuOffloadManager(config, rank.group, make_model()) as m:
                yield m

    Its arguments are resolved in the rank: ``rank``, other rank fixtures, and
    ordinary fixtures and parameters (sent from the pytest process, so they
    must pickle). It is function-scoped, and only ``@pytest.mark.ranks`` tests
    may use it.
    """
    if fn is None:
        return lambda f: rank_fixture(f, name=name)
    import pytest

    if inspect.ismethod(fn) or "." in fn.__qualname__.replace("<locals>.", ""):
        raise TypeError(f"@rank_fixture {fn.__qualname__}: define it at module level")
    location = CodeLocation.of(fn)
    _FUNCTIONS[(location.path, location.qualname)] = fn
    signature = inspect.signature(fn)
    argnames = tuple(
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    fixture_name = name or fn.__name__

    def token(**_values: Any) -> RankSide:
        return RankSide(name=fixture_name, location=location, argnames=argnames)

    token.__name__ = fn.__name__
    token.__qualname__ = fn.__qualname__
    token.__module__ = fn.__module__
    token.__doc__ = fn.__doc__
    # pytest reads the arguments to resolve from the signature.
    token.__signature__ = signature.replace(return_annotation=inspect.Signature.empty)  # type: ignore[attr-defined]
    return pytest.fixture(name=fixture_name)(token)
