"""Per-layer and per-step figures computed from the logs, as tables or JSON.

Definitions (each from the ``work`` and ``step`` events; sums are plain sums
of the logged ``seconds``, so they equal what ``get_performance_stats()``
reported at the end of the same run):

Per layer (phases: forward/backward compute on the event loop's thread):

- *forward / backward total*: sum of the layer's ``compute`` intervals of that
  phase (= ``layer_timings[layer].total_forward_time`` / ``total_backward_time``);
  *mean*: total / count.
- *gather mean*: mean ``gather`` interval, from the H2D copy and decode of the
  shard through the all-gather's completion (launch to completion).
- *reduce-scatter mean*: mean ``reduce-scatter`` interval, launch to completion.
- *H2D / D2H bandwidth*: bytes / seconds of the layer's ``h2d`` / ``d2h`` copies
  (CUDA only; absent otherwise).
- *wait total*: sum of the layer's ``wait`` intervals: time the event loop's
  thread waited for a gather, a reduce-scatter or a copy (exposed communication).
  The wait at the end of a backward for every layer's reduce-scatter is logged
  with layer ``*`` and counts only in the step summary.

Per rank:

- *steps*: ``step`` events (optimizer updates, including skipped fp16 ones);
  *median / mean step time*: of their ``seconds`` (first forward of the
  accumulation window to the end of the optimizer step).
- *compute*: sum of all ``compute`` intervals; *training efficiency*: compute /
  sum of step times (= ``Zero3PerformanceStats.training_efficiency()``).
- *exposed communication*: sum of all ``wait`` intervals
  (= ``exposed_communication_time``); *fraction*: that / sum of step times.
- *prefetch hit rate*, *gathered high-water bytes*: from the last step event
  (cumulative over the run); *peak RSS / device memory*: maxima over step events.

Training (``train_step`` events of ``zero3-offload train``, the lowest rank's: each
rank logs the same whole-step figures): steps, the first and last loss, the median
tokens/s (tokens of examples or text windows, not padding), the learned (valid)
tokens summed over the steps, the mean padding fraction and the examples seen by
the last step (a run on examples).

Overall: per-layer totals and counts summed over ranks, means over every
rank's intervals; a step's time is the slowest rank's time for that step
index; efficiency and fraction are ratios of sums over ranks; hit rate is the
mean of the ranks'; high-water and peak memory are maxima over ranks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from rich.console import Group
from rich.table import Table
from rich.text import Text

from zero3_offload.analyze.logs import RunLog, StepRecord, TrainStepRecord, WorkRecord

__all__ = [
    "KindTotal",
    "LayerRow",
    "RankReport",
    "Report",
    "StepSummary",
    "TrainingSummary",
    "build_report",
    "report_tables",
    "report_to_json",
]


@attrs.frozen
class LayerRow:
    """One layer's figures (seconds; bandwidth in bytes/s; None where no interval)."""

    layer: str
    forward_count: int
    forward_mean_s: float
    forward_total_s: float
    backward_count: int
    backward_mean_s: float
    backward_total_s: float
    gather_count: int
    gather_mean_s: float
    reduce_scatter_count: int
    reduce_scatter_mean_s: float
    h2d_bytes_per_s: float | None
    d2h_bytes_per_s: float | None
    wait_total_s: float


@attrs.frozen
class StepSummary:
    """Step figures of one rank, or overall (see the module docstring)."""

    steps: int
    updates: int
    total_step_s: float
    median_step_s: float
    mean_step_s: float
    compute_s: float
    training_efficiency: float
    exposed_communication_s: float
    exposed_communication_fraction: float
    prefetch_hit_rate: float | None
    gathered_high_water_bytes: int | None
    peak_rss_bytes: int | None
    peak_device_allocated_bytes: int | None


@attrs.frozen
class TrainingSummary:
    """The ``train_step`` figures of a ``zero3-offload train`` run (see the module
    docstring); None where the logs do not hold them."""

    steps: int
    first_loss: float
    last_loss: float
    median_tokens_per_s: float | None
    valid_tokens: int | None
    mean_padding_fraction: float | None
    examples_seen: int | None


@attrs.frozen
class KindTotal:
    """Intervals of one kind: how many, their seconds and bytes."""

    count: int
    seconds: float
    bytes: int


@attrs.frozen
class RankReport:
    """Figures of one rank (``rank`` None: all ranks together)."""

    rank: int | None
    summary: StepSummary
    layers: list[LayerRow]
    work: dict[str, KindTotal]


@attrs.frozen
class Report:
    """The whole analysis."""

    files: list[str]
    ranks: list[RankReport]
    overall: RankReport
    skipped_lines: int
    other_events: dict[str, int]
    training: TrainingSummary | None = None


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _layer_rows(work: Sequence[WorkRecord]) -> list[LayerRow]:
    by: dict[tuple[str, str], list[WorkRecord]] = defaultdict(list)
    first_seen: dict[str, tuple[int, float]] = {}
    for w in work:
        key = w.kind if w.kind != "compute" else f"compute-{w.phase}"
        by[(w.layer, key)].append(w)
        # Execution order: by first forward compute, then by first appearance.
        rank_key = (0 if key == "compute-forward" else 1, w.start)
        first_seen[w.layer] = min(first_seen.get(w.layer, rank_key), rank_key)

    def total(layer: str, kind: str) -> tuple[int, float, int]:
        items = by.get((layer, kind), [])
        return len(items), sum(w.seconds for w in items), sum(w.nbytes for w in items)

    def bandwidth(layer: str, kind: str) -> float | None:
        n, seconds, nbytes = total(layer, kind)
        return (nbytes / seconds if seconds > 0 else 0.0) if n else None

    rows = []
    # Layer "*" marks waits for all layers at once (the end of a backward): they
    # count in the step summary's exposed communication, not in a layer's row.
    for layer in sorted((n for n in first_seen if n != "*"), key=first_seen.__getitem__):
        fn, ft, _ = total(layer, "compute-forward")
        bn, bt, _ = total(layer, "compute-backward")
        gn, gt, _ = total(layer, "gather")
        rn, rt, _ = total(layer, "reduce-scatter")
        rows.append(
            LayerRow(
                layer=layer,
                forward_count=fn,
                forward_mean_s=_ratio(ft, fn),
                forward_total_s=ft,
                backward_count=bn,
                backward_mean_s=_ratio(bt, bn),
                backward_total_s=bt,
                gather_count=gn,
                gather_mean_s=_ratio(gt, gn),
                reduce_scatter_count=rn,
                reduce_scatter_mean_s=_ratio(rt, rn),
                h2d_bytes_per_s=bandwidth(layer, "h2d"),
                d2h_bytes_per_s=bandwidth(layer, "d2h"),
                wait_total_s=total(layer, "wait")[1],
            )
        )
    return rows


