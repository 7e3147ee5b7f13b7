"""The one renderer: a results payload (compact JSON) -> Markdown, from the suite's data: its
``TITLE``, ``NOTES`` (``str.format`` templates over the payload, or functions of it) and
``LAYOUT`` or ``layout(payload)``, blocks each a template or ``(columns, rows)`` of :class:`Col`;
a template whose fields are missing is left out, and so is a column that no row has."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import string
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
MIB = 2**20


class Col(NamedTuple):
    """A column: ``field`` of each row (or a ``{...}`` template) in ``fmt``; ``x``: ratio to ref."""

    header: str
    field: str
    fmt: str = ""
    ref: str | None = None
    missing: str = "-"


def fmt(value: float, digits: int = 3) -> str:
    """``digits`` significant figures; large values unscaled, with thousands separators."""
    if value == 0:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 10 ** (digits - 1) else f"{value:.{digits}g}"


def fmt_rate(value: float) -> str:
    """A count per second with an SI suffix (``1.23 G``)."""
    scales = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))
    scale, suffix = next((s, x) for s, x in scales if abs(value) >= s or s == 1)
    return f"{value / scale:.3g} {suffix}".rstrip()


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``; ``-`` when either is missing or ``b`` is zero."""
    return f"{a / b:.2f}x" if a is not None and b else "-"


def mib(nbytes: float, decimals: int = 0) -> str:
    """Bytes as MiB with thousands separators (``1,234``)."""
    return f"{nbytes / MIB:,.{decimals}f}"


FORMATS: dict[str, Callable[[Any], str]] = {"mib": mib, "mib1": lambda v: mib(v, 1), "sig": fmt}
FORMATS.update(rate=fmt_rate, ms=lambda v: f"{1e3 * v:.0f}", ms1=lambda v: f"{1e3 * v:.1f}")
FORMATS.update(us=lambda v: f"{1e6 * v:.0f}", yes=lambda v: "yes" if v else "NO")
FORMATS["or_default"] = lambda v: f"{v}" if v else "default"


def cell(col: Col, row: Mapping[str, Any], rows: Mapping[str, Any]) -> str:
    if "{" in col.field:
        return fill(col.field, row) or col.missing
    value = row.get(col.field)
    if col.fmt in ("x", "/x"):  # this / the reference's (its inverse); the reference is the row's
        ref = row[col.ref] if isinstance(row.get(col.ref), dict) else rows.get(col.ref) or {}
        a, b = value, ref.get(col.field)
        return ratio(a, b) if col.fmt == "x" else ratio(b, a)
    if value is None or isinstance(value, str):
        return col.missing if value is None else value
    return FORMATS[col.fmt](value) if col.fmt in FORMATS else format(value, col.fmt)


def table(columns: Iterable[Col], rows: Mapping[str, Any] | list) -> str:
    """The rows (a list, or key -> row) as a padded Markdown table, less columns no row has."""
    by = rows if isinstance(rows, Mapping) else {str(i): r for i, r in enumerate(rows)}
    shown = [c for c in columns if "{" in c.field or any(c.field in r for r in by.values())]
    body = [[c.header for c in shown], *([cell(c, r, by) for c in shown] for r in by.values())]
    widths = [max(len(r[i]) for r in body) for i in range(len(shown))]
    lines = ["| " + " | ".join(map(str.ljust, r, widths)) + " |" for r in body]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


class _Formatter(string.Formatter):
    def format_field(self, value: Any, spec: str) -> str:  # the names of FORMATS, too
        return FORMATS[spec](value) if spec in FORMATS else super().format_field(value, spec)


def fill(block: str | Callable, payload: Mapping[str, Any]) -> str | None:
    """A template (its fields may name :data:`FORMATS`) or a function, filled; None if short."""
    if callable(block):
        return block(payload)
    try:
        return _Formatter().vformat(block, (), payload)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def markdown(payload: Mapping[str, Any], suite: Any) -> str:
    """The ``.md`` of a payload: title, machine line, the suite's blocks, its notes."""
    layout = suite.layout(payload) if hasattr(suite, "layout") else suite.LAYOUT
    parts = [f"# {fill(suite.TITLE, payload)}", "", machine_line(payload["machine"])]
    for block in layout:
        if isinstance(block, tuple):
            rows = payload.get(block[1], {}) if isinstance(block[1], str) else block[1]
            text = table(block[0], rows)
        else:
            text = fill(block, payload)
        parts += ["", text] if text else []
    notes = []
    for got in (fill(template, payload) for template in suite.NOTES):  # a function: lines too
        notes += [got] if isinstance(got, str) else got or []
    return "\n".join([*parts, "", *(f"- {n}" for n in notes)]).rstrip() + "\n"


def compact(value: Any) -> Any:
    """``value`` with its floats to 10 significant digits (whole ones as ints)."""
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [compact(v) for v in value]
    if isinstance(value, float) and math.isfinite(value):
        return int(value) if value.is_integer() and abs(value) < 2**53 else float(f"{value:.10g}")
    return value


def dumps(value: Any, indent: int = 0, width: int = 120) -> str:
    """Compact JSON: records of scalars (or lists of them), and what fits in ``width``, inline."""

    def scalar(v: Any) -> bool:
        return not isinstance(v, dict | list)

    def leaf(v: Any) -> bool:  # a scalar, or a list of scalars
        return scalar(v) or (isinstance(v, list) and all(map(scalar, v)))

    flat = json.dumps(value, default=str)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    if leaf(value) or all(map(leaf, items)) or len(flat) + indent <= width:
        return flat
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in value) + f"\n{pad}]"


def write(out: Path, payload: Mapping[str, Any], suite: Any) -> Path:
    """The payload as compact JSON at ``out``, and its Markdown (of the JSON as written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text((text := dumps(compact(payload))) + "\n", encoding="utf-8")
    (md := out.with_suffix(".md")).write_text(markdown(json.loads(text), suite), encoding="utf-8")
    return md


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What the numbers are measured on, and when (also on stderr); first sets torch's threads."""
    if threads:
        torch.set_num_threads(threads)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpus = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    info = dict(cpu_model=cpus[0] if cpus else platform.processor() or "?")
    info.update(logical_cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)))
    info["mem_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info.update(torch_version=torch.__version__, torch_threads=torch.get_num_threads())
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info.update(python_version=platform.python_version(), date_utc=now)
    info["load_average_at_start"] = list(os.getloadavg())  # other work skews timings
    if torch.cuda.is_available():
        info.update(gpu_name=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda)
    print(f"machine: {machine_line(info)}", file=sys.stderr, flush=True)
    return info


def machine_line(info: Mapping[str, Any]) -> str:
    """One line naming the machine: CPU, cores, GPU (when known), torch, threads, date, load."""
    load, gpu = info.get("load_average_at_start"), info.get("gpu_name")
    return (
        f"{info['cpu_model']}, {info['usable_cores']} usable cores ({info['logical_cores']} "
        f"logical){f', GPU {gpu}' if gpu else ''}, torch {info['torch_version']}, "
        f"{info['torch_threads']} torch threads, {info['date_utc']}"
        + (f", load average {load[0]:.2f} at start" if load else "")
    )
