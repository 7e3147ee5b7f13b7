"""Shared helpers for the benchmarks: machine info, timing, JSON and markdown output.

Timing rules (every benchmark follows them):

- only real work is timed, with :func:`time.perf_counter`;
- every case is run ``warmup`` times untimed first (lazy state, page faults,
  thread-pool start-up), then ``repeats`` timed runs;
- the cases of one benchmark are interleaved round-robin (case A, B, C, A, B,
  C, ...), so slow phases of a shared, noisy machine hit every case alike and
  ratios between cases measured in the same run stay meaningful;
- the figure reported is the median of the repeats (min and max are kept in
  the JSON as well).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIN_REPEATS = 5


@dataclass
class Timing:
    """Wall-clock seconds of the timed repeats of one case."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "max_s": self.max,
            "repeats": len(self.samples),
            "samples_s": self.samples,
        }


def time_interleaved(
    cases: Mapping[str, Callable[[], object]], *, warmup: int, repeats: int
) -> dict[str, Timing]:
    """Time every case ``repeats`` times, round-robin, after ``warmup`` untimed runs each.

    Args:
        cases: name -> function doing one unit of real work (its result is ignored).
        warmup: untimed runs of each case before timing (>= 1).
        repeats: timed runs of each case (>= :data:`MIN_REPEATS`).

    Returns:
        name -> :class:`Timing`, in the order of ``cases``.
    """
    if warmup < 1:
        raise ValueError(f"warmup={warmup} must be >= 1")
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats={repeats} must be >= {MIN_REPEATS}")
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    timings = {name: Timing() for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            timings[name].samples.append(time.perf_counter() - start)
    return timings


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (falls back to :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (other work on a shared machine skews timings)."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return [float(v) for v in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (and when)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "mem_total_bytes": _mem_total_bytes(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": load_average(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def add_common_args(parser: Any, *, default_repeats: int = 7) -> None:
    """The options every benchmark takes: --quick, --repeats, --warmup, --threads, --out."""
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, finishes in seconds (smoke test)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=default_repeats,
        help=f"timed repeats per case, median reported (>= {MIN_REPEATS}; default "
        f"{default_repeats})",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed runs per case first (default 2)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: leave torch's setting)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/<name>.json, <name>-quick.json "
        "with --quick); a .md table is written beside it",
    )


@contextlib.contextmanager
def work_directory(
    prefix: str, *, keep: bool, report: Callable[[str], object] = print
) -> Iterator[Path]:
    """A fresh temporary directory for one benchmark's runs; removed afterwards unless
    ``keep`` (then its path is reported)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    finally:
        if keep:
            report(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def add_rank_run_args(parser: Any, *, render_extra: str = "") -> None:
    """Options of the benchmarks that launch ranks (compare_peers, scaling):
    --mmap-threshold, --keep, --render."""
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set MALLOC_MMAP_THRESHOLD_=BYTES in every rank of every system (glibc then "
        "returns freed blocks of that size or more to the OS; `zero3-offload train` sets "
        "1048576); the output name gets '-mmap'",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs, per-rank results)"
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: rebuild the markdown of an earlier run from its results JSON, "
        "written beside --out (as PATH.md; no JSON is written) or, without --out, printed"
        f"{render_extra}; the other options are ignored",
    )


def check_common_args(parser: Any, args: Any) -> None:
    """Reject option values that would break the timing rules (via ``parser.error``)."""
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be >= {MIN_REPEATS} (median of at least {MIN_REPEATS})")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")


def apply_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def fmt(value: float, digits: int = 3) -> str:
    """A number for a table: ``digits`` significant figures, thousands unscaled."""
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_rate(value: float) -> str:
    """Params or elements per second with an SI suffix (e.g. ``1.23 G``)."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {suffix}"
    return f"{value:.3g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table, columns padded for reading as plain text too."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def machine_line(info: Mapping[str, Any]) -> str:
    """One line naming the machine: CPU, cores, GPU (when ``info`` has ``gpu_name``), torch."""
    load = info.get("load_average_at_start")
    load_txt = f", load average {load[0]:.2f} at start" if load else ""
    gpu = info.get("gpu_name")
    gpu_txt = f", GPU {gpu}" if gpu else ""
    return (
        f"{info['cpu_model']}, {info['usable_cores']} usable cores "
        f"({info['logical_cores']} logical){gpu_txt}, torch {info['torch_version']}, "
        f"{info['torch_threads']} torch threads, {info['date_utc']}{load_txt}"
    )


def default_out(name: str, quick: bool) -> Path:
    return RESULTS_DIR / (f"{name}-quick.json" if quick else f"{name}.json")


def write_results(
    out: Path, payload: Mapping[str, Any], table_md: str, *, title: str, notes: Sequence[str] = ()
) -> tuple[Path, Path]:
    """Write ``payload`` as JSON at ``out`` and the markdown table beside it (``.md``).

    Returns:
        The JSON and markdown paths.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n", encoding="utf-8")
    md_path = out.with_suffix(".md")
    md_path.write_text(
        markdown_report(payload["machine"], table_md, title=title, notes=notes), encoding="utf-8"
    )
    return out, md_path


def markdown_report(
    info: Mapping[str, Any], table_md: str, *, title: str, notes: Sequence[str] = ()
) -> str:
    """The ``.md`` file :func:`write_results` writes: title, machine line, tables, notes."""
    parts = [f"# {title}", "", machine_line(info), "", table_md, ""]
    parts += [f"- {n}" for n in notes]
    return "\n".join(parts).rstrip() + "\n"


def _json_default(obj: object) -> object:
    if isinstance(obj, Timing):
        return obj.as_dict()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[arg-type]
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
