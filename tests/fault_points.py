"""Kill a rank at a named point of a checkpoint save; replay a training history.

Shared by ``test_checkpoint_crash.py`` and ``test_faults.py`` (the fault table). A *point* is
``"before:STEP"`` or ``"after:STEP"`` for a STEP of
``zero3_offload.checkpoint.atomic_save.SAVE_STEPS``: :func:`kill_at` wraps the
real function of that name in the calling process so that the process SIGKILLs
itself right before or right after it runs; the function itself runs unchanged.
:func:`fail_write` likewise makes one real write end in ``ENOSPC``, and
:func:`fail_at` a step raise ``EIO`` once it ran.

A history is a tuple of actions ``(function, *args)``, each a module-level
``async def function(run: Replay, *args)`` (so histories pickle by name).
:func:`replay` is the rank function that runs one on a fresh manager::

    history = (*DISTINCT, (kill, 1, "after:write_shard", marker), (save,))
    await run_ranks(replay, 2, root, history)   # raises RankFailedError: rank 1 died
    resumed = await run_ranks(replay, 2, root, CONTINUE)
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from helpers import make_batches, make_model, train_step

from zero3_offload import CheckpointError, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.checkpoint import atomic_save
from zero3_offload.testing import RankContext

MODEL: dict[str, Any] = {"d": 16, "n_blocks": 1}  # small: a run is mostly process start
BATCHES = 12
BATCH = 8

# Where each rank can be killed during a save, in the order a save reaches them.
# Rank 0 runs every step; the others prepare_save, write_shard and commit_save
# (waiting in its collectives while rank 0 commits).
RANK0_POINTS = (
    "before:prepare_save",
    "after:_make_temp_dir",
    "before:write_shard",
    "after:write_shard",
    "before:_write_metadata",
    "after:_write_metadata",
    "after:_stage_latest",
    "after:_retire_old",
    "after:_move_into_place",
    "after:_point_latest",
    "after:_remove_leftovers",
    "after:commit_save",
)
OTHER_RANK_POINTS = (
    "before:prepare_save",
    "after:prepare_save",
    "before:write_shard",
    "after:write_shard",
    "before:commit_save",
    "after:commit_save",
)


def committed(point: str, *, same_name: bool) -> bool:
    """Whether a save killed at ``point`` (of any rank) is the one ``latest`` resolves
    to afterwards: a new name once ``latest`` is replaced, a same-named checkpoint
    (which ``latest`` already names) once the new directory is renamed into place."""
    done = ("after:_point_latest", "after:_remove_leftovers", "after:commit_save")
    return point in done or (same_name and point == "after:_move_into_place")


def _wrap(step: str, before: Callable[[], None], after: Callable[[], None]) -> None:
    """Replace ``atomic_save.<step>`` in this process by the real function between
    ``before()`` and ``after()``."""
    if step not in atomic_save.SAVE_STEPS:
        raise ValueError(f"{step!r} is not one of {atomic_save.SAVE_STEPS}")
    real = getattr(atomic_save, step)
    if inspect.iscoroutinefunction(real):

        @functools.wraps(real)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            before()
            result = await real(*args, **kwargs)
            after()
            return result

    else:

        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before()
            result = real(*args, **kwargs)
            after()
            return result

    setattr(atomic_save, step, wrapper)


def kill_at(point: str, marker: str | None = None) -> None:
    """SIGKILL this process at ``point`` of its next save (``"before:STEP"``/``"after:STEP"``).

    ``marker``, if given, is a file that gets ``point`` written to it just before.
    """
    when, _, step = point.partition(":")
    if when not in ("before", "after"):
        raise ValueError(f"point {point!r} is not 'before:STEP' or 'after:STEP'")

    def die() -> None:
        if marker is not None:
            Path(marker).write_text(point)
        os.kill(os.getpid(), signal.SIGKILL)

    def nothing() -> None:
        pass

    _wrap(step, die if when == "before" else nothing, die if when == "after" else nothing)


def fail_at(point: str) -> None:
    """Make this process's next save raise ``OSError(EIO)`` at ``point`` (one shot)."""
    when, _, step = point.partition(":")
    if when not in ("before", "after"):
        raise ValueError(f"point {point!r} is not 'before:STEP' or 'after:STEP'")
    real = getattr(atomic_save, step)

    def fail() -> None:
        setattr(atomic_save, step, real)
        raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} ({point}, injected)")

    def nothing() -> None:
        pass

    _wrap(step, fail if when == "before" else nothing, fail if when == "after" else nothing)


WRITE_SITES = ("shard", "metadata", "latest")


