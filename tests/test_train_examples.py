"""The examples of ``zero3-offload train``'s issue run, in a short mode, as a user would.

The two runs are independent processes: they start with the module, together, so that
one's imports use the core the other leaves idle.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.run import get_args_parser

from zero3_offload.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
MULTINODE = ROOT / "examples" / "torchrun_multinode.md"


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def torchrun_commands() -> list[list[str]]:
    """Every torchrun command line in the multi-node guide (continuations joined)."""
    text = MULTINODE.read_text().replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith("torchrun ")]


def local_command() -> list[str]:
    """The guide's local CPU test, on a free port."""
    (local,) = [c for c in torchrun_commands() if "--nnodes" not in c]
    return [local[0], "--master-port", str(free_port()), *local[1:]]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """custom_layers.py for 15 steps and the guide's local CPU test, started together."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            "custom": pool.submit(
                run, sys.executable, "examples/custom_layers.py", "--steps", "15"
            ),
            "local": pool.submit(run, *local_command()),
        }


@pytest.mark.slow
def test_custom_layers_loss_falls_and_the_encoder_runs_alone(started: dict[str, Any]) -> None:
    out = ok(started["custom"].result())
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 15
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3
    assert float(re.search(r"held-out accuracy (\d\.\d+)", out)[1]) > 0.3  # chance: 0.25
    assert "encoder features: (256, 32)" in out


def test_multinode_guide_commands_parse_with_torchrun() -> None:
    commands = torchrun_commands()
    assert len(commands) == 4  # local test, node 0, node 1, elastic rendezvous
    for command in commands:
        args = get_args_parser().parse_args(command[1:])
        assert args.module and args.training_script == "zero3_offload"
        assert args.training_script_args[0] == "train"


@pytest.mark.slow
def test_multinode_guide_local_cpu_test_runs(started: dict[str, Any]) -> None:
    (local,) = [c for c in torchrun_commands() if "--nnodes" not in c]
    assert local == shlex.split("torchrun --nproc-per-node 2 -m zero3_offload train --steps 3")
    out = ok(started["local"].result())  # that command, on a free port
    assert "on 2 rank(s)" in out and "finished step 3/3" in out
    first, last = map(float, re.search(r"eval loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first
