"""``zero3-offload analyze``: per-layer and per-step figures, traces and plots from logs.

Reads the JSON-lines logs written by ranks that called
``zero3_offload.logging.configure(json_path=...)`` (the events are described
in ``docs/observability.md``). matplotlib is imported only when a plot is drawn.
"""

from zero3_offload.analyze.logs import (
    RunLog,
    SkippedLine,
    StepRecord,
    TrainStepRecord,
    WorkRecord,
    parse_record,
    read_logs,
)
from zero3_offload.analyze.plot import PlotUnavailableError, plot_run
from zero3_offload.analyze.report import (
    LayerRow,
    RankReport,
    Report,
    StepSummary,
    TrainingSummary,
    build_report,
    report_tables,
    report_to_json,
)
from zero3_offload.analyze.trace import Track, assign_tracks, build_trace, write_trace

__all__ = [
    "LayerRow",
    "PlotUnavailableError",
    "RankReport",
    "Report",
    "RunLog",
    "SkippedLine",
    "StepRecord",
    "StepSummary",
    "Track",
    "TrainStepRecord",
    "TrainingSummary",
    "WorkRecord",
    "assign_tracks",
    "build_report",
    "build_trace",
    "parse_record",
    "plot_run",
    "read_logs",
    "report_tables",
    "report_to_json",
    "write_trace",
]
