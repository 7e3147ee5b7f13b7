"""A PNG of the last steps' timeline per rank and memory over the run (matplotlib, Agg).

matplotlib is an optional dependency (``pip install 'zero3_offload[plot]'``);
it is imported only when a plot is drawn, and no global matplotlib state
(``pyplot``, ``matplotlib.use``) is touched: the figure has its own Agg canvas.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zero3_offload.analyze.logs import RunLog, StepRecord
from zero3_offload.analyze.trace import assign_tracks, origin_of
from zero3_offload.errors import InputError, Zero3Error

__all__ = ["KIND_COLORS", "PlotUnavailableError", "chosen_steps", "plot_run", "require_matplotlib"]

KIND_COLORS = {
    "compute": "#1f77b4",
    "wait": "#d62728",
    "gather": "#2ca02c",
    "reduce-scatter": "#9467bd",
    "cpu-optimizer": "#ff7f0e",
    "compress": "#8c564b",
    "grad-accumulate": "#e377c2",
    "h2d": "#17becf",
    "d2h": "#bcbd22",
}
_OTHER_COLOR = "#7f7f7f"


class PlotUnavailableError(Zero3Error):
    """matplotlib is not installed."""


def require_matplotlib() -> tuple[Any, Any, Any]:
    """matplotlib's Figure, Agg canvas and Patch classes.

    Raises:
        PlotUnavailableError: when matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed: pip install 'zero3_offload[plot]'"
        ) from exc
    return Figure, FigureCanvasAgg, Patch


def chosen_steps(steps: Sequence[StepRecord], count: int) -> list[int]:
    """The step indices drawn: the last ``count``, skipping the first (warm-up) when possible."""
    indices = sorted({s.step for s in steps})
    if len(indices) > count:
        return indices[-count:]
    return indices[1:] if len(indices) > 1 else indices


def plot_run(log: RunLog, path: str | Path, *, steps: int = 2) -> list[int]:
    """Draw each rank's tracks during the chosen steps, and memory per step, into a PNG.

    Args:
        log: the records.
        path: the PNG to write.
        steps: how many of the last steps to draw (the first step, usually
            slower for warm-up, is left out when there are more).

    Returns:
        The step indices drawn.

    Raises:
        PlotUnavailableError: when matplotlib is not installed.
        ValueError: when the log has no step event to draw.
        OSError: when ``path`` cannot be written.
    """
    figure_cls, canvas_cls, patch_cls = require_matplotlib()
    chosen = chosen_steps(log.steps, steps)
    windows = {}
    for rank in log.ranks:
        mine = [s for s in log.steps if s.rank == rank and s.step in chosen]
        if mine:
            windows[rank] = (min(s.start for s in mine), max(s.end for s in mine))
    if not windows:
        raise InputError("the logs hold no step event: nothing to plot")
    origin = origin_of(log)
    tracks = assign_tracks(log, origin)
    zero = min(lo for lo, _ in windows.values())
    heights = [max(1.5, 0.3 * len(tracks.get(r, [])) + 0.8) for r in windows] + [2.6]
    fig = figure_cls(figsize=(13, sum(heights) + 0.6), dpi=110, layout="constrained")
    canvas_cls(fig)
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    kinds_seen: set[str] = set()
    for ax, (rank, (lo, hi)) in zip(axes, windows.items(), strict=False):
        # Lanes used only outside the drawn steps would be empty rows.
        rank_tracks = [
            t
            for t in tracks.get(rank, [])
            if t.tid == 1 or any(w.start < hi and w.end > lo for w in t.events)
        ]
        for y, track in enumerate(rank_tracks):
            bars: dict[str, list[tuple[float, float]]] = {}
            for w in track.events:
                a, b = max(w.start, lo), min(w.end, hi)
                if b > a:
                    bars.setdefault(w.kind, []).append(((a - zero) * 1e3, (b - a) * 1e3))
            for kind, spans in bars.items():
                kinds_seen.add(kind)
                color = KIND_COLORS.get(kind, _OTHER_COLOR)
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, linewidth=0)
        for s in log.steps:
            if s.rank == rank and s.step in chosen:
                ax.axvline((s.start - zero) * 1e3, color="black", linewidth=0.6, linestyle=":")
        ax.set_yticks(range(len(rank_tracks)), [t.name for t in rank_tracks], fontsize=8)
        ax.set_ylim(len(rank_tracks) - 0.5, -0.5)
        ax.set_xlim((lo - zero) * 1e3, (hi - zero) * 1e3)
        shown = ", ".join(map(str, chosen))
        ax.set_title(f"rank {rank}: step{'s' if len(chosen) > 1 else ''} {shown}", fontsize=10)
        ax.set_xlabel("ms since the first drawn step began", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    handles = [
        patch_cls(color=KIND_COLORS.get(k, _OTHER_COLOR), label=k) for k in sorted(kinds_seen)
    ]
    if handles:
        fig.legend(handles=handles, loc="outside upper center", fontsize=8, ncol=len(handles))
    _memory(axes[-1], log, origin)
    fig.savefig(path, format="png")
    return chosen


def _memory(ax: Any, log: RunLog, origin: float) -> None:
    series = (
        ("process_rss_bytes", "RSS", "#1f77b4"),
        ("cpu_memory_used", "CPU held by the manager", "#ff7f0e"),
        ("gathered_high_water_bytes", "gathered high-water", "#2ca02c"),
        ("device_allocated_bytes", "device allocated", "#d62728"),
    )
    styles = ("-", "--", "-.", ":")
    for i, rank in enumerate(log.ranks):
        mine = [s for s in log.steps if s.rank == rank]
        x = [s.end - origin for s in mine]
        for key, label, color in series:
            values = [getattr(s, key) for s in mine]
            # A log axis: series with a missing or zero value (no device) are left out.
            if not values or any(v is None or v <= 0 for v in values):
                continue
            ax.plot(
                x,
                [v / 2**20 for v in values],
                linestyle=styles[i % len(styles)],
                color=color,
                marker=".",
                label=f"rank {rank} {label}",
            )
    ax.set_xlabel("seconds since the run's first logged interval (at each step's end)", fontsize=8)
    ax.set_ylabel("MiB", fontsize=8)
    ax.set_title("memory per step", fontsize=10)
    ax.set_yscale("log")
    ax.tick_params(labelsize=8)
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
