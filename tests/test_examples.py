"""Every example runs, in a short mode, as a user would run it.

``train_tiny.py`` runs three times, each run shared by the tests that read it: the
same 20 steps with clipping at 0.5 (so that speculative updates have something to
undo), plain, with checkpointing and speculative updates, and with both disk tiers;
no option may change the losses. The runs are independent processes: they start with
the module, two at a time, so that one's imports use the core the other leaves idle.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
TINY = ("examples/train_tiny.py", "--steps", str(STEPS), "--gradient-clipping", "0.5")
FINETUNE = ("examples/finetune_transformers.py", "--steps", "20")
QLORA = ("examples/qlora_decode_at_use.py", "--steps", "4")
SELECTIVE = "at use, 2 MiB kept, 2 saving products"  # the QLoRA example's fourth run
# Every run of an example below; DISK stands for a fresh directory.
CKPT_SPECULATIVE = (*TINY, "--activation-checkpointing", "--speculative")
DISKS = (*TINY, "--nvme-path", "DISK", "--nvme-params")
RUNS = (TINY, CKPT_SPECULATIVE, DISKS, FINETUNE, QLORA)


def example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., tuple[str, Path]]]:
    """``run(*args)``: the output of the example run ``args`` (one of ``RUNS``) and its
    DISK directory. Every run starts with the module, two at a time; a test waits for
    the runs it reads, and a run that failed fails those tests."""
    started: dict[tuple[str, ...], tuple[Future[subprocess.CompletedProcess[str]], Path]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for args in RUNS:
            if args in (FINETUNE, QLORA) and importlib.util.find_spec("peft") is None:
                continue  # its test skips
            disk = tmp_path_factory.mktemp("tier")
            actual = (str(disk) if a == "DISK" else a for a in args)
            started[args] = pool.submit(example, *actual), disk

        def output(*args: str) -> tuple[str, Path]:
            future, disk = started[args]
            proc = future.result()
            assert proc.returncode == 0, proc.stderr
            return proc.stdout, disk

        yield output


def _losses_and_kept(out: str) -> tuple[list[str], int, float]:
    losses = re.findall(r"step +\d+ +loss (\d+\.\d+)", out)
    kept = int(re.search(r"kept for backward after the first forward: (\d+) bytes", out)[1])
    evaluated = float(re.search(r"eval loss (\d+\.\d+)", out)[1])
    return losses, kept, evaluated


@pytest.mark.slow
def test_train_tiny_loss_falls(run) -> None:
    out, _ = run(*TINY)
    losses, _, evaluated = _losses_and_kept(out)
    assert len(losses) == STEPS
    assert float(losses[-1]) < 0.6 * float(losses[0])
    assert evaluated < 0.6 * float(losses[0])
    assert "speculative updates undone: 0 steps" in out


@pytest.mark.slow
def test_train_tiny_checkpointing_and_speculative_updates_give_the_same_losses(run) -> None:
    plain, other = run(*TINY)[0], run(*CKPT_SPECULATIVE)[0]
    losses, kept, evaluated = _losses_and_kept(plain)
    other_losses, other_kept, other_evaluated = _losses_and_kept(other)
    assert (other_losses, other_evaluated) == (losses, evaluated)
    assert 0 < 3 * other_kept < kept  # checkpointing: fewer bytes kept for backward
    undone = int(re.search(r"speculative updates undone: (\d+) steps", other)[1])
    assert 0 < undone <= STEPS  # clipping at 0.5 applies in this run: updates were redone


@pytest.mark.slow
def test_train_tiny_on_the_disk_tiers_gives_the_same_losses(run) -> None:
    memory = run(*TINY)[0]
    disk, tier = run(*DISKS)
    assert _losses_and_kept(disk) == _losses_and_kept(memory)
    read, written = (
        int(v)
        for v in re.search(r"disk tier: (\d+) bytes read .* (\d+) bytes written", disk).groups()
    )
    # Every step read and wrote each layer's optimizer record (the fp32 master and AdamW's
    # two moments: 12 bytes an element of the rank's half) and its compute copy (fp32, 4
    # bytes): with the masters alone on disk it would be 12 bytes an element.
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples/train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    elements = sum(p.numel() for p in module.build_model().parameters())
    assert min(read, written) >= STEPS * (12 + 4) * elements // 2
    assert not any(tier.iterdir())  # the ranks' files are gone


@pytest.mark.slow
def test_finetune_transformers_trains_and_exports(run) -> None:
    pytest.importorskip("transformers")
    out = run(*FINETUNE)[0]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss (\d+\.\d+)", out)]
    assert len(losses) == 20
    assert losses[-1] < 0.8 * losses[0]
    evaluated = re.search(r"^eval loss (\d+\.\d+)", out, re.M)[1]
    reloaded = re.search(r"reloaded with transformers: eval loss (\d+\.\d+)", out)[1]
    assert evaluated == reloaded  # the export holds exactly the trained weights
    assert re.search(r"generated: b'ZeRO stage", out)


@pytest.mark.slow
def test_qlora_decoded_at_use_trains_alike_with_fewer_gathered_bytes(run) -> None:
    pytest.importorskip("peft")
    out, _ = run(*QLORA)
    eager, at_use, kept, selective = (
        [float(v) for v in re.search(rf"decoded {how}: losses (.*)", out)[1].split()]
        for how in ("at gather", "at use", "at use, 2 MiB kept", SELECTIVE)
    )
    assert len(eager) == 4
    assert max(abs(a - b) for a, b in zip(eager, at_use, strict=True)) < 1e-5
    gathered = {
        how: int(re.search(rf"decoded {how}: gathered high-water (\d+) bytes", out)[1])
        for how in ("at gather", "at use")
    }
    # fp32 compute, nf4 frozen copies: the frozen weights gathered as about 9/16 byte
    # per element instead of 4 (the adapters and norms stay fp32).
    assert 0 < 3 * gathered["at use"] < gathered["at gather"]
    # Keeping the last units for the recomputing backward changes no number and
    # gathers them once per step instead of twice.
    assert kept == at_use
    total = {
        how: int(re.search(rf"decoded {how}: gathered (\d+) bytes in all", out)[1])
        for how in ("at use", "at use, 2 MiB kept")
    }
    assert 0 < total["at use, 2 MiB kept"] < total["at use"]
    # The last two decoder layers saving their products change no number either; they
    # save more for backward: each one's projection outputs, 2 x 64 tokens x (256 q +
    # 128 k + 128 v + 256 o + 688 gate + 688 up + 256 down) fp32 values, and LoRA's
    # down-projections (2 x 64 tokens x 8 values for each of the 7).
    assert selective == kept
    saved = {
        how: int(re.search(rf"decoded {how}: saved for backward (\d+) bytes", out)[1])
        for how in ("at use, 2 MiB kept", SELECTIVE)
    }
    per_layer = 2 * 64 * (256 + 128 + 128 + 256 + 688 + 688 + 256 + 7 * 8) * 4
    assert saved[SELECTIVE] - saved["at use, 2 MiB kept"] == 2 * per_layer
