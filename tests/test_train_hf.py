"""``zero3-offload train --model DIR``: fine-tuning a local transformers causal LM.

A tiny Llama (hidden 32, 2 layers, vocabulary 300, so the 256 byte values fit) is
saved with its weights and a BPE tokenizer trained here (no download), and as a
config-only directory without a tokenizer (random init, bytes as tokens). Real
2-rank runs check that training starts from the directory's weights (or from the
seeded random init), that ``--export`` writes what the final checkpoint holds with
the tokenizer, that ``--resume`` continues as the uninterrupted run did, and that a
DeepSpeed config of the transformers integration (``"auto"`` values) drives a run.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from zero3_offload.checkpoint.consolidate import iter_full_parameters  # noqa: E402
from zero3_offload.cli import main  # noqa: E402
from zero3_offload.integrations.meta_model import build_model_from_directory  # noqa: E402
from zero3_offload.train import hf  # noqa: E402
from zero3_offload.train.corpus import ByteCorpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--world-size", "2", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2",
    "--warmup-steps", "0", "--lr", "1e-2", "--log-every", "1", "--corpus-mb", "1",
]  # fmt: skip
EVAL = re.compile(r"eval loss (\d+\.\d+) -> (\d+\.\d+)")
STEP = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d+)", re.MULTILINE)
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo pies"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """data.txt, a Llama with weights and tokenizer, its config alone, a small-vocab config."""
    root = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    words = WORDS.split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000))
    (root / "data.txt").write_text(text)
    from hf_models import TINY_DECODER, save_tiny_llama

    save_tiny_llama(root / "pretrained", text)
    config = transformers.LlamaConfig(**{**TINY_DECODER, "vocab_size": 300})
    config.save_pretrained(root / "config_only")
    transformers.LlamaConfig(**{**config.to_dict(), "vocab_size": 100}).save_pretrained(
        root / "small_vocab"
    )
    names = ("data.txt", "pretrained", "config_only", "small_vocab")
    return {name.split(".")[0]: root / name for name in names}


def run_train(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``zero3-offload train`` in a new process."""
    command = [sys.executable, "-m", "zero3_offload", "train", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a run that must have succeeded."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def train(*args: str) -> str:
    """Run ``zero3-offload train`` in a new process; its stdout (it must succeed)."""
    return ok(run_train(*args))


def steps(out: str) -> dict[int, str]:
    return {int(m[1]): m[3] for m in STEP.finditer(out)}


def evals(out: str) -> tuple[float, float]:
    initial, final = map(float, EVAL.search(out).groups())
    return initial, final


def reference_eval(model: Any, data: Path, tokenizer: Any | None) -> float:
    """The run's initial eval loss, computed here: the batches of both ranks on ``model``."""
    corpus = hf.tokenize(ByteCorpus.load(data=data, max_bytes=10**6), tokenizer, 300)
    model.eval()
    losses = []
    with torch.no_grad():
        for rank in (0, 1):
            for i in range(2):
                x, _ = corpus.batch(
                    split="eval", seed=0, step=i, first=rank * 4, batch_size=4, seq_len=32
                )
                losses.append(model(input_ids=x, labels=x).loss.item())
    return sum(losses) / len(losses)


def checkpoint_params(run: Path) -> dict[str, torch.Tensor]:
    return {name: load() for name, _, load in iter_full_parameters(run / "checkpoints")}


def exported_params(directory: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    return {name: p.detach() for name, p in model.named_parameters()}


def pretrained_args(dirs: dict[str, Path], root: Path) -> tuple[str, ...]:
    return ("--model", str(dirs["pretrained"]), "--data", str(dirs["data"]), "--steps", "6",
            "--out", str(root / "run"), *SMALL)  # fmt: skip


def config_only_args(dirs: dict[str, Path], root: Path) -> tuple[str, ...]:
    ds = root / "ds_config.json"
    concrete = {"gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                "train_micro_batch_size_per_gpu": 4, "train_batch_size": 16}  # fmt: skip
    ds.write_text(json.dumps(DEEPSPEED_HF | concrete))
    return ("--model", str(dirs["config_only"]), "--data", str(dirs["data"]), "--steps", "3",
            "--deepspeed-config", str(ds), "--export", str(root / "export"), *SMALL)  # fmt: skip


@pytest.fixture(scope="module")
def first_runs(
    dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Future[subprocess.CompletedProcess[str]], Path]]]:
    """The two independent runs, started together with the module (one's imports use
    the core the other leaves idle): from the pretrained directory (saving every 3
    steps, exporting) and from the config-only one; each with its directory."""
    roots = {name: tmp_path_factory.mktemp(name) for name in ("pretrained", "config_only")}
    export = ("--export", str(roots["pretrained"] / "export"))
    args = {
        "pretrained": (*pretrained_args(dirs, roots["pretrained"]), "--save-every", "3", *export),
        "config_only": config_only_args(dirs, roots["config_only"]),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: (pool.submit(run_train, *args[name]), roots[name]) for name in roots}


@pytest.mark.slow
def test_pretrained_with_tokenizer_trains_exports_and_resumes(
    dirs: dict[str, Path], first_runs: dict[str, Any]
) -> None:
    future, tmp_path = first_runs["pretrained"]
    args = pretrained_args(dirs, tmp_path)
    run, export = tmp_path / "run", tmp_path / "export"
    out = ok(future.result())
    assert "starting from pretrained weights" in out
    assert "TokenizersBackend of" in out or "TokenizerFast of" in out, out
    initial, final = evals(out)
    assert final < initial, out
    # Training started from the directory's weights, on the tokenizer's tokens.
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["pretrained"])
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(dirs["pretrained"])
    assert initial == pytest.approx(reference_eval(pretrained, dirs["data"], tokenizer), abs=2e-4)

    # The export is the final checkpoint, loadable as is, with the tokenizer.
    assert f"exported the model, tokenizer and generation_config.json to {export}" in out
    assert (export / "generation_config.json").read_bytes() == (
        dirs["pretrained"] / "generation_config.json"
    ).read_bytes()
    straight = exported_params(export)
    saved = checkpoint_params(run)
    assert straight.keys() == saved.keys()
    assert all(torch.equal(straight[name], saved[name]) for name in saved)
    assert not torch.equal(straight["lm_head.weight"], pretrained.lm_head.weight)
    again = transformers.AutoTokenizer.from_pretrained(export)
    assert again(WORDS)["input_ids"] == tokenizer(WORDS)["input_ids"]
    # The exported model's own forward gives the run's final eval loss.
    assert final == pytest.approx(
        reference_eval(transformers.AutoModelForCausalLM.from_pretrained(export),
                       dirs["data"], tokenizer),
        abs=2e-4,
    )  # fmt: skip

    # As if the run had stopped after step 3: the resumed run sees the same data and
    # learning rates, so the same losses and the same final parameters.
    (run / "checkpoints" / "latest").write_text("step-00000003")
    resumed = train(*args, "--resume", "--export", str(tmp_path / "export2"))
    assert "at step 3" in resumed
    assert steps(resumed) == {s: loss for s, loss in steps(out).items() if s > 3}
    continued = exported_params(tmp_path / "export2")
    assert max((continued[n] - straight[n]).abs().max().item() for n in straight) < 1e-6


