"""Run a benchmark suite, or rebuild results' Markdown: see docs/benchmarks.md.

python benchmarks/run.py SUITE [options]     # SUITE --help: what it measures, its options
python benchmarks/run.py --render benchmarks/results/*.json   # each JSON's .md, again
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from harness.render import RESULTS_DIR, machine_info, markdown, write
from harness.runner import progress

NAMES = "optimizer overlap peers hf_peers scaling pretrained_load soak"
NAMES += " long_context plan_accuracy"
SUITES = {n.replace("_", "-"): importlib.import_module(f"suites.{n}") for n in NAMES.split()}
SUITES["nvme"] = importlib.import_module("suites.nvme")
COMMON = {  # every suite's; and those a suite names in its TAKES
    "quick": {"action": "store_true", "help": "tiny sizes: a smoke test, not a measurement"},
    "repeats": {"type": int, "help": "timed repeats (or steps) per case"},
    "warmup": {"type": int, "help": "untimed repeats (or steps) first"},
    "threads": {"type": int, "help": "torch threads (per rank where ranks run)"},
    "out": {"type": Path, "help": "results JSON (default results/<name>.json)"},
    "rounds": {"type": int, "help": "rounds: every case once per round, the order rotated"},
    "seed": {"type": int, "help": "model and data seed"},
    "timeout": {"type": float, "help": "seconds each run (or job) may take"},
    "keep": {"action": "store_true", "help": "keep the work directory (logs, outputs)"},
    "mmap_threshold": {"type": int, "metavar": "BYTES", "help": "MALLOC_MMAP_THRESHOLD_ in every "
                       "rank (glibc returns freed blocks this large to the OS; `zero3-offload "
                       "train` sets 1048576); the name gets -mmap"},
}  # fmt: skip


def render(paths: list[Path], plot: Path | None) -> int:
    """Write each results JSON's Markdown beside it (and with ``plot``, the scaling plot)."""
    for path in paths:
        payload = json.loads(path.read_text(encoding="utf-8"))
        if payload.get("suite") not in SUITES:  # results of another tool (faults)
            progress(f"skipped {path}: not the results of a suite")
            continue
        suite, md = SUITES[payload["suite"]], path.with_suffix(".md")
        md.write_text(markdown(payload, suite), encoding="utf-8")
        progress(f"wrote {md}")
        if plot is not None and hasattr(suite, "plot"):
            suite.plot(payload, plot)
            progress(f"wrote {plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    render_help = "run nothing: write each results JSON's Markdown beside it"
    parser.add_argument("--render", nargs="+", type=Path, metavar="JSON", help=render_help)
    parser.add_argument("--plot", type=Path, metavar="PNG", help="with --render: the plot too")
    sub = parser.add_subparsers(dest="suite", metavar="SUITE")
    for name, suite in SUITES.items():
        doc, quick = suite.__doc__, getattr(suite, "QUICK", {})
        defaults = ", ".join(f"{k} {v}" for k, v in suite.DEFAULTS.items())
        epilog = f"defaults: {defaults}" + (f"; with --quick: {quick}" if quick else "")
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc, epilog=epilog)
        for key in ["quick", "repeats", "warmup", "threads", "out", *getattr(suite, "TAKES", [])]:
            p.add_argument(f"--{key.replace('_', '-')}", **COMMON[key])
        for flag, kwargs in suite.OPTIONS.items():
            p.add_argument(flag, **kwargs)
    args = parser.parse_args(argv)
    if args.render:
        return render(args.render, args.plot)
    if args.suite is None:
        parser.error("name a SUITE, or --render JSON")
    suite = SUITES[args.suite]
    # the suite's defaults (with --quick, its QUICK ones first) for the options not given
    quick = getattr(suite, "QUICK", {}) if args.quick else {}
    for key, value in {**suite.DEFAULTS, **quick}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    counts = [getattr(args, k, None) for k in ("repeats", "threads", "rounds")]
    problem = suite.check(args) if hasattr(suite, "check") else None
    if any(v is not None and v < 1 for v in counts) or (args.warmup or 0) < 0:
        problem = "--repeats, --threads and --rounds must be >= 1, --warmup >= 0"
    if problem:
        parser.error(f"{args.suite}: {problem}")
    info = machine_info(args.threads)  # first: it sets torch's threads; the load at the start
    if (result := suite.run(args)) is None:  # it could not run (the suite said why)
        return 2
    name = result.pop("benchmark", None) or args.suite
    if getattr(args, "mmap_threshold", None) != suite.DEFAULTS.get("mmap_threshold"):
        name += "-mmap"  # a glibc threshold not the suite's own
    name = name.replace("-quick", "") + "-quick" if args.quick else name  # smoke tests: ignored
    payload = {"suite": args.suite, "benchmark": name, "quick": args.quick, "machine": info}
    out = args.out or RESULTS_DIR / f"{name}.json"
    md = write(out, {**payload, **result}, suite)
    print(md.read_text(encoding="utf-8"))
    progress(f"wrote {out} and {md}")
    if getattr(args, "plot_path", None) is not None:
        render([out], args.plot_path)
    # 1 when a run or part failed, 2 when the systems' losses disagree
    return 1 if result.get("failed") else 2 if result.get("losses_agree") is False else 0


if __name__ == "__main__":
    sys.exit(main())
