import multiprocessing
import sys
from multiprocessing import forkserver
from pathlib import Path

import pytest

# Rank processes unpickle test functions by module name: keep tests/ importable.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuzz_long", "the long API fuzz profile (-m fuzz_long)")
    group.addoption("--fuzz-examples", type=int, default=100, help="examples (default 100)")
    group.addoption("--fuzz-steps", type=int, default=30, help="steps per example (default 30)")
    group.addoption(
        "--fuzz-seed", type=int, default=None, help="hypothesis seed (default: a new one)"
    )
    group.addoption(
        "--fuzz-timeout", type=float, default=60.0, help="seconds one call may take (default 60)"
    )
    group.addoption("--fuzz-no-shrink", action="store_true", help="report a failure unshrunk")


@pytest.fixture(scope="session", autouse=True)
def _forkserver_with_dynamo() -> None:
    """Start ``run_ranks``' forkserver with ``torch._dynamo`` imported too.

    A rank's first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 2 s of
    CPU, in every rank of every ``run_ranks``, as the forkserver preloads only
    ``torch`` and ``zero3_offload``). Imported once in the forkserver, every rank
    forks with it. ``run_ranks`` sets its own preload list later; a running
    forkserver keeps the list it started with. Started inside the first test, as
    ``run_ranks`` would, so that the ranks' output goes to pytest's capture.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch._dynamo", "zero3_offload"]
        )
        forkserver.ensure_running()
