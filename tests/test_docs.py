"""README.md and docs/: generated pages current, links and paths real, statements tied to code."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from zero3_offload.memory.accounting import Zero3MemoryStats
from zero3_offload.prefetch.status import PrefetchQueueStatus
from zero3_offload.stats.performance import Zero3PerformanceStats

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "examples").glob("*.md"))]
PACKAGE = ROOT / "zero3_offload"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"(?:zero3_offload|docs|benchmarks|examples|tests|\.ci)/[\w./-]*")
DOTTED = re.compile(r"zero3_offload(?:\.\w+)+")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "make_configuration", DOCS / "make_configuration.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(page: Path) -> str:
    """The page without its fenced blocks (command output, code)."""
    return FENCE.sub("", _text(page))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", _prose(page), re.MULTILINE)}


def test_configuration_reference_is_current() -> None:
    generator = _load_generator()
    assert (DOCS / "configuration.md").read_text(encoding="utf-8") == generator.render(), (
        "docs/configuration.md is out of date: run python docs/make_configuration.py"
    )


def test_configuration_reference_lists_every_field() -> None:
    from zero3_offload.config import OptimizerConfig, Zero3CpuOffloadConfig

    text = _text(DOCS / "configuration.md")
    for cls in (Zero3CpuOffloadConfig, OptimizerConfig):
        for field in attrs.fields(cls):
            assert f"| `{field.name}` |" in text, (cls.__name__, field.name)


def test_readme_is_a_front_page() -> None:
    assert README.stat().st_size <= 16 * 1024
    text = _text(README)
    setup, test = (
        re.search(rf"^## {section}\n.*?```bash\n(.*?)\n```", text, re.M | re.S)[1]
        for section in ("Setup", "Test")
    )
    assert setup.startswith("python -m venv .venv && . .venv/bin/activate && ")
    assert "python -m pip install torch==2.13.0" in setup  # the CPU wheel, not CUDA's
    assert test == "ruff check . && ruff format --check . && python -m pytest -n 2"
    # .ci/run: a fresh environment, then exactly the two commands, in that order.
    ci = _text(ROOT / ".ci" / "run").splitlines()
    assert ci.index("rm -rf .venv") < ci.index(setup) < ci.index(test)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_into_the_repository(page: Path) -> None:
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: no heading for {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_names_in_code_spans_exist(page: Path) -> None:
    for span in CODE_SPAN.findall(_prose(page)):
        span = re.sub(r"\(.*\)$", "", span)  # a call: check the name
        if REPO_PATH.fullmatch(span) and not re.search(r"[{*<]", span):
            assert (ROOT / span).exists(), f"{page.name}: `{span}` does not exist"
        elif DOTTED.fullmatch(span):
            _import_dotted(span)


def _import_dotted(name: str) -> None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"`{name}` does not exist"
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"`{name}` does not exist")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_missing_design_doc_and_no_local_paths(page: Path) -> None:
    text = _text(page)
    assert "DESIGN.md" not in text
    for span in CODE_SPAN.findall(_prose(page)):
        assert not re.match(r"(/work|/home|/tmp|/Users|~)/", span), f"{page.name}: `{span}`"


def test_readme_quickstart_runs(tmp_path: Path) -> None:
    section = _text(README).split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]
    script = tmp_path / "quickstart.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        first, last = map(
            float, re.search(rf"rank {rank}: loss (\S+) -> (\S+),", proc.stdout).groups()
        )
        assert last < first


def _note_definitions() -> dict[str, str]:
    """Note name -> the file whose docstring starts a paragraph with ``[Note: name]``."""
    found: dict[str, str] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        for line in file.read_text(encoding="utf-8").splitlines():
            m = re.fullmatch(r"\s*\[Note: ([^\]]+)\]", line)
            if m:
                assert m[1] not in found, f"[Note: {m[1]}] is written twice"
                found[m[1]] = str(file.relative_to(ROOT))
    return found


def test_notes_map_matches_the_code() -> None:
    rows = re.findall(
        r"^\| \[Note: ([^\]]+)\] \| `([^`]+)` \|", _text(DOCS / "architecture.md"), re.M
    )
    assert dict(rows) == _note_definitions()
    assert len(rows) == len(dict(rows))


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def _imported_units(file: Path) -> set[str]:
    units = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "zero3_offload":
            units |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zero3_offload."):
            units.add(_unit(node.module))
        elif isinstance(node, ast.Import):
            units |= {_unit(a.name) for a in node.names if a.name.startswith("zero3_offload.")}
    return units


def test_imports_follow_the_documented_dependency_direction() -> None:
    text = _text(DOCS / "architecture.md")
    block = re.search(r"<!-- layers -->\n```text\n(.*?)```", text, re.DOTALL)[1]
    tier = {
        name.strip(): i for i, line in enumerate(block.splitlines()) for name in line.split(",")
    }
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(PACKAGE)
        unit = rel.parts[0].removesuffix(".py")
        if unit in ("__init__", "__main__"):
            continue
        assert unit in tier, f"{unit} is missing from the layers of docs/architecture.md"
        for other in _imported_units(file) - {unit}:
            assert other in tier, f"{rel} imports {other}, missing from the layers"
            assert tier[other] < tier[unit], f"{rel} imports {other}, a layer above or beside it"


@pytest.mark.parametrize(
    "cls", [Zero3PerformanceStats, Zero3MemoryStats, PrefetchQueueStatus], ids=lambda c: c.__name__
)
def test_observability_tables_list_every_stats_field(cls: type) -> None:
    text = _text(DOCS / "observability.md")
    section = re.search(rf"^###[^\n]*`{cls.__name__}`\n(.*?)(?=^#|\Z)", text, re.M | re.DOTALL)[1]
    listed = set()
    for row in re.findall(r"^\| ([^|]+) \|", section, re.M):
        listed |= set(re.findall(r"`(\w+)`", row))
    assert listed == {f.name for f in attrs.fields(cls)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_excerpts_match_their_source(page: Path) -> None:
    for source, block in re.findall(
        r"<!-- excerpt: (\S+) -->\n```[^\n]*\n(.*?)```", _text(page), re.DOTALL
    ):
        assert block in (page.parent / source).read_text(encoding="utf-8"), source