def _kind_totals(work: Iterable[WorkRecord]) -> dict[str, KindTotal]:
    acc: dict[str, list[float]] = {}
    for w in work:
        entry = acc.setdefault(w.kind, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += w.seconds
        entry[2] += w.nbytes
    return {k: KindTotal(int(v[0]), v[1], int(v[2])) for k, v in sorted(acc.items())}


def _peak(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _summary(
    step_seconds: Sequence[float], steps: Sequence[StepRecord], work: dict[str, KindTotal]
) -> StepSummary:
    total_step = sum(step_seconds)
    compute = work["compute"].seconds if "compute" in work else 0.0
    wait = work["wait"].seconds if "wait" in work else 0.0
    return StepSummary(
        steps=len(step_seconds),
        updates=sum(s.stepped for s in steps),
        total_step_s=total_step,
        median_step_s=statistics.median(step_seconds) if step_seconds else 0.0,
        mean_step_s=_ratio(total_step, len(step_seconds)),
        compute_s=compute,
        training_efficiency=_ratio(compute, total_step),
        exposed_communication_s=wait,
        exposed_communication_fraction=_ratio(wait, total_step),
        prefetch_hit_rate=steps[-1].prefetch_hit_rate if steps else None,
        gathered_high_water_bytes=_peak(s.gathered_high_water_bytes for s in steps),
        peak_rss_bytes=_peak(s.process_rss_bytes for s in steps),
        peak_device_allocated_bytes=_peak(s.device_allocated_bytes for s in steps),
    )


def _training(records: Sequence[TrainStepRecord]) -> TrainingSummary | None:
    if not records:
        return None
    first_rank = min(r.rank for r in records)
    steps = [r for r in records if r.rank == first_rank]
    rates = [r.tokens_per_s for r in steps if r.tokens_per_s is not None]
    valid = [r.valid_tokens for r in steps if r.valid_tokens is not None]
    padding = [r.padding_fraction for r in steps if r.padding_fraction is not None]
    seen = [r.examples_seen for r in steps if r.examples_seen is not None]
    return TrainingSummary(
        steps=len(steps),
        first_loss=steps[0].loss,
        last_loss=steps[-1].loss,
        median_tokens_per_s=statistics.median(rates) if rates else None,
        valid_tokens=sum(valid) if valid else None,
        mean_padding_fraction=statistics.fmean(padding) if padding else None,
        examples_seen=seen[-1] if seen else None,
    )


def build_report(log: RunLog) -> Report:
    """Compute every figure of the module docstring from ``log``."""
    per_rank = []
    for rank in log.ranks:
        work = [w for w in log.work if w.rank == rank]
        steps = [s for s in log.steps if s.rank == rank]  # in order of their end
        totals = _kind_totals(work)
        summary = _summary([s.seconds for s in steps], steps, totals)
        per_rank.append(RankReport(rank, summary, _layer_rows(work), totals))
    slowest: dict[int, float] = {}
    for s in log.steps:
        slowest[s.step] = max(slowest.get(s.step, 0.0), s.seconds)
    totals = _kind_totals(log.work)
    sums = [r.summary for r in per_rank]
    base = _summary([slowest[k] for k in sorted(slowest)], log.steps, totals)
    rank_rates = [r.prefetch_hit_rate for r in sums if r.prefetch_hit_rate is not None]
    step_total = sum(r.total_step_s for r in sums)
    overall = attrs.evolve(
        base,
        updates=max((r.updates for r in sums), default=0),
        training_efficiency=_ratio(base.compute_s, step_total),
        exposed_communication_fraction=_ratio(base.exposed_communication_s, step_total),
        prefetch_hit_rate=statistics.fmean(rank_rates) if rank_rates else None,
    )
    return Report(
        files=list(log.files),
        ranks=per_rank,
        overall=RankReport(None, overall, _layer_rows(log.work), totals),
        skipped_lines=len(log.skipped),
        other_events=dict(sorted(log.other_events.items())),
        training=_training(log.train_steps),
    )


def report_to_json(report: Report) -> dict[str, Any]:
    """A JSON-serializable dict with stable keys (seconds, bytes, bytes/s, fractions)."""
    return {"format": "zero3-offload-analyze/1", **attrs.asdict(report)}


# ----------------------------------------------------------------- rendering


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _layer_table(rows: Sequence[LayerRow]) -> Table:
    h2d = any(r.h2d_bytes_per_s is not None for r in rows)
    d2h = any(r.d2h_bytes_per_s is not None for r in rows)
    table = Table()
    table.add_column("layer", no_wrap=True)
    for header in (
        "fwd n",
        "fwd mean ms",
        "fwd total ms",
        "bwd n",
        "bwd mean ms",
        "bwd total ms",
        "gather mean ms",
        "reduce-scatter mean ms",
        *(["H2D GB/s"] if h2d else []),
        *(["D2H GB/s"] if d2h else []),
        "wait total ms",
    ):
        table.add_column(header, justify="right")

    def gbps(value: float | None) -> list[str]:
        return ["-" if value is None else f"{value / 1e9:.2f}"]

    for r in rows:
        table.add_row(
            r.layer,
            str(r.forward_count),
            _ms(r.forward_mean_s),
            _ms(r.forward_total_s),
            str(r.backward_count),
            _ms(r.backward_mean_s),
            _ms(r.backward_total_s),
            _ms(r.gather_mean_s) if r.gather_count else "-",
            _ms(r.reduce_scatter_mean_s) if r.reduce_scatter_count else "-",
            *(gbps(r.h2d_bytes_per_s) if h2d else []),
            *(gbps(r.d2h_bytes_per_s) if d2h else []),
            _ms(r.wait_total_s),
        )
    return table


def _summary_table(report: Report) -> Table:
    columns = [*((f"rank {r.rank}", r.summary) for r in report.ranks), ("overall", None)]
    table = Table()
    table.add_column("metric", no_wrap=True)
    for name, _ in columns:
        table.add_column(name, justify="right")
    rows: list[tuple[str, Any]] = [
        ("steps", lambda s: str(s.steps)),
        ("updates", lambda s: str(s.updates)),
        ("median step ms", lambda s: _ms(s.median_step_s)),
        ("mean step ms", lambda s: _ms(s.mean_step_s)),
        ("compute ms", lambda s: _ms(s.compute_s)),
        ("training efficiency", lambda s: _pct(s.training_efficiency)),
        ("exposed communication ms", lambda s: _ms(s.exposed_communication_s)),
        ("exposed communication / step", lambda s: _pct(s.exposed_communication_fraction)),
        ("prefetch hit rate", lambda s: _pct(s.prefetch_hit_rate)),
        ("gathered high-water MiB", lambda s: _mib(s.gathered_high_water_bytes)),
        ("peak RSS MiB", lambda s: _mib(s.peak_rss_bytes)),
        ("peak device allocated MiB", lambda s: _mib(s.peak_device_allocated_bytes)),
    ]
    summaries = [s if s is not None else report.overall.summary for _, s in columns]
    for label, fmt in rows:
        table.add_row(label, *(fmt(s) for s in summaries))
    return table


def _training_table(training: TrainingSummary) -> Table:
    table = Table()
    table.add_column("metric", no_wrap=True)
    table.add_column("value", justify="right")

    def count(value: int | float | None, spec: str = ",.0f") -> str:
        return "-" if value is None else format(value, spec)

    for label, text in (
        ("steps", str(training.steps)),
        ("loss first -> last", f"{training.first_loss:.4f} -> {training.last_loss:.4f}"),
        ("median tokens/s", count(training.median_tokens_per_s)),
        ("valid tokens", count(training.valid_tokens)),
        ("mean padding fraction", _pct(training.mean_padding_fraction)),
        ("examples seen", count(training.examples_seen)),
    ):
        table.add_row(label, text)
    return table


def _titled(title: str, table: Table) -> Group:
    # A title of its own line: rich pads a table's title to the table's width.
    return Group(Text(title, style="bold"), table)


def report_tables(report: Report) -> list[Group]:
    """Rich renderables: layers of each rank, of all ranks, the step summary, then the
    training figures (``zero3-offload train`` logs)."""
    tables = [_titled(f"Layers, rank {r.rank}", _layer_table(r.layers)) for r in report.ranks]
    if len(report.ranks) > 1:
        tables.append(_titled("Layers, all ranks", _layer_table(report.overall.layers)))
    tables.append(_titled("Steps", _summary_table(report)))
    if report.training is not None:
        tables.append(_titled("Training", _training_table(report.training)))
    return tables
