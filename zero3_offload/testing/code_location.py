"""Where a test or fixture function lives, and how a rank process finds it again.

A rank process imports a test module (and a ``conftest.py``) from its file, as
pytest did in the parent: with pytest's assertion rewriting when pytest rewrote
it there, so a failing ``assert`` in a rank is explained as it would be in the
parent. Modules pytest did not rewrite (a plugin, a package) are imported by name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

__all__ = ["CodeLocation"]

# Modules loaded from their files in this process, by absolute path.
_LOADED: dict[str, ModuleType] = {}


@attrs.frozen
class CodeLocation:
    """A function (or class attribute) by module, file and qualified name."""

    module: str
    path: str
    qualname: str
    rewritten: bool

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> CodeLocation:
        """Where ``fn`` (a module-level function) is defined."""
        return cls(
            module=fn.__module__,
            path=os.path.realpath(fn.__code__.co_filename),
            qualname=fn.__qualname__,
            rewritten="@py_builtins" in fn.__globals__,
        )

    def load_module(self) -> ModuleType:
        """The module, imported in this process if it was not yet."""
        if not self.rewritten:
            return importlib.import_module(self.module)
        module = _LOADED.get(self.path)
        if module is None:
            module = _import_rewritten(self.module, self.path)
            _LOADED[self.path] = module
        return module

    def resolve(self) -> Any:
        """The object the location names (its module imported first)."""
        obj: Any = self.load_module()
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _import_rewritten(name: str, path: str) -> ModuleType:
    """Import ``path`` as module ``name`` with pytest's assertion rewriting."""
    import ast

    from _pytest.assertion.rewrite import rewrite_asserts

    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    source = Path(path).read_bytes()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    code = compile(tree, path, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs (as an import does), so that what it defines
    # unpickles by name; a module of that name imported before keeps its place.
    registered = sys.modules.setdefault(name, module) is module
    try:
        exec(code, module.__dict__)
    except BaseException:
        if registered:
            del sys.modules[name]
        raise
    return module
