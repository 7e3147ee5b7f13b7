"""The one report writer: the machine, number formats, markdown tables, the JSON and its markdown.

A suite's ``report(payload)`` builds the markdown from the results payload alone, after a run
and for ``run.py --render``, so a committed JSON always rebuilds its committed markdown.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
MIB = 2**20


class Report(NamedTuple):
    title: str
    tables: str  # markdown: the tables and the lines between them
    notes: list[str]


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What the numbers are measured on, and when, also said on stderr; first sets torch's threads
    when given (the line then shows what the measured processes run with)."""
    if threads:
        torch.set_num_threads(threads)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpus = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    info = {
        "cpu_model": cpus[0] if cpus else platform.processor() or "?",
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        # the 1, 5 and 15 minute load averages: other work on a shared machine skews timings
        "load_average_at_start": list(os.getloadavg()),
        "date_utc": now,
    }
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


def fmt(value: float, digits: int = 3) -> str:
    """``digits`` significant figures; large values unscaled, with thousands separators."""
    if value == 0:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 10 ** (digits - 1) else f"{value:.{digits}g}"


def fmt_rate(value: float) -> str:
    """A count per second with an SI suffix (``1.23 G``)."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {suffix}"
    return f"{value:.3g}"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``; ``-`` when either is missing or ``b`` is zero."""
    return f"{a / b:.2f}x" if a is not None and b else "-"


def mib(nbytes: float, decimals: int = 0) -> str:
    """Bytes as MiB with thousands separators (``1,234``)."""
    return f"{nbytes / MIB:,.{decimals}f}"


def cols(text: str) -> list[str]:
    """Column headers written as one ``;``-separated string."""
    return [c.strip() for c in text.split(";")]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table, columns padded so that it reads as plain text too."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def systems_table(
    summary: Mapping[str, Mapping[str, Any]],
    refs: Mapping[str, str],
    extra: Mapping[str, Callable[[str], str]] | None = None,
) -> str:
    """The main table of training systems (``harness.train.summarize``): per system its step
    time, CPU time, phases and memory, with ratios to the systems of ``refs`` (name -> key; CPU
    time and GPU memory to the first only), then the ``extra`` columns (header -> cell of a key).
    The GPU memory columns are there when the runs measured GPU memory."""
    base = [summary.get(key, {}) for key in refs.values()]
    gpu = any("peak_gpu_bytes" in s for s in summary.values())
    vs_all, vs_first = [f"vs {name}" for name in refs], [f"vs {next(iter(refs))}"]
    headers = [
        *("system", "ranks x threads", "median step s", *vs_all, "best run step s"),
        *("CPU s / step", *vs_first, "fwd+loss s", "backward s", "optimizer s"),
        *(["peak GPU allocated MiB", *vs_first] if gpu else []),
        *("peak RSS / rank MiB", *vs_all, "RSS after import MiB", "model state / rank MiB"),
        *(extra or {}),
    ]

    def vs(s: Mapping[str, Any], field: str, to: list = base) -> list[str]:
        return [ratio(s[field], b.get(field)) for b in to]

    rows = []
    for key, s in summary.items():
        step, cpu = f"{s['median_step_s']:.3f}", f"{s['median_cpu_s']:.3f}"
        rows.append(
            [s["label"], f"{s['world_size']} x {s['threads_per_rank']}", step]
            + [*vs(s, "median_step_s"), f"{s['best_run_step_s']:.3f}", cpu]
            + [*vs(s, "median_cpu_s", base[:1])]
            + [f"{s[f'median_{p}_s']:.3f}" for p in ("forward", "backward", "optimizer")]
            + ([mib(s["peak_gpu_bytes"]), *vs(s, "peak_gpu_bytes", base[:1])] if gpu else [])
            + [mib(s["peak_rss_bytes"]), *vs(s, "peak_rss_bytes")]
            + [mib(s["import_rss_bytes"]), mib(s["model_state_bytes"], 1)]
            + [cell(key) for cell in (extra or {}).values()]
        )
    return markdown_table(headers, rows)


def markdown(payload: Mapping[str, Any], report: Report) -> str:
    """The ``.md`` of a payload: title, machine line, tables, notes."""
    parts = [f"# {report.title}", "", machine_line(payload["machine"]), "", report.tables, ""]
    return "\n".join(parts + [f"- {n}" for n in report.notes]).rstrip() + "\n"


def write(out: Path, payload: Mapping[str, Any], report: Report) -> Path:
    """Write the payload as JSON at ``out`` and its markdown beside it; the markdown's path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    md = out.with_suffix(".md")
    md.write_text(markdown(payload, report), encoding="utf-8")
    return md
