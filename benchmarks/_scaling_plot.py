"""``scaling.py``'s plot: step time and peak RSS per rank against parameters (log-log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import fmt_rate
from _peers_report import MIB
from _peers_run import System
from _scaling_run import TORCH_KEY, Size


def _log_axes(ax: Any, params: list[int], y_fmt: str) -> None:
    """Log-log axes: x ticks at the measured sizes, y ticks at 1-2-5 steps, no minor labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(params))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_rate(v)))
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format(v, y_fmt)))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("parameters")
    ax.grid(True, which="both", alpha=0.3)


def plot(
    path: Path,
    sizes: list[Size],
    systems: dict[str, System],
    by_size: dict[str, dict[str, Any]],
    title: str,
    cores: int,
) -> None:
    """Two panels against parameters (log-log): median step time; peak RSS per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.4))
    for key, (label, _, world, _) in systems.items():
        if key != TORCH_KEY and world > cores:
            label += f" ({world} ranks on {cores} cores)"
        pts = [
            (by_size[sz.name]["params"], by_size[sz.name]["systems"][key])
            for sz in sizes
            if key in by_size[sz.name]["systems"]
        ]
        if not pts:
            continue
        xs = [p for p, _ in pts]
        style = {"marker": "o", "label": label}
        if key == TORCH_KEY:
            style.update({"color": "black", "linestyle": "--", "marker": "s"})
        ax_t.plot(xs, [s["median_step_s"] for _, s in pts], **style)
        ax_m.plot(xs, [s["peak_rss_bytes"] / MIB for _, s in pts], **style)
    params = [by_size[sz.name]["params"] for sz in sizes]
    _log_axes(ax_t, params, ".3g")
    _log_axes(ax_m, params, ",.0f")
    ax_t.set_ylabel("median step time (s)")
    ax_m.set_ylabel("peak RSS per rank (MiB, VmHWM)")
    ax_t.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
