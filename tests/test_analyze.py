"""``zero3-offload analyze`` against the logs and the stats of one real 2-rank run.

The totals the command computes from the logs must equal what
``get_performance_stats()`` reported in the ranks at the end of the same run:
the same floats are logged and summed, so the tolerance is tight.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from helpers import make_batches, make_model, train_step

import zero3_offload.logging
from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.analyze import parse_record
from zero3_offload.cli import main
from zero3_offload.testing import RankContext, run_ranks

STEPS = 4
LR = 1e-3
MODEL = {"d": 48, "n_blocks": 3}
REL = 1e-9
HEADERS = ("layer", "fwd mean ms", "bwd total ms", "gather mean ms", "wait total ms")


def _figures(stats: Any) -> dict[str, Any]:
    return attrs.asdict(stats, filter=lambda a, _v: a.name != "timeline")


async def logged_run(ctx: RankContext, log_dir: str) -> dict[str, Any]:
    """Train STEPS steps with JSON logging on; return the stats at the end of training."""
    zero3_offload.logging.configure(json_path=Path(log_dir) / f"rank{ctx.rank}.jsonl")
    model = make_model(**MODEL)
    names = model.layer_names
    config = Zero3CpuOffloadConfig(overlap_computation=True)
    async with Zero3CpuOffloadManager(config, ctx.group, model) as manager:
        for batch in make_batches(STEPS, 8):
            # With the learning rate, CPU optimizer work overlaps the backward.
            await train_step(manager, ctx, batch, names, LR, early_lr=True)
        after_training = _figures(manager.get_performance_stats())
    # close() completes the gathers prefetched for a next step: they are logged too.
    return {
        "names": names,
        "trained": after_training,
        "closed": _figures(manager.get_performance_stats()),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[dict[str, Any]]]:
    log_dir = tmp_path_factory.mktemp("logs")
    results = asyncio.run(run_ranks(logged_run, 2, str(log_dir)))
    return [str(log_dir / f"rank{r}.jsonl") for r in range(2)], results


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zero3_offload", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _analyze_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], str]:
    assert main(["analyze", *args, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_report_equals_the_ranks_own_stats(
    run: tuple[list[str], list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    # The command's main in this process; test_user_errors_exit_2_in_one_line runs the
    # real process.
    logs, results = run
    report, _ = _analyze_json(capsys, *logs)
    assert main(["analyze", *logs]) == 0
    table = capsys.readouterr()
    assert report["skipped_lines"] == 0
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank_report, result in zip(report["ranks"], results, strict=True):
        trained, closed = result["trained"], result["closed"]
        # Layers in execution order, each total equal to the manager's own sum.
        assert [row["layer"] for row in rank_report["layers"]] == result["names"]
        for row in rank_report["layers"]:
            timing = trained["layer_timings"][row["layer"]]
            assert row["forward_count"] == timing["forward_executions"] == STEPS
            assert row["backward_count"] == timing["backward_executions"] == STEPS
            assert row["forward_total_s"] == pytest.approx(timing["total_forward_time"], rel=REL)
            assert row["backward_total_s"] == pytest.approx(timing["total_backward_time"], rel=REL)
            assert row["forward_mean_s"] == pytest.approx(
                timing["total_forward_time"] / STEPS, rel=REL
            )
        summary = rank_report["summary"]
        assert summary["compute_s"] == pytest.approx(trained["total_compute_time"], rel=REL)
        assert summary["exposed_communication_s"] == pytest.approx(
            closed["exposed_communication_time"], rel=REL
        )
        step_times = trained["step_times"]
        assert summary["steps"] == summary["updates"] == len(step_times) == STEPS
        assert summary["total_step_s"] == pytest.approx(trained["total_step_time"], rel=REL)
        assert summary["median_step_s"] == pytest.approx(statistics.median(step_times), rel=REL)
        assert summary["mean_step_s"] == pytest.approx(statistics.fmean(step_times), rel=REL)
        assert summary["training_efficiency"] == pytest.approx(
            trained["total_compute_time"] / trained["total_step_time"], rel=REL
        )
        assert summary["prefetch_hit_rate"] == trained["prefetch_hit_rate"]
        assert summary["gathered_high_water_bytes"] == trained["gathered_high_water_bytes"]
        assert summary["peak_rss_bytes"] > 0
        # Every collective of a layer is logged once, with the bytes it moved.
        work, comm = rank_report["work"], closed["communication"]
        assert work["gather"]["count"] == comm["all_gather"]["operations"]
        assert work["gather"]["bytes"] == comm["all_gather"]["bytes"]
        assert work["reduce-scatter"]["count"] == comm["reduce_scatter"]["operations"]
        assert work["reduce-scatter"]["bytes"] == comm["reduce_scatter"]["bytes"]
        assert work["cpu-optimizer"]["count"] > 0
    overall = report["overall"]["summary"]
    assert overall["compute_s"] == pytest.approx(
        sum(r["trained"]["total_compute_time"] for r in results), rel=REL
    )
    slowest = [max(t) for t in zip(*(r["trained"]["step_times"] for r in results), strict=True)]
    assert overall["median_step_s"] == pytest.approx(statistics.median(slowest), rel=REL)
    # The tables name every layer and every column.
    for name in [*results[0]["names"], *HEADERS, "training efficiency", "prefetch hit rate"]:
        assert name in table.out, name
    assert "rank 0" in table.out
    assert "rank 1" in table.out
    assert "0 line(s) skipped" in table.out


def _x_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _span_ns(event: dict[str, Any]) -> tuple[int, int]:
    start = round(event["ts"] * 1000)
    return start, start + round(event["dur"] * 1000)


def test_trace_tracks_nest_and_show_overlap(run, tmp_path, capsys) -> None:
    logs, _ = run
    out = tmp_path / "trace.json"
    assert main(["analyze", *logs, "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = _x_events(trace)
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "cat"} <= e.keys(), e
        assert e["dur"] >= 0
    meta = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {0: "rank 0", 1: "rank 1"}
    assert {(e["pid"], e["tid"]) for e in events} <= meta.keys()
    # Every interval of the logs is on the trace (instants aside).
    records = [json.loads(line) for path in logs for line in Path(path).read_text().splitlines()]
    spans = [r for r in records if r["event"] == "work" and r["end"] > r["start"]]
    assert len([e for e in events if e["cat"] != "step"]) == len(spans)
    # On each track, events nest or are disjoint.
    tracks: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in events:
        tracks.setdefault((e["pid"], e["tid"]), []).append(_span_ns(e))
    for key, track in tracks.items():
        open_ends: list[int] = []
        for start, end in sorted(track, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], (meta[key], start, end)
            open_ends.append(end)
    # Compute on the event loop overlaps communication or optimizer work on other tracks.
    computes = [e for e in events if e["cat"] == "compute"]
    others = [e for e in events if e["cat"] in ("gather", "reduce-scatter", "cpu-optimizer")]
    assert any(
        a["pid"] == b["pid"]
        and a["tid"] != b["tid"]
        and _span_ns(a)[0] < _span_ns(b)[1]
        and _span_ns(b)[0] < _span_ns(a)[1]
        for a in computes
        for b in others
    )
    assert capsys.readouterr().err.strip() == f"wrote trace: {out}"


def test_malformed_lines_are_reported_and_skipped(run, tmp_path, capsys) -> None:
    logs, _ = run
    clean, _ = _analyze_json(capsys, logs[0])
    text = Path(logs[0]).read_text()
    n = len(text.splitlines())
    damaged = tmp_path / "rank0.jsonl"
    last = text.splitlines()[-1]
    damaged.write_text(text + "this is not json\n" + last[: len(last) // 2])
    report, err = _analyze_json(capsys, str(damaged))
    assert f"{damaged}:{n + 1}: not valid JSON" in err
    assert f"{damaged}:{n + 2}: not valid JSON" in err
    assert len(err.strip().splitlines()) == 2
    assert report["skipped_lines"] == 2
    assert report["ranks"] == clean["ranks"]
    assert report["overall"] == clean["overall"]
    assert main(["analyze", str(damaged)]) == 0
    assert "2 line(s) skipped" in capsys.readouterr().out


def test_record_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="lacks 'end'"):
        parse_record(
            '{"event": "work", "rank": 0, "step": 0, "kind": "compute", "layer": "a", '
            '"phase": "forward", "start": 1.0, "seconds": 0.5, "bytes": 0, "worker": "w"}'
        )
    with pytest.raises(ValueError, match="not an object"):
        parse_record("[1, 2]")
    step = {
        "event": "step",
        "rank": "0",
        "step": 0,
        "stepped": True,
        "start": 0.0,
        "end": 1.0,
        "seconds": 1.0,
        "compute_seconds": 0.5,
        "wait_seconds": 0.1,
        "prefetch_hit_rate": 1.0,
        "gathered_high_water_bytes": 0,
    }
    with pytest.raises(ValueError, match="rank='0', expected int"):
        parse_record(json.dumps(step))
    assert parse_record(json.dumps({**step, "rank": 1})).rank == 1
    with pytest.raises(ValueError, match=r"ends .* before it starts"):
        parse_record(json.dumps({**step, "rank": 1, "end": -1.0}))
    assert parse_record('{"event": "manager_ready", "rank": 0}') == "manager_ready"


def test_plot_writes_a_png(run, tmp_path, capsys) -> None:
    logs, _ = run
    out = tmp_path / "timeline.png"
    assert main(["analyze", *logs, "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    assert f"wrote plot: {out}" in capsys.readouterr().err


def test_user_errors_exit_2_in_one_line(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.jsonl"
    proc = _cli("analyze", str(missing))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"zero3-offload analyze: error: {missing}: no such log file"
    assert "Traceback" not in proc.stderr
    assert main(["analyze", "--no-such-flag", str(missing)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--no-such-flag" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "manager_ready", "rank": 0}\n')
    assert main(["analyze", str(empty)]) == 2
    assert "no work or step event" in capsys.readouterr().err


async def logged_module_run(ctx: RankContext, log_dir: str) -> dict[str, Any]:
    """A transformers Llama in module mode, STEPS steps with JSON logging on."""
    from hf_models import batch, build, local

    zero3_offload.logging.configure(json_path=Path(log_dir) / f"rank{ctx.rank}.jsonl")
    async with Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), ctx.group, build("llama")) as m:
        for step in range(STEPS):
            x = local(batch(step, "llama"), ctx)
            out = await m.forward(input_ids=x, labels=x)
            await m.backward(out.loss)
            await m.optimizer_step(LR)
        return {"names": m.layer_names, "trained": _figures(m.get_performance_stats())}


def test_module_mode_logs_rebuild_the_ranks_own_stats(tmp_path, capsys) -> None:
    # The root unit runs around the decoder layers: its compute is logged as the
    # segments between them, so per-unit figures add up without double counting.
    pytest.importorskip("transformers")
    results = asyncio.run(run_ranks(logged_module_run, 2, str(tmp_path)))
    logs = [str(tmp_path / f"rank{r}.jsonl") for r in range(2)]
    report, _ = _analyze_json(capsys, *logs)
    for rank_report, result in zip(report["ranks"], results, strict=True):
        trained = result["trained"]
        rows = {row["layer"]: row for row in rank_report["layers"]}
        units = {"<root>", "model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"}
        assert set(rows) == set(result["names"]) == units
        for name, row in rows.items():
            timing = trained["layer_timings"][name]
            assert row["forward_count"] == timing["forward_executions"]
            assert row["backward_count"] == timing["backward_executions"]
            assert row["forward_total_s"] == pytest.approx(timing["total_forward_time"], rel=REL)
            assert row["backward_total_s"] == pytest.approx(timing["total_backward_time"], rel=REL)
        for unit in ("model.layers.0", "model.layers.1"):
            assert rows[unit]["forward_count"] == rows[unit]["backward_count"] == STEPS
        assert rows["<root>"]["forward_count"] >= 2 * STEPS  # before and after the layers
        summary = rank_report["summary"]
        assert summary["compute_s"] == pytest.approx(trained["total_compute_time"], rel=REL)
        assert summary["compute_s"] < summary["total_step_s"]  # no interval counted twice
        assert summary["steps"] == summary["updates"] == STEPS
