"""The fault table: every injected fault, whether and how fast it was noticed, and what was lost.

python benchmarks/faults.py                 # default settings (heartbeat_timeout_s 5): ~10 minutes
python benchmarks/faults.py --quick         # a subset, heartbeat 1 s: ~2 minutes
python benchmarks/faults.py --only stop     # rows whose fault name contains "stop"

Each row runs real rank processes (gloo on 127.0.0.1) through the library's public calls:

* kill -9 / SIGSTOP of rank 0 or rank 1 in a forward, a backward, an optimizer step
  (the gradient-norm all-reduce of clipping) and a checkpoint save: the time from the
  fault to the surviving rank's CommunicationError, its message, and whether the last
  committed checkpoint loads and a resumed run ends bitwise equal to an uninterrupted one;
* ranks whose calls diverge (different layers, grad mode, call, a skipped micro-step,
  same-sized layers): RankDivergenceError on every rank, the processes alive;
* kill -9 of a rank at each step of a checkpoint save, and a full disk (ENOSPC) at each
  write of a save: the previous checkpoint loads and training resumes bitwise;
* hostile checkpoint directories: refused with CheckpointError before anything is allocated.

The table goes to stdout and to benchmarks/results/faults.md (and .json); the README
links it. A row fails when a fault goes unnoticed, a process crashes, a run hangs (a
rank run that hits its limit) or data is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the rank functions of the fault tests

import torch  # noqa: E402
from fault_points import (  # noqa: E402
    CONTINUE,
    DISTINCT,
    OTHER_RANK_POINTS,
    RANK0_POINTS,
    WRITE_SITES,
    committed,
    kill,
    no_space,
    replay,
    save,
    save_failing,
    step,
)
from helpers import run_in_turn  # noqa: E402
from rank_faults import KINDS, PHASES, FaultSpec, faulty_run, read_record, resumed_run  # noqa: E402
from test_checkpoint_hostile import HOSTILE, _meta, load_one, save_one  # noqa: E402
from test_divergence import CASES, diverge  # noqa: E402

from zero3_offload.checkpoint.format import resolve_checkpoint  # noqa: E402
from zero3_offload.testing import RankFailedError, run_ranks  # noqa: E402

RESULTS = HERE / "results"
RUN_LIMIT_S = 300.0  # a rank run still going after this long counts as a hang


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[list[Any] | None, str | None]:
    """``run_ranks`` of ``fn``: (results, None), or (None, why it failed)."""
    try:
        return asyncio.run(run_ranks(fn, 2, *args, timeout_s=RUN_LIMIT_S, **kw)), None
    except RankFailedError as exc:
        text = str(exc)
        return None, "hang" if "did not finish within" in text else text.splitlines()[0]


def rank_fault_rows(heartbeat_s: float, only: str, reference: dict) -> list[dict[str, Any]]:
    rows = []
    for kind in KINDS:
        for rank in (0, 1):
            for phase in PHASES:
                name = f"{'kill -9' if kind == 'kill' else 'SIGSTOP'} rank {rank} in {phase}"
                if only.lower() not in name.lower():
                    continue
                with tempfile.TemporaryDirectory(prefix="zero3-fault-") as out:
                    spec = FaultSpec(
                        out=out, kind=kind, rank=rank, phase=phase, heartbeat_s=heartbeat_s
                    )
                    results, failure = _run(faulty_run, spec, may_die={rank})
                    fault = read_record(out, "fault")
                    survivor = None if results is None else results[1 - rank]
                    detected = bool(survivor and survivor.get("error") and fault)
                    seconds = message = None
                    if detected:
                        seconds = survivor["detected_at"] - fault["at"]
                        message = f"{survivor['error']}: {survivor['message']}"
                    resumed, why = _run(resumed_run, spec)
                    intact = resumed is not None and _bitwise(
                        resumed[0]["state"], reference["state"]
                    )
                    lost = "none" if intact else f"resume failed: {why or 'not bitwise'}"
                    message = message or failure or "no error raised"
                    rows.append(
                        _row(name, detected, message, lost, failure=failure, seconds=seconds)
                    )
    return rows


def divergence_rows(only: str) -> list[dict[str, Any]]:
    rows = []
    for case in CASES:
        name = f"ranks diverge: {case.replace('_', ' ')}"
        if only.lower() not in name.lower():
            continue
        with tempfile.TemporaryDirectory(prefix="zero3-diverge-") as tmp:
            started = time.perf_counter()
            results, failure = _run(diverge, case, tmp)
            took = time.perf_counter() - started
        errors = [r.get("error") for r in results or []]
        detected = bool(errors) and all(e == "RankDivergenceError" for e in errors)
        message = f"RankDivergenceError: {results[0]['message']}" if results else failure
        lost = "none (nothing launched; processes alive)" if detected else "?"
        # Detected before anything launched: no detection time; the whole run took `took`.
        rows.append(_row(name, detected, message, lost, failure=failure) | {"run_s": took})
    return rows


def _row(
    fault: str,
    detected: bool,
    message: str | None,
    lost: str,
    *,
    failure: str | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """A row of the table (``failure``: how the faulty run's ``run_ranks`` failed, if it did),
    printed as it is made."""
    row = {
        "fault": fault,
        "detected": detected,
        "seconds": seconds,
        "message": message or "",
        "crashed": int(failure is not None and failure != "hang"),
        "hang": int(failure == "hang"),
        "lost": lost,
    }
    progress(row)
    return row


AFTER = ((step, 10), (step, 11))  # what the references and the resumed runs train last


def save_kill_rows(only: str) -> list[dict[str, Any]]:
    """kill -9 of a rank at each step of a save: what ``latest`` resolves to, and a
    resumed run against the uninterrupted run that saved that checkpoint last."""
    points = [(0, p) for p in RANK0_POINTS] + [(1, p) for p in OTHER_RANK_POINTS]
    points = [(r, p) for r, p in points if only.lower() in f"kill -9 rank {r} at {p}".lower()]
    if not points:
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero3-savekill-") as tmp:
        refs = {
            "A": (*DISTINCT[:3], *AFTER),  # the save of B never committed
            "B": (*DISTINCT, (save,), *AFTER),
        }
        ref_runs = asyncio.run(
            run_in_turn(2, *((replay, f"{tmp}/ref-{k}", h) for k, h in refs.items()))
        )
        reference = dict(zip(refs, ref_runs, strict=True))
        for rank, point in points:
            root, marker = Path(tmp) / f"{rank}-{point.replace(':', '-')}", Path(tmp) / "marker"
            history = (*DISTINCT, (kill, rank, point, str(marker)), (save,))
            _, failure = _run(replay, str(root), history)
            died = failure is not None and marker.is_file() and marker.read_text() == point
            name = resolve_checkpoint(root).name
            resumed, why = _run(replay, str(root), CONTINUE)
            want = reference["B" if committed(point, same_name=False) else "A"]
            intact = (
                resumed is not None
                and [r["losses"][-2:] for r in resumed] == [r["losses"][-2:] for r in want]
                and _bitwise(resumed[0]["state"], want[0]["state"])
            )
            lost = "none" if intact else f"resume failed: {why or 'not bitwise'}"
            fault = f"kill -9 rank {rank} at {point} of a save"
            # The killed rank's death is the expected failure of that run: not a crash.
            failure = "hang" if failure == "hang" else None
            rows.append(_row(fault, died, f"latest resolves to {name}", lost, failure=failure))
    return rows


def full_disk_rows(only: str) -> list[dict[str, Any]]:
    """ENOSPC at each write of a save, in one run that then trains on and saves."""
    failing = [(1, "shard"), *((0, site) for site in WRITE_SITES)]
    failing = [(r, s) for r, s in failing if only.lower() in f"enospc rank {r} {s}".lower()]
    if not failing:
        return []
    with tempfile.TemporaryDirectory(prefix="zero3-enospc-") as tmp:
        history = (
            *DISTINCT,
            *(a for rank, site in failing for a in ((no_space, rank, site), (save_failing,))),
            (step, 3),
            (save,),
        )
        runs, failure = _run(replay, f"{tmp}/ckpt", history)
        reference, _ = _run(replay, f"{tmp}/ref", (*DISTINCT, (step, 3), (save,), *AFTER))
        resumed, why = _run(replay, f"{tmp}/ckpt", CONTINUE)
    intact = (
        resumed is not None
        and reference is not None
        and _bitwise(resumed[0]["state"], reference[0]["state"])
    )
    rows = []
    for i, (rank, site) in enumerate(failing):
        errors = runs[rank]["errors"] if runs else []
        message = f"CheckpointError: {errors[i]}" if len(errors) > i else failure
        lost = "none (trained on, saved, resumed bitwise)" if intact else f"{why}"
        fault = f"ENOSPC on rank {rank} writing the {site} of a save"
        rows.append(_row(fault, len(errors) > i, message, lost, failure=failure))
    return rows


def hostile_rows(only: str) -> list[dict[str, Any]]:
    """Hostile checkpoint directories, each loaded by 2 ranks: refused before allocating."""
    cases = {f"hostile checkpoint: {k}": v for k, v in HOSTILE.items()}
    cases = {k: v for k, v in cases.items() if only.lower() in k.lower()}
    if not cases:
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero3-hostile-") as tmp:
        saved = Path(asyncio.run(run_ranks(save_one, 2, f"{tmp}/ok"))[0])
        paths = []
        for i, change in enumerate(cases.values()):
            bad = Path(tmp) / f"bad{i}"
            shutil.copytree(saved, bad)
            _meta(bad, change)
            paths.append(str(bad))
        truncated = Path(tmp) / "truncated"
        shutil.copytree(saved, truncated)
        shard = next(p for p in truncated.iterdir() if p.name.startswith("rank-00001"))
        shard.write_bytes(shard.read_bytes()[:-64])  # the header promises 64 more bytes
        cases["hostile checkpoint: tensor bytes shorter than their header"] = None
        paths.append(str(truncated))
        started = time.perf_counter()
        results = asyncio.run(run_in_turn(2, *((load_one, p) for p in paths)))
        took = time.perf_counter() - started
    for name, per_rank in zip(cases, results, strict=True):
        refused = all(r.startswith("CheckpointError") for r in per_rank)
        message = next((r for r in per_rank if "another rank" not in r), per_rank[0])
        lost = "none (refused; the manager unchanged)" if refused else "LOADED"
        rows.append(_row(name, refused, message, lost) | {"run_s": took / len(paths)})
    return rows


def progress(row: dict[str, Any]) -> None:
    seconds = row.get("seconds")
    took = f"{seconds:.2f} s" if isinstance(seconds, float) else "-"
    print(f"[faults] {row['fault']}: detected={row['detected']} {took} lost={row['lost']}",
          file=sys.stderr, flush=True)  # fmt: skip


def markdown(payload: dict[str, Any]) -> str:
    rows, cfg = payload["rows"], payload["config"]
    lines = [
        "# Fault table",
        "",
        f"`python benchmarks/faults.py{' --quick' if cfg['quick'] else ''}`: "
        f"heartbeat_timeout_s {cfg['heartbeat_timeout_s']:g}, collective_timeout_s 300, "
        f"2 gloo ranks on 127.0.0.1; {payload['machine']}; took {payload['wall_s']:.0f} s.",
        "",
        "| fault | detected | seconds to detection | message (first 300 characters) | data lost |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        seconds = r.get("seconds")
        shown = f"{seconds:.2f}" if isinstance(seconds, float) else "-"
        message = (r.get("message") or "").replace("|", "\\|")
        message = message.replace("they were about to run different collectives; ", "")
        message = message if len(message) <= 300 else message[:297] + "..."
        lines.append(
            f"| {r['fault']} | {'yes' if r['detected'] else 'NO'} | {shown} | {message} | "
            f"{r['lost']} |"
        )
    s = payload["summary"]
    lines += [
        "",
        f"Faults: {s['faults']}; detected: {s['detected']}; slowest detection: "
        f"{s['slowest_s']:.2f} s; crashed processes: {s['crashed']}; hangs: {s['hangs']}; "
        f"rows with data lost: {s['lost']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="heartbeat 1 s and a subset")
    parser.add_argument("--only", default="", help="rows whose fault name contains this")
    parser.add_argument("--heartbeat-timeout-s", type=float, help="(5; quick 1)")
    parser.add_argument("--out", type=Path, help="results JSON (default results/faults.json)")
    args = parser.parse_args(argv)
    heartbeat = args.heartbeat_timeout_s or (1.0 if args.quick else 5.0)
    only = args.only or ("stop rank 1" if args.quick else "")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zero3-reference-") as out:
        reference, why = _run(faulty_run, FaultSpec(out=out, heartbeat_s=heartbeat))
    if reference is None:
        print(f"the reference run failed: {why}", file=sys.stderr)
        return 1
    rows = rank_fault_rows(heartbeat, only, reference[0])
    rows += divergence_rows(args.only)
    if not args.quick:
        rows += save_kill_rows(args.only)
    rows += full_disk_rows(args.only)
    rows += hostile_rows(args.only)
    timed = [r["seconds"] for r in rows if isinstance(r.get("seconds"), float)]
    summary = {
        "faults": len(rows),
        "detected": sum(r["detected"] for r in rows),
        "slowest_s": max(timed, default=0.0),
        "crashed": sum(r["crashed"] for r in rows),
        "hangs": sum(r["hang"] for r in rows),
        "lost": sum(not r["lost"].startswith("none") for r in rows),
    }
    payload = {
        "config": {"heartbeat_timeout_s": heartbeat, "quick": args.quick, "only": args.only},
        "machine": f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "rows": rows,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    out = args.out or RESULTS / ("faults-quick.json" if args.quick else "faults.json")
    out.write_text(json.dumps(payload, indent=1))
    md = markdown(payload)
    out.with_suffix(".md").write_text(md)
    print(md)
    ok = summary["detected"] == summary["faults"] and not (summary["crashed"] + summary["hangs"])
    return 0 if ok and not summary["lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
