"""A rank process of a :class:`~zero3_offload.testing.rank_pool.RankPool`: joins the
group once, then runs one test after another as the pytest process sends them.

Each test runs in a new event loop, after the process's torch seed, default
dtype, thread count, grad mode and environment are put back as they were when
it joined, structlog is unconfigured again, and the working directory and
``sys.path`` are the pytest process's. The rank's stdout and stderr go to
files of the pool that the pytest process reads after each test; on SIGUSR1
``faulthandler`` writes every thread's stack to the rank's stack file, and on
SIGUSR2 the rank adds its asyncio tasks' stacks there (see
[Note: rank stacks] in ``testing.rank_pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import faulthandler
import inspect
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any

import attrs
import structlog
import torch
import torch.distributed as dist

from zero3_offload.testing.code_location import CodeLocation
from zero3_offload.testing.rank_assertions import explain_comparisons
from zero3_offload.testing.rank_fixture import RankSide, rank_function
from zero3_offload.testing.rank_stacks import write_frames
from zero3_offload.testing.rank_task import RankOutcome, RankTask, ReportStyle
from zero3_offload.testing.run_ranks import RankContext, keep_gloo_on_loopback

__all__ = ["STACKS_END", "rank_files", "serve"]

STACKS_END = "--- end of stacks ---"
_EXIT_PARENT_GONE = 70  # the pytest process is gone: nobody reads this rank's result
# How long the ranks of a reused group may take to check it before a test: a check that
# does not complete in time (a collective a passing test left unmatched) sends the test
# to new processes, which is all a slow check costs.
_AGREE_S = 3.0


def rank_files(directory: str, rank: int) -> tuple[Path, Path, Path]:
    """The rank's stdout, stderr and stack files in the pool's directory."""
    base = Path(directory)
    return base / f"rank{rank}.out", base / f"rank{rank}.err", base / f"rank{rank}.stacks"


@attrs.define
class _Process:
    """What a test may change in this process and the next test gets back."""

    seed: int
    dtype: torch.dtype
    threads: int
    environ: dict[str, str]
    loop: asyncio.AbstractEventLoop | None = None
    tests_run: int = 0

    def restore(self) -> None:
        torch.manual_seed(self.seed)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)
        if structlog.is_configured():  # a test's zero3_offload.logging.configure()
            structlog.reset_defaults()
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)


_PROCESS: _Process | None = None


def serve(
    rank: int,
    world_size: int,
    store_port: int,
    backend: str,
    threads: int,
    group_timeout_s: float,
    tasks: Any,
    lifeline: Any,
    directory: str,
) -> None:
    """The rank's main: join the group, then answer each task with a :class:`RankOutcome`."""
    global _PROCESS
    _exit_with_parent(lifeline)
    out_path, err_path, stacks_path = rank_files(directory, rank)
    outputs = []
    for fd, path in ((1, out_path), (2, err_path)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(file, fd)
        os.close(file)
        outputs.append(fd)
    stacks = open(stacks_path, "w", encoding="utf-8")  # noqa: SIM115 (open for life)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    signal.signal(signal.SIGUSR2, lambda *_: _write_task_stacks(stacks))
    torch.set_num_threads(threads)
    if backend == "gloo":
        keep_gloo_on_loopback()
    try:
        group = _join(rank, world_size, store_port, backend, group_timeout_s)
    except BaseException:
        joined = f"rank {rank} could not join the group:\n{traceback.format_exc()}"
    else:
        joined = ""
        ctx = RankContext(rank=rank, world_size=world_size, group=group)
        _PROCESS = _Process(
            seed=torch.initial_seed(),
            dtype=torch.get_default_dtype(),
            threads=threads,
            environ=dict(os.environ),
        )
    while True:
        try:
            message = tasks.recv_bytes()
        except (EOFError, OSError):
            break
        if not message:
            break
        task = pickle.loads(Path(message.decode()).read_bytes())
        if joined:
            outcome = RankOutcome(rank=rank, status="failed", message=joined, reusable=False)
        else:
            for fd in outputs:
                os.ftruncate(fd, 0)
            outcome = run_test(task, ctx, lambda *note: tasks.send_bytes(pickle.dumps(note)))
            sys.stdout.flush()
            sys.stderr.flush()
        tasks.send_bytes(_pickled(("outcome", outcome)))
        if not outcome.reusable:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _join(
    rank: int, world_size: int, store_port: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    timeout = _dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return dist.group.WORLD


def _exit_with_parent(lifeline: Any) -> None:
    """End this process when the pytest process ends, whatever it is doing."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            lifeline.recv_bytes()
        os._exit(_EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="zero3-lifeline", daemon=True).start()


def run_test(task: RankTask, ctx: RankContext, note: Callable[..., None]) -> RankOutcome:
    """Run ``task``'s test on this rank; any exception becomes the outcome.

    ``note("started")`` tells the pytest process that the test itself begins (its
    timeout counts from there), ``note("failing", message)`` that it failed, before
    the report is formatted (which can take a while: pytest parses every source
    file of the traceback).
    """
    assert _PROCESS is not None
    if _PROCESS.tests_run and not _group_agrees(ctx, _PROCESS.tests_run):
        return RankOutcome(rank=ctx.rank, status="stale", reusable=False)
    _PROCESS.tests_run += 1
    _PROCESS.restore()
    explain_comparisons(task.style)
    os.chdir(task.cwd)
    sys.path[:0] = [p for p in task.sys_path if p not in sys.path]
    fn: Callable[..., Any] | None = None
    result = None
    try:
        for module in task.modules:
            module.load_module()
        if task.call:  # run_ranks on this pool: fn(ctx, *args), its result sent back
            fn, args = pickle.loads(task.values)
            note("started")
            result = pickle.dumps(asyncio.run(_call_function(fn, args, ctx)))
        else:
            fn = _test_function(task.test)
            values = pickle.loads(task.values)
            note("started")
            asyncio.run(_call(fn, task.argnames, values, ctx))
    except BaseException as exc:
        if not _skipped(exc):
            note("failing", "".join(traceback.format_exception_only(exc)).strip())
        if task.call:
            text = f"rank {ctx.rank} failed:\n{traceback.format_exc()}"
            reusable = not isinstance(exc, (KeyboardInterrupt, SystemExit))
            outcome = RankOutcome(rank=ctx.rank, status="failed", message=text, reusable=reusable)
        else:
            outcome = _outcome_of(exc, fn, task.style, ctx.rank)
    else:
        outcome = RankOutcome(rank=ctx.rank, status="passed", result=result)
    finally:
        _PROCESS.loop = None
    if not dist.is_initialized():
        outcome = attrs.evolve(outcome, reusable=False)
    return outcome


def _group_agrees(ctx: RankContext, tests_run: int) -> bool:
    """Whether the group still pairs this rank's collectives with the others' (a test
    that passed may have left one unmatched, after a collective's timeout): every rank
    gathers how many tests each ran, which must be the same everywhere."""
    mine = torch.tensor([tests_run], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    try:
        work = dist.all_gather(everyone, mine, group=ctx.group, async_op=True)
        work.wait(timeout=_dt.timedelta(seconds=_AGREE_S))
    except RuntimeError:  # a timeout or a broken pair: the group is not reused
        return False
    return all(int(t.item()) == tests_run for t in everyone)


def _skipped(exc: BaseException) -> bool:
    import pytest

    return isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception))


def _test_function(location: CodeLocation) -> Callable[..., Any]:
    module = location.load_module()
    owner, _, name = location.qualname.rpartition(".")
    if not owner:
        return getattr(module, name)
    cls: Any = module
    for part in owner.split("."):
        cls = getattr(cls, part)
    return getattr(cls(), name)


async def _call_function(fn: Callable[..., Any], args: tuple[Any, ...], ctx: RankContext) -> Any:
    assert _PROCESS is not None
    _PROCESS.loop = asyncio.get_running_loop()
    return await fn(ctx, *args)


async def _call(
    fn: Callable[..., Any], argnames: tuple[str, ...], values: dict[str, Any], ctx: RankContext
) -> None:
    assert _PROCESS is not None
    _PROCESS.loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as teardown:
        resolved: dict[str, Any] = {}

        async def value(name: str) -> Any:
            if name not in resolved:
                if name not in values:
                    raise LookupError(f"no value for {name!r} in rank {ctx.rank}")
                v = values[name]
                if isinstance(v, RankSide):
                    v = ctx if v.location is None else await _set_up(v, value, teardown)
                resolved[name] = v
            return resolved[name]

        kwargs = {name: await value(name) for name in argnames}
        result = fn(**kwargs)
        if inspect.isawaitable(result):
            await result


async def _set_up(
    side: RankSide, value: Callable[[str], Any], teardown: contextlib.AsyncExitStack
) -> Any:
    """Call a rank fixture's function; its code after ``yield`` goes on ``teardown``."""
    assert side.location is not None
    fn = rank_function(side.location)
    kwargs = {name: await value(name) for name in side.argnames}
    if inspect.isasyncgenfunction(fn):
        agen = fn(**kwargs)
        result = await agen.__anext__()

        async def finish_async() -> None:
            try:
                await agen.__anext__()
            except StopAsyncIteration:
                return
            raise RuntimeError(f"rank fixture {side.name} yielded more than once")

        teardown.push_async_callback(finish_async)
        return result
    if inspect.isgeneratorfunction(fn):
        gen = fn(**kwargs)
        result = next(gen)

        def finish() -> None:
            try:
                next(gen)
            except StopIteration:
                return
            raise RuntimeError(f"rank fixture {side.name} yielded more than once")

        teardown.callback(finish)
        return result
    result = fn(**kwargs)
    return await result if inspect.isawaitable(result) else result


def _outcome_of(
    exc: BaseException, fn: Callable[..., Any] | None, style: ReportStyle, rank: int
) -> RankOutcome:
    import pytest
    from _pytest._code import ExceptionInfo

    reusable = not isinstance(exc, (KeyboardInterrupt, SystemExit))
    if isinstance(exc, pytest.skip.Exception):
        return RankOutcome(rank=rank, status="skipped", message=str(exc.msg), reusable=reusable)
    if isinstance(exc, pytest.xfail.Exception):
        return RankOutcome(rank=rank, status="xfailed", message=str(exc.msg), reusable=reusable)
    excinfo = ExceptionInfo.from_exception(exc)
    if isinstance(exc, pytest.fail.Exception) and not exc.pytrace:
        tbstyle = "value"
    else:
        tbstyle = "long" if style.tbstyle == "auto" else style.tbstyle
    longrepr = excinfo.getrepr(
        funcargs=True,
        abspath=style.abspath,
        showlocals=style.showlocals,
        style=tbstyle,  # type: ignore[arg-type]
        tbfilter=False if style.fulltrace or fn is None else _test_frames(fn, style),
        truncate_locals=style.verbosity <= 2,
        truncate_args=style.verbosity <= 2,
    )
    crash = getattr(longrepr, "reprcrash", None)
    return RankOutcome(
        rank=rank,
        status="failed",
        message=crash.message if crash else excinfo.exconly(),
        location=f"{crash.path}:{crash.lineno}" if crash else "",
        longrepr=longrepr,
        reusable=reusable,
    )


def _test_frames(fn: Callable[..., Any], style: ReportStyle) -> Callable[[Any], Any]:
    """The traceback from the test function on, as pytest cuts a test's traceback."""
    from _pytest._code import Code
    from _pytest._code.code import Traceback, filter_traceback

    code = Code.from_function(inspect.unwrap(fn))

    def cut(excinfo: Any) -> Any:
        traceback_ = excinfo.traceback
        cut_ = traceback_.cut(path=code.path, firstlineno=code.firstlineno)
        if cut_ == traceback_:
            cut_ = cut_.cut(path=code.path)
            if cut_ == traceback_:
                cut_ = cut_.filter(filter_traceback) or traceback_
        cut_ = cut_.filter(excinfo)
        if style.tbstyle == "auto" and len(cut_) > 2:
            middle = (entry.with_repr_style("short") for entry in cut_[1:-1])
            cut_ = Traceback((cut_[0], *middle, cut_[-1]))
        return cut_

    return cut


def _pickled(message: tuple[str, RankOutcome]) -> bytes:
    try:
        return pickle.dumps(message)
    except Exception:  # a repr that does not pickle: its text instead
        kind, outcome = message
        return pickle.dumps((kind, attrs.evolve(outcome, longrepr=str(outcome.longrepr))))


def _coroutine_frames(coro: Any) -> list[FrameType]:
    """The frames of a suspended coroutine and of the coroutines it awaits, outermost first."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            frame = getattr(coro, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _write_task_stacks(stream: IO[str]) -> None:
    """Where each asyncio task of the running test is suspended (a signal handler)."""
    loop = _PROCESS.loop if _PROCESS is not None else None
    blocks = []
    if loop is not None and not loop.is_closed():
        for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
            frames = [
                (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
                for f in reversed(_coroutine_frames(task.get_coro()))
            ]
            blocks.append(write_frames(f"asyncio task {task.get_name()!r}", frames))
    stream.write("".join(blocks) + STACKS_END + "\n")
    stream.flush()
