"""Calibrating the planner: this machine's figures, measured once and cached.

``measure()`` takes the timed figures of :func:`~zero3_offload.plan.calibration.
measure_figures` and measures the runtime every rank holds whatever its model: it
trains a two-layer, 32-wide Llama for three steps with ``zero3-offload train`` on the
same number of local ranks, with and without LoRA adapters, and takes each run's peak
resident set (``VmHWM``) less the planner's figure for that model's own tensors (under
1 MiB, and the collectives' shared-memory region): what remains is torch, transformers
and this library loaded, the autograd engine, thread pools and the C heap's arenas.
It then times a small model's training steps the same way (``_unit_overhead``): what
the library's step takes beyond the sum of its planned parts, per unit (the hooks and
bookkeeping of each unit's gather, compute and release, the event loop, threads
contending for the cores).
:func:`load_or_measure` reads the cache (:func:`~zero3_offload.plan.calibration.
cache_path`), measuring first when it is missing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from zero3_offload import logging as zlogging
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import ConfigError
from zero3_offload.plan.calibration import VERSION, Calibration, cache_path, measure_figures
from zero3_offload.plan.planner import plan_run
from zero3_offload.train.options import TRAIN_DEFAULTS, TrainOptions

__all__ = ["load_or_measure", "measure"]

log = zlogging.get_logger(__name__)

_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
_CORPUS_MB = 0.05
_TINY_RUN = (
    "--steps",
    "3",
    "--seq-len",
    "32",
    "--batch-size",
    "1",
    "--corpus-mb",
    str(_CORPUS_MB),
)
_TINY_RUN += ("--eval-batches", "1", "--eval-every", "0", "--warmup-steps", "1")


@contextmanager
def _trained(
    config: dict[str, Any], ranks: int, run: Sequence[str], what: str
) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """Train a model of ``config`` (no weights) with ``zero3-offload train`` on ``ranks``
    local ranks with the flags ``run``; yields its directory (there while the block
    runs, for the plan of the same run) and every rank's log records.

    Raises:
        ConfigError: the ``what`` training run failed (its stderr's end quoted).
    """
    with tempfile.TemporaryDirectory(prefix="zero3-calibrate-") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        args = ("--model", str(model), "--world-size", str(ranks), "--out", f"{tmp}/run")
        _command("train", *args, *run, failed=f"the {what} training run")
        records = [
            record
            for log_file in Path(tmp, "run", "logs").glob("rank*.jsonl")
            for record in map(json.loads, log_file.read_text().splitlines())
        ]
        yield model, records


def _runtime(calibration: Calibration, ranks: int, *, adapters: bool) -> int:
    """A rank's peak resident set training a tiny Llama, less the planner's figure for
    that model's tensors (see the module docstring)."""
    lora = ("--lora", "r=4") if adapters else ()
    with _trained(_TINY, ranks, (*_TINY_RUN, *lora), "tiny") as (model, records):
        peaks = [r["peak_rss_bytes"] for r in records if r.get("event") == "train_done"]
        opts = TrainOptions(
            model=str(model),
            world_size=ranks,
            seq_len=32,
            batch_size=1,
            corpus_mb=_CORPUS_MB,
            lora="r=4" if adapters else None,
        )
        tiny = plan_run(opts, Zero3CpuOffloadConfig(**TRAIN_DEFAULTS), calibration)
    return max(peaks) - tiny.host_peak_bytes


_TIMED_MODEL = {
    **_TINY,
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "max_position_embeddings": 512,
}
_TIMED_RUN = ("--steps", "4", "--seq-len", "512", "--batch-size", "1", "--corpus-mb", "0.2")
_TIMED_RUN += ("--eval-batches", "1", "--eval-every", "0", "--warmup-steps", "1")


def _unit_overhead(calibration: Calibration, ranks: int) -> float:
    """Seconds per unit and micro-step that the library's step takes beyond the sum of
    its planned parts on this machine: a 4-layer, 256-wide Llama trained on 512 tokens
    per rank with ``zero3-offload train`` (the median step after the first, the slowest
    rank), less the plan of that run, over its units."""
    with _trained(_TIMED_MODEL, ranks, _TIMED_RUN, "timed") as (model, records):
        steps: dict[int, list[float]] = {}
        for record in records:
            if record.get("event") == "train_step" and record["step"] > 1:
                steps.setdefault(record["step"], []).append(record["seconds"])
        measured = statistics.median(max(seconds) for seconds in steps.values())
        opts = TrainOptions(
            model=str(model), world_size=ranks, seq_len=512, batch_size=1, corpus_mb=0.2
        )
        planned = plan_run(opts, Zero3CpuOffloadConfig(**TRAIN_DEFAULTS), calibration)
    return max(measured - planned.predicted_step_s, 0.0) / planned.train["units"]


def measure(ranks: int, *, threads_per_rank: int | None = None) -> Calibration:
    """Measure this machine's figures with ``ranks`` local ranks (each with
    ``threads_per_rank`` torch threads; default: the cores divided by the ranks)."""
    started = time.perf_counter()
    calibration = measure_figures(ranks, threads_per_rank=threads_per_rank)
    calibration = attrs.evolve(
        calibration,
        runtime_rss_bytes=_runtime(calibration, ranks, adapters=False),
        adapter_runtime_rss_bytes=_runtime(calibration, ranks, adapters=True),
    )
    calibration = attrs.evolve(calibration, unit_overhead_s=_unit_overhead(calibration, ranks))
    log.info("calibrated", seconds=time.perf_counter() - started, **calibration.to_dict())
    return calibration


def _command(*args: str, failed: str) -> None:
    """Run ``zero3-offload ARGS`` in a process of its own (see :func:`_own_env`).

    Raises:
        ConfigError: it failed (``failed`` names it; its stderr's end quoted).
    """
    command = [sys.executable, "-m", "zero3_offload", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=_own_env())
    if done.returncode:
        raise ConfigError(f"calibration: {failed} failed: {done.stderr[-2000:]}")


def _own_env() -> dict[str, str]:
    """This process's environment without a launcher's rank variables: a job started
    from a rank (torchrun's) is a run of its own, not one of the launcher's ranks."""
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    launcher |= {"ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    own = {k: v for k, v in os.environ.items() if k not in launcher}
    return {k: v for k, v in own.items() if not k.startswith("TORCHELASTIC")}


def _cached(ranks: int) -> Calibration | None:
    path = cache_path(ranks)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") == VERSION:
            return Calibration(**data)
    except (OSError, ValueError, TypeError):
        log.warning("unreadable calibration cache, measuring again", path=str(path))
    return None


def load_or_measure(ranks: int, *, remeasure: bool = False, isolated: bool = False) -> Calibration:
    """The cached figures for ``ranks`` local ranks, measured and cached first when
    there are none (or ``remeasure``).

    ``isolated``: measure them with ``zero3-offload plan --calibrate`` in a process of its
    own (a training process plans: its ranks, threads and memory stay out of the
    figures, and its own memory out of theirs).

    Raises:
        ConfigError: the isolated measurement failed (its stderr's end quoted).
    """
    path = cache_path(ranks)
    found = None if remeasure else _cached(ranks)
    if found is not None:
        return found
    if isolated:
        log.info("calibrating", ranks=ranks, isolated=True)
        _command("plan", "--calibrate", "--world-size", str(ranks), failed="the measurement")
        found = _cached(ranks)
        if found is None:
            raise ConfigError(f"calibration: the measurement left no figures at {path}")
        return found
    calibration = measure(ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.to_dict(), indent=2))
    tmp.replace(path)
    return calibration
