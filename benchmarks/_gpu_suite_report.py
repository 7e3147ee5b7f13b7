"""Tables of ``gpu_suite.py``'s markdown report (from the workers' JSON results)."""

from __future__ import annotations

import statistics
from typing import Any

from _common import fmt, markdown_table

MIB = 2**20
# Run order and labels; the first is the one the suite is about, the second the baseline.
SYSTEMS = {"zero3_offload": "zero3_offload offload", "fsdp2_offload": "FSDP2 + CPUOffloadPolicy"}
BASELINE = "fsdp2_offload"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``, or ``-`` when either is missing."""
    return f"{a / b:.2f}x" if a is not None and b else "-"


def mib(n: float | None) -> str:
    """Bytes as MiB for a table cell."""
    return fmt(n / MIB) if n is not None else "-"


def pct(x: float | None) -> str:
    """A fraction as a percentage for a table cell."""
    return f"{100 * x:.1f}%" if x is not None else "-"


def median(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def render_systems(runs: dict[str, dict[str, Any]], dtype: str) -> str:
    """Table 1: step time, memory and exposed-copy fraction per system."""
    base = runs.get(BASELINE, {})
    b_step, b_gpu = median(base.get("step_s")), base.get("peak_gpu_allocated_bytes")
    b_rss = base.get("peak_rss_bytes")
    rows = []
    for key, label in SYSTEMS.items():
        r = runs.get(key, {"status": "not run"})
        step, gpu, rss = (
            median(r.get("step_s")),
            r.get("peak_gpu_allocated_bytes"),
            r.get("peak_rss_bytes"),
        )
        status = r.get("status", "?")
        if r.get("error"):
            status += f": {r['error'][:120]}"
        rows.append(
            [
                label,
                f"{dtype} / fp32",
                f"{step:.3f}" if step is not None else "-",
                ratio(step, b_step),
                str(len(r.get("step_s") or [])),
                mib(gpu),
                ratio(gpu, b_gpu),
                mib(rss),
                ratio(rss, b_rss),
                pct((r.get("profiler_copy") or {}).get("exposed_fraction")),
                pct((r.get("library_copy_stats") or {}).get("exposed_fraction")),
                status.replace("|", "/"),
            ]
        )
    headers = [
        "system",
        "compute / master",
        "median step s",
        "vs FSDP2",
        "timed steps",
        "peak GPU allocated MiB",
        "vs FSDP2",
        "peak RSS MiB",
        "vs FSDP2",
        "exposed copy (profiler)",
        "exposed copy (zero3 stats)",
        "status",
    ]
    return markdown_table(headers, rows)


def _copied(row: dict[str, Any] | None) -> float | None:
    """A baseline row's GB/s, when it did copy (on the CPU a ``.to()`` does not)."""
    return row.get("gb_per_s") if row and row.get("copied") and not row.get("error") else None


def render_copies(copy: dict[str, Any]) -> str:
    """Table 2: bandwidth per size, direction and path."""
    rows = []
    for size in copy.get("sizes", []):
        by_key = {(r["direction"], r["path"]): r for r in size["rows"]}
        for r in size["rows"]:
            pinned = _copied(by_key.get((r["direction"], "torch pinned .to(non_blocking)")))
            pageable = _copied(
                next(
                    (v for (d, p), v in by_key.items() if d == r["direction"] and "pageable" in p),
                    None,
                )
            )
            gbs = r.get("gb_per_s")
            shown = "no copy" if r.get("copied") is False else fmt(gbs) if gbs else "-"
            lib = r.get("library_gb_per_s")
            rows.append(
                [
                    fmt(size["size_bytes"] / MIB),
                    r["direction"].upper(),
                    r["path"],
                    f"{1e3 * r['median_s']:.3f}" if r.get("median_s") else "-",
                    shown if not r.get("error") else f"failed: {r['error'][:80]}",
                    ratio(gbs, pinned) if r.get("copied") else "-",
                    ratio(gbs, pageable) if r.get("copied") else "-",
                    f"{1e3 * r['median_host_s']:.3f}" if r.get("median_host_s") else "-",
                    fmt(lib) if lib else "-",
                ]
            )
    headers = [
        "size MiB",
        "dir",
        "path",
        "median ms",
        "GB/s",
        "vs torch pinned",
        "vs pageable",
        "host wall ms",
        "GB/s (library's own events)",
    ]
    return markdown_table(headers, rows)


def _exposure_row(
    label: str, source: str, stats: dict[str, Any], exposed_s: float, busy: str
) -> list[str]:
    """One row of table 3: copies / MiB / seconds per direction, copy, exposed, busy, fraction."""
    per_direction = [
        f"{stats[k]['copies']} / {mib(stats[k]['bytes'])} / {stats[k]['seconds']:.4f}"
        for k in ("h2d", "d2h")
    ]
    return [
        label,
        source,
        *per_direction,
        f"{stats['copy_s']:.4f}",
        f"{exposed_s:.4f}",
        busy,
        pct(stats["exposed_fraction"]),
    ]


def render_exposure(runs: dict[str, dict[str, Any]]) -> str:
    """Table 3: part (c) in detail, the profiler's view and zero3_offload's own stats."""
    rows = []
    for key, label in SYSTEMS.items():
        p = runs.get(key, {}).get("profiler_copy")
        if p:
            rows.append(
                _exposure_row(
                    label, "profiled step (trace)", p, p["exposed_s"],
                    f"{p['kernel_busy_s']:.4f} (kernels)",
                )
            )  # fmt: skip
        s = runs.get(key, {}).get("library_copy_stats")
        if s:
            rows.append(
                _exposure_row(
                    label, "own stats, timed steps (wait = exposed communication)", s,
                    min(s["exposed_wait_s"], s["copy_s"]), f"{s['compute_s']:.4f} (host intervals)",
                )
            )  # fmt: skip
    headers = [
        "system",
        "source",
        "H2D n / MiB / s",
        "D2H n / MiB / s",
        "copy s",
        "exposed copy s",
        "compute s",
        "exposed fraction",
    ]
    return markdown_table(headers, rows) if rows else "(no run produced copy figures)"


def loss_note(runs: dict[str, dict[str, Any]]) -> str:
    """The two systems' losses side by side (same model, data and seed: they should agree)."""
    a, b = (runs.get(k, {}).get("losses") or [] for k in SYSTEMS)
    n = min(len(a), len(b))
    if not n:
        return "losses: not comparable (a run produced none)"
    diff = max(abs(x - y) for x, y in zip(a[:n], b[:n], strict=True))
    shown = ", ".join(f"{x:.4f}/{y:.4f}" for x, y in zip(a[:4], b[:4], strict=False))
    names = "/".join(SYSTEMS.values())
    return f"losses {names}, first steps: {shown}; max |diff| over {n} steps {diff:.2e}"
