"""docs/make_readme_tables.py: the generated tables of README.md and docs/*.md match
benchmarks/results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location(
        "readme_tables", ROOT / "docs" / "make_readme_tables.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rt = _load()


def stale(path: Path, results_dir: Path) -> list[str]:
    """Names of the regions of the file at ``path`` that differ from their results files."""
    return rt.render(path.read_text(encoding="utf-8"), results_dir, source=path.name)[1]


RESULT_MD = """# A benchmark

CPU X, 2 usable cores (2 logical), torch 9.9, 2026-01-01

| system | step s |
|--------|--------|
| ours   | 1.0    |
| theirs | 2.0    |

- a note

Second table:

| a | b |
|---|---|
| 1 | 2 |
"""

README = """# Project

Intro.

<!-- results: bench.md -->
| old | table |
<!-- /results -->

Text after.
"""


def test_repo_tables_are_up_to_date() -> None:
    for path in rt.documents(ROOT):
        changed = stale(path, ROOT / "benchmarks" / "results")
        assert changed == [], (
            f"{path.name} regions {changed} differ from benchmarks/results: "
            "run python docs/make_readme_tables.py"
        )


def test_repo_documents_have_their_regions() -> None:
    def names(path: Path) -> list[str]:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [name for name, _, _ in rt.find_regions(lines, source=path.name)]

    assert "peers-vocab8192.md" in names(ROOT / "README.md")
    docs = {"peers.md", "peers-vocab8192.md", "peers-large-mmap.md", "scaling.md"}
    assert docs <= set(names(ROOT / "docs" / "benchmarks.md"))


def test_region_gets_machine_line_and_first_table_only(tmp_path: Path) -> None:
    (tmp_path / "bench.md").write_text(RESULT_MD, encoding="utf-8")
    new, changed = rt.render(README, tmp_path)
    assert changed == ["bench.md"]
    assert new == (
        "# Project\n\nIntro.\n\n<!-- results: bench.md -->\n\n"
        "CPU X, 2 usable cores (2 logical), torch 9.9, 2026-01-01\n\n"
        "| system | step s |\n|--------|--------|\n| ours   | 1.0    |\n| theirs | 2.0    |\n"
        "\n<!-- /results -->\n\nText after.\n"
    )
    again, changed_again = rt.render(new, tmp_path)  # idempotent
    assert again == new and changed_again == []


def test_check_reports_the_stale_region(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bench.md").write_text(RESULT_MD, encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    args = [str(readme), "--results-dir", str(tmp_path)]
    assert rt.main(["--check", *args]) == 1
    assert "region bench.md is out of date" in capsys.readouterr().err
    assert readme.read_text(encoding="utf-8") == README  # --check writes nothing
    assert rt.main(args) == 0
    assert rt.main(["--check", *args]) == 0
    assert stale(readme, tmp_path) == []


def test_missing_results_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(rt.ReadmeTablesError, match=r"README.md:5: region bench.md: results file"):
        rt.render(README, tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    assert rt.main(["--check", str(readme), "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("readme_tables: error: ") and "bench.md does not exist" in err


def test_bad_markers_and_tableless_results_are_errors(tmp_path: Path) -> None:
    with pytest.raises(rt.ReadmeTablesError, match="has no '<!-- /results -->' line"):
        rt.find_regions(["<!-- results: a.md -->", "text"])
    with pytest.raises(rt.ReadmeTablesError, match="without a region start"):
        rt.find_regions(["<!-- /results -->"])
    with pytest.raises(rt.ReadmeTablesError, match="malformed marker"):
        rt.find_regions(["<!-- results: ../x.md -->"])
    (tmp_path / "bench.md").write_text("# only a title\n\nno table\n", encoding="utf-8")
    with pytest.raises(rt.ReadmeTablesError, match="no markdown table"):
        rt.render(README, tmp_path)
