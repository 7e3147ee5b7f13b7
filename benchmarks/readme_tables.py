"""Copy benchmark tables from ``benchmarks/results/*.md`` into README.md.

Every region of README.md between a line ``<!-- results: NAME.md -->`` and the
next line ``<!-- /results -->`` is generated: it holds the first table of
``benchmarks/results/NAME.md`` and, above it, the paragraph right before that
table (the machine line ``_common.write_results`` writes there), each
surrounded by blank lines. Everything outside the regions is left as it is.

    python benchmarks/readme_tables.py          # rewrite the regions of README.md
    python benchmarks/readme_tables.py --check  # exit 1 when a region is out of date

Errors (a region without its end marker, a results file that does not exist
or has no table) are one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"
START = re.compile(r"^<!-- results: (?P<name>[A-Za-z0-9_.-]+\.md) -->$")
END = "<!-- /results -->"

__all__ = ["ReadmeTablesError", "Region", "check", "excerpt", "find_regions", "main", "render"]


class ReadmeTablesError(Exception):
    """README.md's markers or a results file cannot be used; the message says which and where."""


@dataclass(frozen=True)
class Region:
    """A generated region: ``lines[start]`` is its start marker, ``lines[end]`` its end marker."""

    name: str
    start: int
    end: int


def find_regions(lines: list[str], *, source: str = "README.md") -> list[Region]:
    """The regions of ``lines`` (a README split into lines, without line ends).

    Raises:
        ReadmeTablesError: a start marker inside a region, a region without an
            end marker, or an end marker outside any region.
    """
    regions: list[Region] = []
    open_at: int | None = None
    name = ""
    for i, line in enumerate(lines):
        text = line.strip()
        match = START.match(text)
        if match:
            if open_at is not None:
                raise ReadmeTablesError(
                    f"{source}:{i + 1}: region {match['name']} starts inside region {name} "
                    f"(line {open_at + 1}), which has no '{END}' before it"
                )
            open_at, name = i, match["name"]
        elif text.startswith("<!-- results:"):
            raise ReadmeTablesError(
                f"{source}:{i + 1}: malformed marker {text!r}; expected "
                "'<!-- results: NAME.md -->' with NAME of letters, digits, '.', '_' or '-'"
            )
        elif text == END:
            if open_at is None:
                raise ReadmeTablesError(f"{source}:{i + 1}: '{END}' without a region start")
            regions.append(Region(name, open_at, i))
            open_at = None
    if open_at is not None:
        raise ReadmeTablesError(f"{source}:{open_at + 1}: region {name} has no '{END}' line")
    return regions


def excerpt(markdown: str, *, source: str) -> list[str]:
    """The first table of ``markdown`` with the paragraph right above it (unless a heading).

    Raises:
        ReadmeTablesError: ``markdown`` has no table.
    """
    lines = markdown.splitlines()
    first = next((i for i, line in enumerate(lines) if line.lstrip().startswith("|")), None)
    if first is None:
        raise ReadmeTablesError(f"{source}: no markdown table in it")
    last = first
    while last + 1 < len(lines) and lines[last + 1].lstrip().startswith("|"):
        last += 1
    table = [line.rstrip() for line in lines[first : last + 1]]
    above = first - 1
    while above >= 0 and not lines[above].strip():
        above -= 1
    para_end = above
    while above >= 0 and lines[above].strip() and not lines[above].lstrip().startswith("|"):
        above -= 1
    paragraph = [line.rstrip() for line in lines[above + 1 : para_end + 1]]
    if paragraph and not paragraph[0].lstrip().startswith("#"):
        return [*paragraph, "", *table]
    return table


def _content(name: str, results_dir: Path, where: str) -> list[str]:
    path = results_dir / name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReadmeTablesError(
            f"{where}: region {name}: results file {path} does not exist"
        ) from None
    return ["", *excerpt(text, source=str(path)), ""]


def render(readme: str, results_dir: Path, *, source: str = "README.md") -> tuple[str, list[str]]:
    """``readme`` with every region regenerated, and the names of the regions that changed.

    Raises:
        ReadmeTablesError: bad markers, or a region's results file is missing or has no table.
    """
    lines = readme.splitlines()
    out: list[str] = []
    changed: list[str] = []
    done = 0
    for region in find_regions(lines, source=source):
        new = _content(region.name, results_dir, f"{source}:{region.start + 1}")
        if lines[region.start + 1 : region.end] != new:
            changed.append(region.name)
        out += [*lines[done : region.start + 1], *new]
        done = region.end
    out += lines[done:]
    return "\n".join(out) + ("\n" if readme.endswith("\n") else ""), changed


def check(readme_path: Path = README, results_dir: Path = RESULTS_DIR) -> list[str]:
    """Names of the regions of ``readme_path`` that differ from their results files."""
    _, changed = render(
        readme_path.read_text(encoding="utf-8"), results_dir, source=readme_path.name
    )
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README is out of date")
    parser.add_argument("--readme", type=Path, default=README, help="default: README.md")
    parser.add_argument(
        "--results-dir", type=Path, default=RESULTS_DIR, help="default: benchmarks/results"
    )
    args = parser.parse_args(argv)
    try:
        text = args.readme.read_text(encoding="utf-8")
        new, changed = render(text, args.results_dir, source=args.readme.name)
    except (ReadmeTablesError, OSError) as exc:
        print(f"readme_tables: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for name in changed:
            print(
                f"{args.readme}: region {name} is out of date with {args.results_dir / name}; "
                "run python benchmarks/readme_tables.py",
                file=sys.stderr,
            )
        if not changed:
            print(f"{args.readme}: every generated table is up to date")
        return 1 if changed else 0
    if new != text:
        args.readme.write_text(new, encoding="utf-8")
    print(f"{args.readme}: {len(changed)} region(s) rewritten ({', '.join(changed) or 'none'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
