import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

# Rank processes unpickle test functions by module name: keep tests/ importable.
sys.path.insert(0, str(Path(__file__).parent))

# Under `-n 2` (pytest-xdist) two workers, and the processes they start, share 2 cores.
# An OpenMP thread spins for a while after each parallel region (libgomp's default),
# burning a core another process is waiting for: with 2 workers that cost the suite a
# sixth of its CPU time. The workers and the processes tests start wait passively (the
# variable is read when a process starts).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list) -> None:
    for spec in specs:
        spec.env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The plugin (@pytest.mark.ranks) comes with the installed package as its pytest11 entry
# point; an install made before the entry point existed, or disabled plugin autoloading,
# gets it from here.
if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") or "zero3_offload" not in {
    ep.name for ep in entry_points(group="pytest11")
}:
    pytest_plugins = ["zero3_offload.testing.pytest_plugin"]


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


# The files that take longest, longest first (their seconds under `-n 2` on 2 cores):
# pytest-xdist hands whole files to its workers in collection order (pyproject's
# `--dist loadfile --no-loadscope-reorder`), so starting these first lets the workers
# end together instead of one running a long file alone at the end.
LONGEST_FIRST = (
    "test_integrations.py",  # 75 (torchrun, TRL and Lightning processes; 45 s of CPU)
    "test_examples.py",  # 56
    "test_pytest_plugin.py",  # 55
    "test_train.py",  # 45 (its stopped and killed rank with -m faults)
    "test_plan.py",  # 50 (a calibration, three real runs)
    "test_frozen.py",  # 43
    "test_sequence_parallel.py",  # 41
    "test_module_mode.py",  # 37
    "test_train_hf.py",  # 35
    "test_train_lora.py",  # 33
    "test_liveness.py",  # 32
    "test_sft_example.py",  # 25
    "test_checkpoint_crash.py",  # 25
    "test_optimizers.py",  # 25
    "test_fuzz.py",  # 24
    "test_clean_exit.py",  # 21
    "test_tiled_loss.py",  # 20
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable
