"""Every example runs, in a short mode, as a user would run it.

``train_tiny.py`` runs once per option, each run shared by the tests that read it: the
same 20 steps with clipping at 0.5 (so that speculative updates have something to
undo), plain and with one option each, which must not change the losses.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
TINY = ("examples/train_tiny.py", "--steps", str(STEPS), "--gradient-clipping", "0.5")


def run_example(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[str, Path | None]]:
    """``tiny(*options)``: the output of ``train_tiny.py`` (``TINY`` and ``options``) and
    its ``--nvme-path`` directory; each distinct run happens once per module."""
    runs: dict[tuple[str, ...], tuple[str, Path | None]] = {}

    def run(*options: str) -> tuple[str, Path | None]:
        if options not in runs:
            disk = None
            if "--nvme-path" in options:
                disk = tmp_path_factory.mktemp("tier")
                options_run = tuple(str(disk) if o == "DISK" else o for o in options)
            else:
                options_run = options
            runs[options] = run_example(*TINY, *options_run), disk
        return runs[options]

    return run


def _losses_and_kept(out: str) -> tuple[list[str], int, float]:
    losses = re.findall(r"step +\d+ +loss (\d+\.\d+)", out)
    kept = int(re.search(r"kept for backward after the first forward: (\d+) bytes", out)[1])
    evaluated = float(re.search(r"eval loss (\d+\.\d+)", out)[1])
    return losses, kept, evaluated


@pytest.mark.slow
def test_train_tiny_loss_falls(tiny) -> None:
    out, _ = tiny()
    losses, kept, evaluated = _losses_and_kept(out)
    assert len(losses) == STEPS
    assert float(losses[-1]) < 0.6 * float(losses[0])
    assert evaluated < 0.6 * float(losses[0])
    # Activation checkpointing: the same losses (no dropout), fewer bytes kept.
    ckpt_losses, ckpt_kept, ckpt_eval = _losses_and_kept(tiny("--activation-checkpointing")[0])
    assert ckpt_losses == losses
    assert ckpt_eval == evaluated
    assert 0 < 3 * ckpt_kept < kept


@pytest.mark.slow
def test_train_tiny_speculative_updates_give_the_same_losses(tiny) -> None:
    waiting, speculative = tiny()[0], tiny("--speculative")[0]
    assert _losses_and_kept(speculative) == _losses_and_kept(waiting)
    undone = int(re.search(r"speculative updates undone: (\d+) steps", speculative)[1])
    assert 0 < undone <= STEPS  # clipping at 0.5 applies in this run: updates were redone
    assert "speculative updates undone: 0 steps" in waiting


@pytest.mark.slow
def test_train_tiny_on_the_disk_tier_gives_the_same_losses(tiny) -> None:
    memory = tiny()[0]
    disk, tier = tiny("--nvme-path", "DISK")
    assert _losses_and_kept(disk) == _losses_and_kept(memory)
    read, written = (
        int(v)
        for v in re.search(r"disk tier: (\d+) bytes read .* (\d+) bytes written", disk).groups()
    )
    # Every update of the steps read its layer's record and wrote it back; construction
    # wrote every record's master part, a third of it (AdamW's master and two moments).
    assert read > 0 and written * 3 * STEPS == read * (3 * STEPS + 1)
    assert not any(tier.iterdir())  # the ranks' files are gone
    # The compute copies on disk too: the same losses, more bytes read and written.
    both, tier = tiny("--nvme-path", "DISK", "--nvme-params")
    assert _losses_and_kept(both) == _losses_and_kept(memory)
    more = re.search(r"disk tier: (\d+) bytes read .* (\d+) bytes written", both).groups()
    assert int(more[0]) > read and int(more[1]) > written
    assert not any(tier.iterdir())


@pytest.mark.slow
def test_finetune_transformers_trains_and_exports() -> None:
    pytest.importorskip("transformers")
    out = run_example("examples/finetune_transformers.py", "--steps", "20")
    losses = [float(v) for v in re.findall(r"step +\d+ +loss (\d+\.\d+)", out)]
    assert len(losses) == 20
    assert losses[-1] < 0.8 * losses[0]
    evaluated = re.search(r"^eval loss (\d+\.\d+)", out, re.M)[1]
    reloaded = re.search(r"reloaded with transformers: eval loss (\d+\.\d+)", out)[1]
    assert evaluated == reloaded  # the export holds exactly the trained weights
    assert re.search(r"generated: b'ZeRO stage", out)
