"""``zero3-offload train --model DIR --data FILE`` on examples, end to end.

A tiny chat Llama and its tokenizer (built here, see ``chat_data``) are fine-tuned on
2 ranks from chat JSONL with a held-out ``--eval-data``, packed: the banner counts the
examples, every progress line and ``train_step`` log event carries the valid tokens,
the padding fraction and the examples seen, ``analyze`` shows them, the checkpoint
holds the data position, and a run resumed from its middle checkpoint repeats the
uninterrupted run's losses. Files that are not what they say and bad records end
the command with one line naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from chat_data import conversations, save_model_dir, write_jsonl

from zero3_offload.analyze import build_report, read_logs
from zero3_offload.cli import main

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"^step (\d+)/\d+  loss (\d+\.\d+) .* valid ([\d,]+)  pad (\d+\.\d)%  seen (\d+) ", re.M
)
EVAL = re.compile(r"eval loss (\d+\.\d+) -> (\d+\.\d+)")


def run_train(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zero3_offload", "train", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train_sft")
    chats = conversations(70, seed=7)
    return {
        "root": root,
        "model": save_model_dir(root / "model"),
        "data": write_jsonl(root / "chat.jsonl", [{"messages": c} for c in chats[:60]]),
        "eval": write_jsonl(root / "eval.jsonl", [{"messages": c} for c in chats[60:]]),
    }


def common(files: dict[str, Path], out: Path) -> list[str]:
    return [
        "--model", str(files["model"]), "--data", str(files["data"]),
        "--eval-data", str(files["eval"]), "--world-size", "2", "--batch-size", "3",
        "--gradient-accumulation-steps", "2", "--max-seq-len", "96", "--steps", "4",
        "--save-every", "2", "--log-every", "1", "--warmup-steps", "0", "--lr", "1e-2",
        "--pack", "--out", str(out), "--no-progress",
    ]  # fmt: skip


@pytest.mark.slow
def test_fine_tune_on_chat_examples_packed_resumed(files: dict[str, Path]) -> None:
    run = files["root"] / "run"
    proc = run_train(*common(files, run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "60 train examples" in out and "10 eval examples" in out and "packed rows" in out
    assert "12 examples per step" in out and "loss on assistant tokens" in out
    lines = {int(m[1]): m.groups() for m in LINE.finditer(out)}
    assert sorted(lines) == [1, 2, 3, 4]
    assert [int(lines[s][4]) for s in lines] == [12, 24, 36, 48]
    initial, final = map(float, EVAL.search(out).groups())
    assert final < initial
    events = [json.loads(x) for x in (run / "logs" / "rank0.jsonl").open()]
    (loaded,) = [e for e in events if e["event"] == "sft_data"]
    assert (loaded["train_examples"], loaded["eval_examples"], loaded["dropped"]) == (60, 10, 0)
    steps = [e for e in events if e["event"] == "train_step"]
    assert [e["examples_seen"] for e in steps] == [12, 24, 36, 48]
    for e in steps:
        assert e["valid_tokens"] == int(lines[e["step"]][2].replace(",", "")) > 0
        assert 0 <= e["padding_fraction"] < 1 and e["tokens_per_s"] > 0
    meta = json.loads((run / "checkpoints" / "step-00000004" / "metadata.json").read_text())
    assert meta["training_state"]["data"]["examples_seen"] == 48
    training = build_report(read_logs(sorted((run / "logs").glob("*.jsonl")))).training
    assert training is not None and (training.steps, training.examples_seen) == (4, 48)
    assert training.valid_tokens == sum(e["valid_tokens"] for e in steps)
    # Resume from the middle checkpoint: the same examples, so the same losses.
    (run / "checkpoints" / "latest").write_text("step-00000002")
    resumed = run_train(*common(files, run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = {int(m[1]): m.groups() for m in LINE.finditer(resumed.stdout)}
    assert sorted(again) == [3, 4]
    assert all(again[s] == lines[s] for s in again)


def test_hostile_data_is_refused_with_one_line(files: dict[str, Path], capsys) -> None:
    root = files["root"]
    model = str(files["model"])
    parquet = root / "rows.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "hello fox"}] * 20), parquet)
    (root / "rows.txt").write_bytes(parquet.read_bytes())
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"messages": conversations(1)[0]}) + "\n" + '{"messages": []}\n')
    cases = {
        "rows.txt": ("--data", str(root / "rows.txt"), "rows.txt: not text: it is a Parquet"),
        "bad.jsonl": ("--data", str(bad), "bad.jsonl:2: field 'messages' is an empty conversation"),
    }
    for name, (flag, path, message) in cases.items():
        code = main(["train", "--model", model, flag, path, "--world-size", "1", "--steps", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, name
        assert message in err[-1] and "Traceback" not in "\n".join(err), err
