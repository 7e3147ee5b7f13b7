"""The offline SFT example of docs/fine_tuning.md, run command by command as the page
shows it: ``examples/sft_chat.py prepare``, ``zero3-offload train ... --lora ... --export``
at 2 ranks, and ``examples/sft_chat.py generate`` on the exported adapter."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "fine_tuning.md"
ANSWER = re.compile(r"It is (a keyword|a built-in (function|type|exception|warning|constant))\.")


def documented_commands() -> list[list[str]]:
    """The commands of the page's example block, continuations joined."""
    text = PAGE.read_text(encoding="utf-8")
    block = re.search(r"<!-- sft example: commands -->\n```bash\n(.*?)```", text, re.S)
    assert block is not None, "docs/fine_tuning.md has no example block"
    lines = block[1].replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip()]


def run(command: list[str], demo: Path) -> str:
    """``command`` with ``demo`` for the page's directory and this interpreter for
    ``python`` and ``zero3-offload``; its stdout (it must succeed)."""
    program = {"python": [sys.executable], "zero3-offload": [sys.executable, "-m", "zero3_offload"]}
    args = [re.sub(r"^demo(?=/|$)", str(demo), a) for a in command[1:]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [*program[command[0]], *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_the_documented_sft_example_lowers_the_held_out_loss_and_answers(
    tmp_path: Path,
) -> None:
    commands = documented_commands()
    assert [c[:2] for c in commands] == [
        ["python", "examples/sft_chat.py"],
        ["zero3-offload", "train"],
        ["python", "examples/sft_chat.py"],
    ]
    demo = tmp_path / "demo"
    prepared, trained, generated = (run(command, demo) for command in commands)

    train = demo / "train.jsonl"
    held_out = [json.loads(line) for line in (demo / "heldout.jsonl").read_text().splitlines()]
    train_names = {json.loads(line)["messages"][0]["content"] for line in train.open()}
    assert held_out and not train_names & {r["messages"][0]["content"] for r in held_out}
    assert f"held out: {len(held_out)} conversations" in prepared

    # The command learned: the held-out loss (the answers' tokens) fell a lot.
    before, after = map(float, re.search(r"eval loss (\d+\.\d+) -> (\d+\.\d+)", trained).groups())
    assert after < 0.1 * before, trained
    assert "loss on assistant tokens" in trained and "the rest frozen" in trained
    export = demo / "adapter"
    assert (
        f"exported the adapter, tokenizer, chat template and generation_config.json to {export}"
        in trained
    )
    assert (export / "adapter_config.json").is_file()

    # generate: every held-out question answered, in the form the data taught, and
    # better than always naming the most frequent kind.
    answers = re.findall(r"^A: (.*?)  \(data: (.*)\)$", generated, re.M)
    assert len(answers) == len(held_out)
    assert all(ANSWER.fullmatch(got) for got, _ in answers), answers
    right = sum(got == expected for got, expected in answers)
    kinds = [expected for _, expected in answers]
    most = max(kinds.count(k) for k in set(kinds))
    assert right > most, answers
    assert f"held-out answers equal to the data's: {right}/{len(held_out)}" in generated
