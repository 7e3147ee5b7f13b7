import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

# Rank processes unpickle test functions by module name: keep tests/ importable.
sys.path.insert(0, str(Path(__file__).parent))

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
