"""Start the ranks: in this process, as local gloo ranks, or inside a torchrun job.

* Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set)
  this process is one rank of that job: it joins with
  ``init_process_group_from_env`` (NCCL when its device is CUDA, else gloo), so
  multi-node runs need nothing beyond the launcher.
* ``--world-size 1`` trains in this process (a one-rank group on a free port).
* ``--world-size N`` starts N rank processes with ``run_ranks`` (gloo on
  127.0.0.1, a free port). This process waits for them; the first Ctrl-C asks
  every rank to stop after its current step and save, a second one aborts.

An ``--out`` whose checkpoints come from a run with the same options resumes from
the latest by itself (``train.run_record``), so ``torchrun --max-restarts N``
brings a job back after a rank died without a person; a restart on fewer ranks
keeps the global batch with more accumulation.

Every training process calls ``set_mmap_threshold()`` so that freed layer
buffers go back to the OS and RSS reflects what the rank holds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch

from zero3_offload.comm import (
    destroy_process_group,
    init_process_group,
    init_process_group_from_env,
)
from zero3_offload.config import Zero3CpuOffloadConfig
from zero3_offload.errors import CommunicationError, RankDivergenceError
from zero3_offload.memory.allocator import TRAIN_MMAP_THRESHOLD, set_mmap_threshold
from zero3_offload.testing import RankContext, RankFailedError, free_port, run_ranks
from zero3_offload.train import hf
from zero3_offload.train.adapters import read_peft_config
from zero3_offload.train.data_check import check_data
from zero3_offload.train.loop import RankResult, RunSettings, TrainError, train_rank
from zero3_offload.train.options import TrainOptions
from zero3_offload.train.run_record import RunRecord
from zero3_offload.train.sources import OptionError, Resolved, in_torchrun

__all__ = ["launch"]

_RUN_LIMIT_S = 30 * 24 * 3600.0  # run_ranks needs a limit; a training run may take weeks
_INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT


def _threads(requested: int, local_ranks: int) -> int:
    return requested or max(1, (os.cpu_count() or 1) // max(local_ranks, 1))


def _backend(settings: RunSettings) -> str:
    return "nccl" if settings.zero3.device.startswith("cuda") else "gloo"


async def _in_process(settings: RunSettings, *, from_env: bool) -> RankResult:
    beat_s = settings.zero3.heartbeat_timeout_s
    if from_env:
        group = await init_process_group_from_env(_backend(settings), heartbeat_timeout_s=beat_s)
    else:
        group = await init_process_group(_backend(settings), rank=0, world_size=1, port=free_port())
    try:
        ctx = RankContext(rank=group.rank(), world_size=group.size(), group=group)
        return await train_rank(ctx, settings)
    finally:
        destroy_process_group()


def _user_error(failure: RankFailedError) -> str | None:
    """The one-line message of a TrainError raised in a rank, if that is what failed."""
    prefix = f"{TrainError.__module__}.{TrainError.__qualname__}: "
    for line in reversed(str(failure).splitlines()):
        if line.startswith(prefix):
            return line[len(prefix) :]
    return None


def _communication_error(failure: RankFailedError) -> str | None:
    """``rank R: message`` when a rank failed with a CommunicationError (a rank stopped,
    died or diverged: the message names it), else None."""
    lines = str(failure).splitlines()
    names = (CommunicationError, RankDivergenceError)
    prefixes = [f"{c.__module__}.{c.__qualname__}: " for c in names]
    for line in reversed(lines):
        for prefix in prefixes:
            if line.startswith(prefix):
                return f"{lines[0].removesuffix(' failed:')}: {line[len(prefix) :]}"
    return None


@attrs.define
class _ParentSignals:
    """The launcher's SIGINT/SIGTERM: the first asks ranks to stop, the second aborts."""

    stop_file: Path
    requested: bool = False
    _previous: dict[int, Any] = attrs.Factory(dict)

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.stop_file.touch()
        print(
            "stopping after the current step (press Ctrl-C again to abort)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> _ParentSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _local_ranks(settings: RunSettings, world_size: int, threads: int) -> RankResult:
    with tempfile.TemporaryDirectory(prefix="zero3-train-") as tmp:
        stop_file = Path(tmp) / "stop"
        settings = attrs.evolve(settings, stop_file=str(stop_file))
        with _ParentSignals(stop_file) as signals:
            try:
                results = asyncio.run(
                    run_ranks(
                        train_rank,
                        world_size,
                        settings,
                        timeout_s=_RUN_LIMIT_S,
                        threads_per_rank=threads,
                        backend=_backend(settings),
                        mmap_threshold=TRAIN_MMAP_THRESHOLD,
                    )
                )
            except RankFailedError as exc:
                message = _user_error(exc)
                if message is not None:
                    raise TrainError(message) from None
                if signals.requested:
                    raise KeyboardInterrupt from None
                message = _communication_error(exc)
                if message is not None:
                    raise RankFailedError(message) from None
                raise
    return results[0]


def _resumed_config(
    opts: TrainOptions, zero3: Zero3CpuOffloadConfig, world: int, latest: Path
) -> Zero3CpuOffloadConfig:
    """The config that resumes the run whose checkpoints ``latest`` names, as ``opts``,
    ``zero3`` and ``world`` ranks ask (see ``train.run_record``).

    Raises:
        OptionError: the options differ from the run's (each named), its global batch
            cannot be kept on ``world`` ranks, or the directory has checkpoints but no
            record of its run and ``--resume`` was not given.
    """
    assert opts.out is not None
    out = Path(opts.out)
    saved = RunRecord.load(out)
    if saved is None:  # checkpoints written before run records: resumed only when asked
        if not opts.resume:
            raise OptionError(
                f"--out {opts.out} holds checkpoints already: add --resume to continue from "
                f"{latest.parent / latest.read_text().strip()}, or give another --out"
            )
        return zero3
    now = RunRecord.of(opts, zero3, world // zero3.sequence_parallel_size)  # data-parallel ranks
    zero3, note = saved.resume_config(now, zero3, out)
    if note is not None and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr)
    return zero3


def launch(resolved: Resolved) -> int:
    """Train as ``resolved`` says; return the exit status (130 when interrupted).

    An ``--out`` that holds checkpoints resumes from the latest one when the options
    agree with the run's record (``OUT/run.json``, see ``train.run_record``), also on
    another number of ranks that keeps the global batch: under ``torchrun
    --max-restarts`` the restarted ranks go on by themselves.

    Raises:
        OptionError: ``--resume`` without a checkpoint to resume from, an
            ``--out`` that holds checkpoints of a run with other options (each one
            named), or a global batch the ranks cannot keep, a
            ``--model`` that is not a transformers model directory (or does not
            fit ``--seq-len``, or transformers is missing), a ``--data`` that does
            not exist or holds examples without ``--model`` (or example options
            for text), or an ``--export`` directory that is not empty.
        TrainError: a user's mistake found by a rank.
        RankFailedError: a rank crashed (its traceback is in the message), or
            found another rank silent, dead or diverged (then the message is
            that one line, naming the rank).
        KeyboardInterrupt: interrupted before training started.
    """
    opts, zero3 = resolved.train, resolved.zero3
    latest = Path(opts.out or ".") / "checkpoints" / "latest"
    if opts.resume and not latest.is_file():
        raise OptionError(f"--resume: no checkpoint in {latest.parent} (no 'latest' file)")
    world = int(os.environ["WORLD_SIZE"]) if in_torchrun() else opts.world_size
    if opts.out and latest.is_file():
        zero3 = _resumed_config(opts, zero3, world, latest)
        opts = attrs.evolve(opts, resume=True)
    elif opts.out and os.environ.get("RANK", "0") == "0":
        data_world = world // zero3.sequence_parallel_size  # a sequence group is one data rank
        RunRecord.of(opts, zero3, data_world).save(Path(opts.out))  # a new run: what it is
    if opts.model is not None:
        hf.check_model_dir(opts.model, seq_len=opts.seq_len)
    check_data(opts)
    if opts.export is not None:
        hf.check_export_dir(opts.export)
    if opts.peft_config is not None:
        read_peft_config(opts.peft_config)  # its mistakes before any rank starts
    bar = opts.progress if opts.progress is not None else sys.stdout.isatty()
    settings = RunSettings(train=opts, zero3=zero3, bar=bar)
    if in_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(_threads(opts.threads, local))
        set_mmap_threshold(TRAIN_MMAP_THRESHOLD)
        result = asyncio.run(_in_process(settings, from_env=True))
    elif opts.world_size == 1:
        torch.set_num_threads(_threads(opts.threads, 1))
        set_mmap_threshold(TRAIN_MMAP_THRESHOLD)
        result = asyncio.run(_in_process(settings, from_env=False))
    else:
        result = _local_ranks(settings, opts.world_size, _threads(opts.threads, opts.world_size))
    return _INTERRUPTED if result.interrupted else 0
