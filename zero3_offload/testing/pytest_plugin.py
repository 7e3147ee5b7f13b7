"""The pytest plugin: ``@pytest.mark.ranks(n)`` runs a test on ``n`` real ranks.

Installed with the package (the ``pytest11`` entry point ``zero3_offload``;
``-p no:zero3_offload`` turns it off)::

    @pytest.mark.ranks(2)                 # or ranks([1, 2, 3]): one test per world size
    async def test_step(rank: RankContext, tmp_path: Path) -> None:
        ...                               # runs in every rank; rank.group is the gloo group

The test body runs in every rank process (forked from ``run_ranks``'
forkserver, one torch thread each, gloo on 127.0.0.1). Parameters and ordinary
fixtures are computed here and sent to the ranks (``tmp_path`` is the same
directory for all of them); ``@rank_fixture`` fixtures are computed in each
rank. A failure in any rank fails the test with that rank's traceback and what
the others were doing; a test that runs longer than its timeout (the marker's
``timeout=``, else the ini option ``ranks_timeout``) fails with every rank's
stack. Processes are kept for the next test of the same world size, backend
and thread count (``ranks_reuse = false``, or ``fresh=True`` on the marker, starts
new ones), and are killed after a failure, a timeout or an interrupt.
See ``docs/testing.md``.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from zero3_offload.testing.code_location import CodeLocation
from zero3_offload.testing.manager_fixture import ManagerSpec, zero3_manager
from zero3_offload.testing.rank_assertions import assertion_settings
from zero3_offload.testing.rank_fixture import RankSide
from zero3_offload.testing.rank_pool import PoolRun
from zero3_offload.testing.rank_report import RankTestFailed, failure_repr
from zero3_offload.testing.rank_runner import RankRunner
from zero3_offload.testing.rank_task import RankTask, ReportStyle

__all__ = ["zero3_manager"]

_RUNNER = pytest.StashKey[RankRunner]()
_DEFAULT_TIMEOUT_S = "180"
_BACKENDS = ("gloo", "nccl")


@attrs.frozen
class _Ranks:
    """A test's ``@pytest.mark.ranks`` arguments."""

    sizes: tuple[int, ...]
    parametrized: bool
    timeout_s: float | None
    backend: str
    threads: int
    fresh: bool

    @classmethod
    def of(cls, marker: pytest.Mark, where: str) -> _Ranks:
        if len(marker.args) != 1:
            raise pytest.UsageError(f"{where}: @pytest.mark.ranks takes one world size or a list")
        arg = marker.args[0]
        parametrized = isinstance(arg, (list, tuple))
        sizes = tuple(arg) if parametrized else (arg,)
        if not sizes or not all(isinstance(n, int) and n >= 1 for n in sizes):
            raise pytest.UsageError(
                f"{where}: @pytest.mark.ranks({arg!r}): world sizes must be integers >= 1"
            )
        known = {"timeout", "backend", "threads", "fresh"}
        unknown = set(marker.kwargs) - known
        if unknown:
            raise pytest.UsageError(
                f"{where}: @pytest.mark.ranks got {sorted(unknown)}; it takes {sorted(known)}"
            )
        backend = marker.kwargs.get("backend", "gloo")
        if backend not in _BACKENDS:
            raise pytest.UsageError(f"{where}: backend={backend!r} must be one of {_BACKENDS}")
        timeout = marker.kwargs.get("timeout")
        return cls(
            sizes=sizes,
            parametrized=parametrized,
            timeout_s=None if timeout is None else float(timeout),
            backend=backend,
            threads=int(marker.kwargs.get("threads", 1)),
            fresh=bool(marker.kwargs.get("fresh", False)),
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "ranks_timeout",
        "seconds a @pytest.mark.ranks test may run before its ranks are stopped and "
        f"their stacks shown (default {_DEFAULT_TIMEOUT_S}; the marker's timeout= wins)",
        default=_DEFAULT_TIMEOUT_S,
    )
    parser.addini(
        "ranks_reuse",
        "keep rank processes for the next @pytest.mark.ranks test of the same world "
        "size (default true; false starts new processes for every test)",
        type="bool",
        default=True,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ranks(n, *, timeout=None, backend='gloo', threads=1, fresh=False): run the test "
        "on n real ranks (a list: one test per world size); zero3_offload's plugin",
    )
    config.addinivalue_line(
        "markers",
        "zero3_manager(model, config=None, *, seed=0, units=None): the model (a callable) "
        "and config of the zero3_manager fixture",
    )
    runner = RankRunner(reuse=bool(config.getini("ranks_reuse")))
    runner.open()
    config.stash[_RUNNER] = runner


def pytest_unconfigure(config: pytest.Config) -> None:
    runner = config.stash.get(_RUNNER, None)
    if runner is not None:
        runner.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("ranks")
    if marker is None:
        return
    spec = _Ranks.of(marker, metafunc.definition.nodeid)
    if spec.parametrized:
        metafunc.parametrize("_zero3_world_size", spec.sizes, ids=[f"ranks{n}" for n in spec.sizes])


@pytest.fixture(autouse=True)
def _zero3_world_size() -> None:
    """The world size of a ``ranks([...])`` test (parametrized), None elsewhere."""
    return None


@pytest.fixture(scope="session")
def rank_runner(pytestconfig: pytest.Config) -> RankRunner:
    """``rank_runner.run(fn, world_size, *args)``: ``run_ranks`` on the session's reused
    rank processes, from the pytest process (a fixture, a test that compares ranks)."""
    return pytestconfig.stash[_RUNNER]


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> RankSide:
    """This rank's :class:`~zero3_offload.testing.RankContext` (``rank``, ``world_size``,
    ``group``) in a ``@pytest.mark.ranks`` test."""
    if request.node.get_closest_marker("ranks") is None:
        pytest.fail("the rank fixture needs @pytest.mark.ranks(n) on the test", pytrace=False)
    return RankSide(name="rank", location=None, argnames=())


@pytest.fixture
def _zero3_manager_spec(request: pytest.FixtureRequest) -> ManagerSpec:
    marker = request.node.get_closest_marker("zero3_manager")
    if marker is None:
        pytest.fail(
            "the zero3_manager fixture needs @pytest.mark.zero3_manager(model, config) on the "
            "test (model: a callable that builds the model in each rank)",
            pytrace=False,
        )
    return ManagerSpec.of(*marker.args, **marker.kwargs)


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("ranks")
    if marker is None:
        return
    spec = _Ranks.of(marker, item.nodeid)
    if spec.backend == "nccl":
        import torch

        size = _world_size(item, spec)
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < size:
            pytest.skip(f"backend='nccl' needs {size} CUDA devices (one per rank), found {found}")


def _world_size(item: pytest.Item, spec: _Ranks) -> int:
    callspec = getattr(item, "callspec", None)
    if spec.parametrized and callspec is not None:
        return int(callspec.params["_zero3_world_size"])
    return spec.sizes[0]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        for name, value in pyfuncitem.funcargs.items():
            if isinstance(value, RankSide):
                pytest.fail(
                    f"fixture {name!r} runs in rank processes: only a @pytest.mark.ranks "
                    "test can use it",
                    pytrace=False,
                )
        return None
    spec = _Ranks.of(marker, pyfuncitem.nodeid)
    config = pyfuncitem.config
    world_size = _world_size(pyfuncitem, spec)
    timeout_s = spec.timeout_s or float(config.getini("ranks_timeout"))
    run = config.stash[_RUNNER].execute(
        _task(pyfuncitem),
        world_size=world_size,
        timeout_s=timeout_s,
        backend=spec.backend,
        threads=spec.threads,
        fresh=spec.fresh,
    )
    _forward_output(run)
    _conclude(run)
    return True


def _conclude(run: PoolRun) -> None:
    if not run.ok:
        raise RankTestFailed(run)
    statuses = {o.status for o in run.outcomes}
    if "xfailed" in statuses:
        pytest.xfail(next(o.message for o in run.outcomes if o.status == "xfailed"))
    if "skipped" in statuses:
        pytest.skip(next(o.message for o in run.outcomes if o.status == "skipped"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, RankTestFailed):
        try:
            line = inspect.getsourcelines(item.function)[1]  # type: ignore[attr-defined]
        except (AttributeError, OSError, TypeError):  # no source: the report names the file
            line = 0
        report.longrepr = failure_repr(call.excinfo.value.run, str(item.path), line)
    return report


def _task(item: pytest.Function) -> RankTask:
    """What every rank needs to run ``item``."""
    needed = list(item._fixtureinfo.argnames)
    values: dict[str, Any] = {}
    while needed:
        name = needed.pop()
        if name in values:
            continue
        if name not in item.funcargs:
            pytest.fail(f"{name!r} has no value to send to the ranks", pytrace=False)
        values[name] = item.funcargs[name]
        if isinstance(values[name], RankSide):
            needed.extend(values[name].argnames)
    cls = getattr(item, "cls", None)
    name = item.originalname
    qualname = f"{cls.__qualname__}.{name}" if cls is not None else name
    module = item.module
    test = CodeLocation(
        module=module.__name__,
        path=os.path.realpath(str(item.path)),
        qualname=qualname,
        rewritten="@py_builtins" in vars(module),
    )
    sides = [v.location for v in values.values() if isinstance(v, RankSide) and v.location]
    config = item.config
    try:
        abspath = Path.cwd() != config.invocation_params.dir
    except OSError:
        abspath = True
    return RankTask(
        nodeid=item.nodeid,
        test=test,
        argnames=tuple(item._fixtureinfo.argnames),
        modules=(test, *dict.fromkeys(sides)),
        values=_pickled(values),
        cwd=os.getcwd(),
        sys_path=tuple(sys.path),
        style=ReportStyle(
            tbstyle=config.getoption("tbstyle", "auto"),
            showlocals=bool(config.getoption("showlocals", False)),
            fulltrace=bool(config.getoption("fulltrace", False)),
            abspath=abspath,
            verbosity=config.get_verbosity(),
            assertions=assertion_settings(config),
        ),
    )


def _pickled(values: dict[str, Any]) -> bytes:
    import pickle

    try:
        return pickle.dumps(values)
    except Exception:
        for name, value in values.items():
            try:
                pickle.dumps(value)
            except Exception as exc:
                pytest.fail(
                    f"the value of {name!r} cannot be sent to the ranks ({exc}): make it a "
                    "@rank_fixture, or return something that pickles",
                    pytrace=False,
                )
        raise


def _forward_output(run: PoolRun) -> None:
    """The ranks' stdout and stderr of the test, as the test's own (lines prefixed by rank)."""
    for rank, (out, err) in sorted(run.outputs.items()):
        for text, stream in ((out, sys.stdout), (err, sys.stderr)):
            if text:
                stream.write("".join(f"[rank {rank}] {line}" for line in text.splitlines(True)))
                if not text.endswith("\n"):
                    stream.write("\n")
