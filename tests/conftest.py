import multiprocessing
import sys
from multiprocessing import forkserver
from pathlib import Path

# Rank processes unpickle test functions by module name: keep tests/ importable.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: object) -> None:
    """Start ``run_ranks``' forkserver with ``torch._dynamo`` imported too.

    A rank's first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 2 s of
    CPU, in every rank of every ``run_ranks``, as the forkserver preloads only
    ``torch`` and ``zero3_offload``). Imported once in the forkserver, every rank
    forks with it. ``run_ranks`` sets its own preload list later; a running
    forkserver keeps the list it started with.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch._dynamo", "zero3_offload"]
    )
    forkserver.ensure_running()
