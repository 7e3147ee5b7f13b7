"""Summary, table and notes of ``bench_consolidate.py``."""

from __future__ import annotations

import statistics
from typing import Any

from _common import markdown_table
from _consolidate_cases import (
    BASELINE,
    CASES,
    LN_AFTER,
    PT_FILE,
    SAMPLE_INTERVAL_S,
    ST_FILE,
    STREAM,
    WORLD,
)

MIB = 2**20


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def summarize(
    rounds: list[dict[str, Any]], model_bytes: int, largest: int
) -> tuple[dict[str, dict[str, Any]], str, float, float]:
    """Per case: medians of the measured rounds; the markdown table; the baseline's peaks."""
    measured_rounds = [rd for rd in rounds if not rd["warmup"]]

    def col(label: str, key: str) -> list[float]:
        vals = []
        for rd in measured_rounds:
            res = rd["cases"][label]
            vals.append(
                res["sampled_peak_bytes"][key] if key in ("RssAnon", "RssFile") else res[key]
            )
        return vals

    base_rss = _median(col(BASELINE, "peak_rss_bytes"))
    base_anon = _median(col(BASELINE, "RssAnon"))
    summary = {}
    rows = []
    for label in CASES:
        peak = _median(col(label, "peak_rss_bytes"))
        anon = _median(col(label, "RssAnon"))
        file_peak = _median(col(label, "RssFile"))
        wall = _median(col(label, "wall_s"))
        fsync = _median(col(label, "fsync_s"))
        s = {
            "wall_s_median": wall,
            "wall_s": col(label, "wall_s"),
            "fsync_s_median": fsync,
            "fsync_s": col(label, "fsync_s"),
            "process_s": col(label, "process_s"),
            "peak_rss_bytes_median": peak,
            "peak_rss_bytes": col(label, "peak_rss_bytes"),
            "peak_rss_minus_baseline_bytes": peak - base_rss,
            "peak_rss_minus_baseline_over_model": (peak - base_rss) / model_bytes,
            "peak_rss_minus_baseline_over_largest": (peak - base_rss) / largest,
            "peak_anon_bytes_median": anon,
            "peak_anon_bytes": col(label, "RssAnon"),
            "peak_anon_minus_baseline_bytes": anon - base_anon,
            "peak_anon_minus_baseline_over_model": (anon - base_anon) / model_bytes,
            "peak_anon_minus_baseline_over_largest": (anon - base_anon) / largest,
            "peak_file_rss_bytes_median": file_peak,
        }
        summary[label] = s
        is_base = label == BASELINE
        rows.append(
            [
                label,
                "-" if is_base else f"{wall:.3f}",
                f"{fsync:.3f}" if fsync else "-",
                _mib(peak),
                "-" if is_base else _mib(peak - base_rss),
                "-" if is_base else f"{s['peak_rss_minus_baseline_over_model']:.2f}",
                "-" if is_base else f"{s['peak_rss_minus_baseline_over_largest']:.2f}",
                _mib(anon),
                "-" if is_base else _mib(anon - base_anon),
                "-" if is_base else f"{s['peak_anon_minus_baseline_over_model']:.2f}",
                "-" if is_base else f"{s['peak_anon_minus_baseline_over_largest']:.2f}",
            ]
        )
    headers = [
        "case",
        "wall s",
        "of which fsync s",
        "peak RSS MiB",
        "- baseline MiB",
        "/ model",
        "/ largest",
        "peak anon MiB",
        "- baseline MiB",
        "/ model",
        "/ largest",
    ]
    table = markdown_table(headers, rows)
    return summary, table, base_rss, base_anon


def make_notes(
    args: Any,
    rounds: list[dict[str, Any]],
    widths: tuple[int, ...],
    n_layers: int,
    sizes: dict[str, int],
    largest_name: str,
    ckpt_files: dict[str, int],
    out_sizes: dict[str, int],
) -> list[str]:
    """The notes printed above the table and written under it."""
    model_bytes = sum(sizes.values())
    largest = sizes[largest_name]
    measured_rounds = [rd for rd in rounds if not rd["warmup"]]
    threads = measured_rounds[0]["cases"][STREAM]["torch_threads"]
    notes = [
        f"model: {n_layers} layers (nn.Linear widths {' -> '.join(map(str, widths))}, "
        f"LayerNorm after fc{', fc'.join(map(str, LN_AFTER))}), {len(sizes)} tensors, "
        f"{model_bytes:,} bytes fp32 ({_mib(model_bytes)} MiB); largest tensor "
        f"{largest_name}: {largest:,} bytes ({_mib(largest)} MiB).",
        f"checkpoint: saved by Zero3CpuOffloadManager on {WORLD} gloo ranks right after "
        f"construction (no optimizer state yet), {sum(ckpt_files.values()):,} bytes in "
        f"{len(ckpt_files)} files; outputs {out_sizes[ST_FILE]:,} bytes (.safetensors) and "
        f"{out_sizes[PT_FILE]:,} bytes (.pt). Read from the page cache (just written).",
        f"each case a fresh process ({threads} torch threads); medians of {args.repeats} "
        f"round(s) after {args.warmup} warm-up round(s), cases interleaved.",
        "peak RSS = the child's VmHWM (includes mapped file pages; ru_maxrss would include "
        "the parent's peak, see the script); peak anon = RssAnon "
        f"of /proc/<pid>/status sampled every {SAMPLE_INTERVAL_S * 1000:g} ms by the parent; "
        "'- baseline' subtracts the baseline process's median (imports only); "
        "'/ model' and '/ largest' divide that by the model's and the largest tensor's bytes.",
        "wall s = time.perf_counter around the call only (no interpreter start or imports); "
        "the safetensors path fsyncs its output (timed apart by wrapping os.fsync in the "
        "child), torch.save does not.",
        "verified: both outputs hold exactly the model's state-dict names, load strict=True, "
        "and every tensor's SHA-256 equals the original model's.",
    ]
    return notes