DEEPSPEED_HF = {  # as the transformers integration writes them: "auto" where Trainer fills in
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 1,
}


@pytest.mark.slow
def test_config_only_directory_starts_from_seeded_random_init_with_bytes(
    dirs: dict[str, Path], first_runs: dict[str, Any]
) -> None:
    future, tmp_path = first_runs["config_only"]
    export = tmp_path / "export"
    out = ok(future.result())
    assert "starting from random init (seed 0)" in out
    assert "bytes as tokens: no tokenizer" in out
    assert "512 tokens per step (4 x 32 tokens per rank x accumulation)" in out
    assert sorted(steps(out)) == [1, 2, 3]
    initial, final = evals(out)
    assert final < initial, out
    torch.manual_seed(0)  # the run's --seed: every rank draws these values
    fresh = build_model_from_directory(dirs["config_only"], on_meta=False)
    assert initial == pytest.approx(reference_eval(fresh, dirs["data"], None), abs=2e-4)
    assert f"exported the model (bytes as tokens) to {export}" in out
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    assert exported_params(export).keys() == dict(fresh.named_parameters()).keys()


# ----------------------------------------------------------------- options, no training


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_deepspeed_config_of_the_transformers_integration(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(DEEPSPEED_HF))
    code, out, err = run_cli(capsys, "--deepspeed-config", str(ds), "--print-config",
                             "--model", str(dirs["pretrained"]), "--lr", "5e-4")  # fmt: skip
    assert code == 0, err
    cfg = json.loads(out)
    train_opts, zero3 = cfg["train"], cfg["zero3"]
    assert train_opts["model"] == str(dirs["pretrained"])
    # "auto": the option keeps its value (default, or the flag given).
    assert (train_opts["lr"], train_opts["batch_size"], train_opts["log_every"]) == (5e-4, 8, 1)
    assert zero3["gradient_accumulation_steps"] == 1 and zero3["gradient_clipping"] == 0.0
    assert zero3["compute_dtype"] == "float32" and zero3["optimizer"]["kind"] == "adamw"
    assert zero3["offload_params"] and zero3["offload_optimizer_states"] and zero3["pin_cpu_memory"]
    assert zero3["gpu_param_memory_budget"] == 4 * 10**9  # elements x fp32 bytes
    for key in ("optimizer.params.lr", "gradient_accumulation_steps", "train_batch_size"):
        assert f"{ds}: {key}='auto' ignored: the option keeps its default" in err
    # Loss-scaling keys matter only with fp16: noted, not listed as unsupported.
    assert f"{ds}: fp16.loss_scale_window=1000 ignored: fp16 is not enabled" in err
    unsupported = [
        "scheduler.type",
        "zero_optimization.overlap_comm",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ]
    assert f"{len(unsupported)} unsupported key(s) ignored: {', '.join(unsupported)}" in err
    assert "--export DIR writes the model at the end" in err


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("export_without_model", "--export={export} is invalid: only a transformers model"),
        ("missing", "--model {missing}: not a directory"),
        ("no_config", "--model {data_dir}: no config.json"),
        ("small_vocab", "the model's vocab_size is 100 < 256: add a tokenizer"),
        ("long_context", "--seq-len=128 is invalid: the model of {config_only} takes at most 64"),
        ("export_not_empty", "--export {data_dir}: exists and is not an empty directory"),
        ("no_transformers", "pip install 'zero3_offload[hf]'"),
    ],
)
def test_model_mistakes_give_one_line_before_any_rank_starts(
    dirs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    expected: str,
) -> None:
    names = {
        "export": str(tmp_path / "export"),
        "missing": str(tmp_path / "missing"),
        "data_dir": str(dirs["data"].parent),
        "config_only": str(dirs["config_only"]),
    }
    model = ["--model", names["config_only"]]
    args = {
        "export_without_model": ["--export", names["export"]],
        "missing": ["--model", names["missing"]],
        "no_config": ["--model", names["data_dir"]],
        "small_vocab": ["--model", str(dirs["small_vocab"])],
        "long_context": [*model, "--seq-len", "128"],
        "export_not_empty": [*model, "--export", names["data_dir"]],
        "no_transformers": model,
    }[case]
    if case == "no_transformers":
        monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    # Small enough to finish quickly should a check be missing.
    small = ["--world-size", "1", "--steps", "1", "--corpus-mb", "0.01"]
    seq = [] if case == "long_context" else ["--seq-len", "16"]
    code, _, err = run_cli(capsys, *args, *small, *seq)
    assert code == 2, err
    assert err.startswith("zero3-offload train: error: ")
    assert expected.format(**names) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_help_documents_model_and_export(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--model DIR Fine-tune the transformers causal LM of this local directory" in text
    assert "--export DIR At the end, write the trained model (and its tokenizer)" in text