def fail_write(site: str) -> None:
    """Make this process's next real write of ``site`` end in ``OSError(ENOSPC)``.

    The real write runs; then the file is cut to half its size, as a disk that
    filled up midway leaves it, and the error is raised. One shot: later writes
    run normally. ``site`` is ``"shard"`` (safetensors' ``save_file`` of a rank
    file), ``"metadata"`` or ``"latest"`` (``_write_durably`` of
    ``metadata.json.part`` or ``.latest.tmp``).
    """
    if site not in WRITE_SITES:
        raise ValueError(f"site {site!r} is not one of {WRITE_SITES}")
    name = "save_file" if site == "shard" else "_write_durably"
    real = getattr(atomic_save, name)
    wanted = {"shard": ".part", "metadata": "metadata.json.part", "latest": ".latest.tmp"}[site]

    @functools.wraps(real)
    def write_then_fill_up(*args: Any) -> None:
        path = Path(args[1] if site == "shard" else args[0])  # save_file(tensors, path)
        real(*args)
        if path.name.endswith(wanted):
            setattr(atomic_save, name, real)
            os.truncate(path, path.stat().st_size // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    setattr(atomic_save, name, write_then_fill_up)


# ------------------------------------------------------------------- replaying a history


@attrs.define
class Replay:
    """One rank's run of a history: its manager and what the actions recorded."""

    ctx: RankContext
    manager: Zero3CpuOffloadManager
    root: Path
    names: list[str]  # the model's layers, in order
    losses: list[float] = attrs.Factory(list)  # one per ``step``
    loaded: list[str] = attrs.Factory(list)  # directories ``load`` loaded
    saved: list[str] = attrs.Factory(list)  # directories ``save`` committed
    errors: list[str] = attrs.Factory(list)  # messages of ``save_failing``'s errors
    listings: list[list[str]] = attrs.Factory(list)  # the root after each ``save_failing``
    events: list[Any] = attrs.Factory(list)  # for actions defined elsewhere


async def step(run: Replay, index: int) -> None:
    """Train one step on batch ``index`` (of ``make_batches(BATCHES, BATCH)``)."""
    batch = make_batches(BATCHES, BATCH)[index]
    run.losses.append(await train_step(run.manager, run.ctx, batch, run.names))


async def save(run: Replay) -> None:
    run.saved.append(str(await run.manager.save_checkpoint(run.root)))


async def load(run: Replay, relative: str = "") -> None:
    """Load the root (the checkpoint ``latest`` names) or ``relative`` in it."""
    run.loaded.append(str(await run.manager.load_checkpoint(run.root / relative)))


async def save_failing(run: Replay) -> None:
    """Save; the save must raise CheckpointError. Records its message and the root's entries."""
    try:
        await run.manager.save_checkpoint(run.root)
    except CheckpointError as exc:
        run.errors.append(str(exc))
    else:
        raise AssertionError("the save did not fail")
    run.listings.append(sorted(os.listdir(run.root)))


async def kill(run: Replay, rank: int, point: str, marker: str | None = None) -> None:
    """Arm :func:`kill_at` on ``rank`` for the following save."""
    if run.ctx.rank == rank:
        kill_at(point, marker)


async def io_error(run: Replay, rank: int, point: str) -> None:
    """Arm :func:`fail_at` on ``rank`` for the following save."""
    if run.ctx.rank == rank:
        fail_at(point)


async def no_space(run: Replay, rank: int, site: str) -> None:
    """Arm :func:`fail_write` on ``rank`` for the following save."""
    if run.ctx.rank == rank:
        fail_write(site)


async def replay(ctx: RankContext, root: str, history: tuple[tuple[Any, ...], ...]) -> dict:
    """Rank function: run ``history`` on a fresh manager of the ``MODEL`` under ``root``.

    Returns what the actions recorded (see :class:`Replay`) and the final full
    state dict (on rank 0).
    """
    model = make_model(**MODEL)
    async with Zero3CpuOffloadManager(Zero3CpuOffloadConfig(), ctx.group, model) as manager:
        run = Replay(ctx, manager, Path(root), model.layer_names)
        for fn, *args in history:
            await fn(run, *args)
        state: dict[str, torch.Tensor] = await manager.full_state_dict()
    return {
        "losses": run.losses,
        "loaded": run.loaded,
        "saved": run.saved,
        "errors": run.errors,
        "listings": run.listings,
        "events": run.events,
        "state": state if ctx.rank == 0 else None,
    }


# The histories of test_checkpoint_crash: A is committed, then saving B is killed.
# DISTINCT: A = step-00000002 after batches 0, 1; B = step-00000003 after batch 2.
DISTINCT: tuple[tuple[Any, ...], ...] = ((step, 0), (step, 1), (save,), (step, 2))
# SAME_NAME: A = step-00000003 after batches 0, 1, 2; B = step-00000003 after 0, 1, 7
# (back to step-00000002, then another batch): B replaces a same-named checkpoint.
SAME_NAME: tuple[tuple[Any, ...], ...] = (
    *DISTINCT,
    (save,),
    (load, "step-00000002"),
    (step, 7),
)
# A fresh run after the crash: load what ``latest`` names, train 2 steps, save.
CONTINUE: tuple[tuple[Any, ...], ...] = ((load,), (step, 10), (step, 11), (save,))
