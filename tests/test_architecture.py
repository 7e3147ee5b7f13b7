"""The package's shape: the public face at the top, no import circle, a manager without mixins,
an engine that wires components only through their constructors, short manager methods."""

from __future__ import annotations

import ast
from pathlib import Path

import zero3_offload
from zero3_offload import Zero3CpuOffloadManager

PACKAGE = Path(zero3_offload.__file__).parent
TOP_LEVEL = {
    "__init__",
    "__main__",
    "cli",
    "config",
    "errors",
    "logging",
    "manager",
    "version",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, type-checking-only imports included.

    Importing ``a.b.c`` also runs package ``a.b``'s ``__init__`` first, so that
    edge counts too (the root package's is left out: it is above everything).
    """
    modules = {_module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                for k in range(2, len(parts) + 1):
                    name = ".".join(parts[:k])
                    own_package = module.startswith(name + ".")
                    if name in modules and name != module and not own_package:
                        graph[module].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a list of modules, first == last), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                return [*path[path.index(target) :], target]
            if target not in done:
                found = visit(target)
                if found:
                    return found
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk saw the whole package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_top_level_is_the_public_face() -> None:
    modules = {f.stem for f in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL
    packages = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}
    for role in ("comm", "parameter", "gradient", "optimizer_state", "memory", "prefetch"):
        assert role in packages
    assert {"stats", "checkpoint", "analyze", "train", "testing"} <= packages


def test_the_manager_is_one_class_without_mixins() -> None:
    assert Zero3CpuOffloadManager.__bases__ == (object,)
    for file in PACKAGE.rglob("*.py"):
        text = file.read_text()
        assert "self: Zero3CpuOffloadManager" not in text, file
        # The one mixin is public and not ours to split: Trainer subclasses take it as a base
        # (class MyTrainer(Zero3TrainerMixin, SFTTrainer)), docs/integrations.md.
        assert "Mixin" not in text.replace("Zero3TrainerMixin", ""), file


ENGINE = PACKAGE / "engine"


def writes_to_other_objects(source: str) -> list[str]:
    """Assignments to an attribute of another object than ``self`` (``comm.observer = ...``,
    ``a.b += 1``, ``x.y, z.w = ...``, ``setattr(x, ...)``), as ``line: code``.

    ``self.name = ...`` inside a method is the object setting its own field; anything
    else writes a component's field from outside, after it was built.
    """
    found: list[str] = []
    lines = source.splitlines()

    def visit(node: ast.AST, in_method: bool) -> None:
        for child in ast.iter_child_nodes(node):
            method = in_method or (
                isinstance(node, ast.ClassDef)
                and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = list(child.targets)
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            elif (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id in ("setattr", "delattr")
            ):
                found.append(f"{child.lineno}: {lines[child.lineno - 1].strip()}")
            for target in targets:
                parts = target.elts if isinstance(target, ast.Tuple) else [target]
                for part in parts:
                    if not isinstance(part, ast.Attribute):
                        continue
                    own = isinstance(part.value, ast.Name) and part.value.id == "self"
                    if not (own and method):
                        found.append(f"{child.lineno}: {lines[child.lineno - 1].strip()}")
            visit(child, method)

    visit(ast.parse(source), False)
    return found


def positional_construction(source: str) -> list[str]:
    """Calls of a class (a capitalised name, errors aside) with positional arguments."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name = node.func.id
        if name[:1].isupper() and not name.endswith("Error") and node.args:
            found.append(f"{node.lineno}: {name}")
    return found


def test_the_engine_wires_components_only_through_their_constructors() -> None:
    files = sorted(ENGINE.glob("*.py"))
    assert {f.name for f in files} >= {"engine.py", "step_state.py"}
    for file in files:
        assert writes_to_other_objects(file.read_text()) == [], file
    # build_engine names what each component receives: keyword arguments only.
    assert positional_construction((ENGINE / "engine.py").read_text()) == []


def test_the_wiring_check_finds_an_assignment_after_construction() -> None:
    source = (
        "def build(stats):\n"
        "    comm = Collectives(group)\n"
        "    comm.observer = stats.add_collective\n"
        "    prefetch.depth += 1\n"
        "    gatherer.pool_limit, x = 3, 4\n"
        "    setattr(params, 'on_put', None)\n"
        "class Component:\n"
        "    def __init__(self, other):\n"
        "        self.limit = 1\n"
        "        other.limit = 2\n"
    )
    assert [f.split(":")[0] for f in writes_to_other_objects(source)] == ["3", "4", "5", "6", "10"]


def public_method_code_lines(source: str, class_name: str) -> dict[str, int]:
    """Code lines (no docstring, comments or blank lines) of each public method of a class."""
    lines = source.splitlines()
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        for fn in node.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.name.startswith("_") and not fn.name.startswith("__"):
                continue
            body = fn.body[1:] if ast.get_docstring(fn) else fn.body
            if not body:
                continue
            code = lines[body[0].lineno - 1 : fn.end_lineno]
            out[fn.name] = sum(1 for ln in code if ln.strip() and not ln.strip().startswith("#"))
    return out


def test_the_managers_public_methods_only_order_components() -> None:
    source = (PACKAGE / "manager.py").read_text()
    counts = public_method_code_lines(source, "Zero3CpuOffloadManager")
    assert {"forward_pass", "backward_pass", "optimizer_step", "save_pretrained"} <= set(counts)
    long = {name: n for name, n in counts.items() if n > 30}
    assert long == {}, f"manager methods longer than 30 code lines: {long}"
