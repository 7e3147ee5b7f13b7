"""The benchmark tables in README.md and docs/*.md, generated from benchmarks/results.

Each region between ``<!-- results: NAME.md -->`` and ``<!-- /results -->`` holds the first table
of ``benchmarks/results/NAME.md`` and the paragraph above it; ``--check`` exits 1 when one is out
of date; a bad marker or a missing or tableless results file is an error (exit 2)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
START = re.compile(r"^<!-- results: (?P<name>[A-Za-z0-9_.-]+\.md) -->$")
END = "<!-- /results -->"


class ReadmeTablesError(Exception):
    """Bad markers, or a results file that cannot be used; the message says which and where."""


def documents(root: Path = ROOT) -> list[Path]:
    """The files with generated regions: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def find_regions(lines: list[str], *, source: str = "README.md") -> list[tuple[str, int, int]]:
    """(name, line of the start marker, line of the end marker) of every region of ``lines``."""
    regions, start, name = [], None, ""
    for i, text in enumerate(line.strip() for line in lines):
        if (match := START.match(text)) and start is not None:  # a start inside an open region
            break
        if match:
            start, name = i, match["name"]
        elif text.startswith("<!-- results:"):
            expected = "expected '<!-- results: NAME.md -->'"
            raise ReadmeTablesError(f"{source}:{i + 1}: malformed marker {text!r}; {expected}")
        elif text == END and start is None:
            raise ReadmeTablesError(f"{source}:{i + 1}: '{END}' without a region start")
        elif text == END:
            regions.append((name, start, i))
            start = None
    if start is not None:
        raise ReadmeTablesError(f"{source}:{start + 1}: region {name} has no '{END}' line")
    return regions


def excerpt(markdown: str, *, source: str) -> list[str]:
    """The first table of ``markdown`` with the paragraph right above it (unless a heading)."""
    paragraphs = re.split(r"\n\s*\n", markdown)
    blocks = [[ln.rstrip() for ln in b.strip("\n").splitlines()] for b in paragraphs]
    first = next((i for i, b in enumerate(blocks) if b and b[0].lstrip().startswith("|")), None)
    if first is None:
        raise ReadmeTablesError(f"{source}: no markdown table in it")
    above, table = blocks[first - 1] if first else [], blocks[first]
    return [*above, "", *table] if above and not above[0].startswith("#") else table


def render(text: str, results_dir: Path, *, source: str = "README.md") -> tuple[str, list[str]]:
    """``text`` with every region regenerated, and the names of the regions that changed."""
    lines, out, changed, done = text.splitlines(), [], [], 0
    for name, start, end in find_regions(lines, source=source):
        if not (path := results_dir / name).exists():
            where = f"{source}:{start + 1}: region {name}"
            raise ReadmeTablesError(f"{where}: results file {path} does not exist")
        new = ["", *excerpt(path.read_text(encoding="utf-8"), source=str(path)), ""]
        changed += [name] * (lines[start + 1 : end] != new)
        out += [*lines[done : start + 1], *new]
        done = end
    return "\n".join(out + lines[done:]) + ("\n" if text.endswith("\n") else ""), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when a region is stale")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args, stale = parser.parse_args(argv), 0
    for path in args.files or documents():
        try:
            text = path.read_text(encoding="utf-8")
            new, changed = render(text, args.results_dir, source=path.name)
        except (ReadmeTablesError, OSError) as exc:
            print(f"readme_tables: error: {exc}", file=sys.stderr)
            return 2
        stale += len(changed)
        for name in changed if args.check else []:
            stale_region = f"{path}: region {name} is out of date with {args.results_dir / name}"
            print(f"{stale_region}; run python docs/make_readme_tables.py", file=sys.stderr)
        if not args.check and new != text:
            path.write_text(new, encoding="utf-8")
            print(f"{path}: rewrote {', '.join(changed)}")
    if args.check and not stale:
        print("every generated table is up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
