"""``zero3-offload train --model DIR`` with ``--lora``, ``--peft-config``, ``--freeze`` and
``--export-merged``.

Three real 2-rank runs of the command on a tiny Llama with a BPE tokenizer and a chat
template (``hf_models.save_tiny_llama``), accumulation 2 and clipping 1.0, are compared
with plain single-process peft / transformers training on the same batches (the
command's own corpus, both ranks' rows): LoRA adapters from ``--lora``, the same
adapters from ``--peft-config`` exported merged, and a model with its embedding and
first decoder layer frozen. The flags' mistakes, and a
``--resume`` with other adapters or other frozen weights, are refused in one line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file  # noqa: E402

from zero3_offload.cli import main  # noqa: E402
from zero3_offload.integrations.peft_pretrained import reset_adapters  # noqa: E402
from zero3_offload.train import hf  # noqa: E402
from zero3_offload.train.corpus import ByteCorpus  # noqa: E402
from zero3_offload.train.loop import learning_rate  # noqa: E402
from zero3_offload.train.options import TrainOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo pies"
STEPS, BATCH, SEQ, ACC, LR = 4, 3, 24, 2, 1e-2
COMMON = [
    "--world-size", "2", "--steps", str(STEPS), "--batch-size", str(BATCH),
    "--seq-len", str(SEQ), "--gradient-accumulation-steps", str(ACC),
    "--gradient-clipping", "1.0", "--lr", str(LR), "--warmup-steps", "1",
    "--eval-batches", "1", "--corpus-mb", "1", "--log-every", "1",
]  # fmt: skip
LORA = "r=4,alpha=8,dropout=0,target=q_proj,v_proj"
FREEZE = "model.embed_tokens.*,model.layers.0.*"
TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """data.txt and a tiny Llama with weights, a tokenizer with a chat template and a
    generation config of its own."""
    from hf_models import save_tiny_llama

    root = tmp_path_factory.mktemp("lora")
    rng = random.Random(0)
    words = WORDS.split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000))
    (root / "data.txt").write_text(text)
    model = root / "model"
    save_tiny_llama(model, text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    generation = transformers.GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=3)
    generation.save_pretrained(model)
    # --lora's adapters as a peft config directory, for --peft-config.
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    lora.save_pretrained(root / "peft")
    return {"root": root, "data": root / "data.txt", "model": model, "peft": root / "peft"}


def run_train(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zero3_offload", "train", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


RUNS = {
    "lora": ["--lora", LORA],
    "merged": ["--peft-config", "PEFT", "--export-merged"],  # the same adapters as LORA
    "freeze": ["--freeze", FREEZE],
}


@pytest.fixture(scope="module")
def runs(dirs: dict[str, Path]) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The three runs, two at a time, each into ``root/NAME`` (``out``) and
    ``root/NAME-export``."""
    root = dirs["root"]
    base = ["--model", str(dirs["model"]), "--data", str(dirs["data"]), *COMMON]
    with ThreadPoolExecutor(max_workers=2) as pool:
        where = {name: ["--out", str(root / name), "--export", str(root / f"{name}-export")]
                 for name in RUNS}  # fmt: skip
        given = {name: [str(dirs["peft"]) if f == "PEFT" else f for f in flags]
                 for name, flags in RUNS.items()}  # fmt: skip
        yield {name: pool.submit(run_train, *base, *given[name], *where[name]) for name in RUNS}


def finished(runs: dict[str, Any], name: str) -> str:
    proc = runs[name].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def logged_losses(out: Path) -> list[float]:
    """Rank 0's ``train_step`` losses (the global token mean of each step)."""
    lines = (out / "logs" / "rank0.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [e["loss"] for e in events if e.get("event") == "train_step"]


def plain_train(dirs: dict[str, Path], *, lora: bool, freeze: bool) -> tuple[Any, list[float]]:
    """Plain single-process training of what the command trains: both ranks' rows of
    every micro-batch in one batch, AdamW, the command's learning rates, clipping 1.0."""
    opts = TrainOptions(steps=STEPS, batch_size=BATCH, seq_len=SEQ, lr=LR, warmup_steps=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["model"])
    corpus = hf.tokenize(ByteCorpus.load(data=dirs["data"], max_bytes=10**6), tokenizer, 300)
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["model"])
    if lora:
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        )  # fmt: skip
        model = peft.get_peft_model(model, config)
        reset_adapters(model, 0)  # the run's --seed
    if freeze:
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACC):
            # The step's global batch, micro-step by micro-step: both ranks' rows at once.
            first = micro * 2 * BATCH
            x = corpus.batch(
                split="train", seed=0, step=step, first=first, batch_size=2 * BATCH, seq_len=SEQ
            )[0]
            loss = model(input_ids=x, labels=x).loss
            (loss / ACC).backward()
            total += loss.item() / ACC
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, opts)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return model, losses


@pytest.fixture(scope="module")
def plain_lora(dirs: dict[str, Path]) -> tuple[Any, list[float]]:
    return plain_train(dirs, lora=True, freeze=False)


def check_carried(export: Path, dirs: dict[str, Path]) -> None:
    """The export holds the tokenizer with its chat template and the source's
    generation_config.json."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "the fox"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<user> the fox\n"
    source = transformers.AutoTokenizer.from_pretrained(dirs["model"])
    assert tokenizer(WORDS)["input_ids"] == source(WORDS)["input_ids"]
    assert (export / "generation_config.json").read_bytes() == (
        dirs["model"] / "generation_config.json"
    ).read_bytes()


@pytest.mark.slow
def test_lora_from_the_cli_equals_plain_peft_training(
    dirs: dict[str, Path], runs: dict[str, Any], plain_lora: tuple[Any, list[float]]
) -> None:
    out = finished(runs, "lora")
    export = dirs["root"] / "lora-export"
    assert f"LoRA {LORA}; the rest frozen" in out
    assert (
        f"exported the adapter, tokenizer, chat template and generation_config.json to {export}"
        in out
    )
    reference, losses = plain_lora
    ran = logged_losses(dirs["root"] / "lora")
    assert len(ran) == STEPS
    assert max(abs(a - b) for a, b in zip(ran, losses, strict=True)) < 1e-5, (ran, losses)
    assert losses[-1] < losses[0]
    # The adapter directory: peft's names, the trained values.
    saved = load_file(export / "adapter_model.safetensors")
    expected = peft.get_peft_model_state_dict(reference)
    assert saved.keys() == expected.keys() and len(saved) == 8  # A and B of 2 x 2 modules
    assert max((saved[k] - expected[k]).abs().max().item() for k in saved) < 1e-4
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # B moved from 0
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs["model"])
    loaded = peft.PeftModel.from_pretrained(base, export)
    x = torch.tensor([list(range(5, 17))])
    with torch.no_grad():
        diff = (loaded(input_ids=x).logits - reference(input_ids=x).logits).abs().max().item()
    assert diff < 1e-4
    check_carried(export, dirs)


@pytest.mark.slow
def test_merged_export_loads_with_transformers_and_equals_the_peft_model(
    dirs: dict[str, Path], runs: dict[str, Any], plain_lora: tuple[Any, list[float]]
) -> None:
    out = finished(runs, "merged")
    export = dirs["root"] / "merged-export"
    assert "exported the merged model, tokenizer, chat template and generation" in out
    # --peft-config with --lora's adapters: the same run.
    assert logged_losses(dirs["root"] / "merged") == logged_losses(dirs["root"] / "lora")
    merged = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs["model"])
    adapter = peft.PeftModel.from_pretrained(base, dirs["root"] / "lora-export")
    x = torch.tensor([list(range(5, 17)), list(range(40, 52))])
    with torch.no_grad():
        ours = merged(input_ids=x).logits
        theirs = adapter(input_ids=x).logits
        plain = plain_lora[0](input_ids=x).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - plain).abs().max().item() < 1e-4
    check_carried(export, dirs)


@pytest.mark.slow
def test_freeze_from_the_cli_equals_plain_training_with_those_frozen(
    dirs: dict[str, Path], runs: dict[str, Any]
) -> None:
    out = finished(runs, "freeze")
    assert "trainable: " in out and "the rest frozen" in out
    reference, losses = plain_train(dirs, lora=False, freeze=True)
    ran = logged_losses(dirs["root"] / "freeze")
    assert max(abs(a - b) for a, b in zip(ran, losses, strict=True)) < 1e-5, (ran, losses)
    exported = transformers.AutoModelForCausalLM.from_pretrained(dirs["root"] / "freeze-export")
    source = transformers.AutoModelForCausalLM.from_pretrained(dirs["model"])
    ours = dict(exported.named_parameters())
    start = dict(source.named_parameters())
    moved = 0
    for name, param in reference.named_parameters():
        frozen = name.startswith(("model.embed_tokens.", "model.layers.0."))
        if frozen:
            assert torch.equal(ours[name], start[name]), name  # bitwise unchanged
        else:
            assert (ours[name] - param).abs().max().item() < 1e-4, name
            moved += not torch.equal(ours[name], start[name])
    assert moved == len(start) - 1 - 9  # all but the embedding and layer 0's 9 tensors
    check_carried(dirs["root"] / "freeze-export", dirs)


# ---------------------------------------------------------- mistakes, in one process


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


SHORT = ["--world-size", "1", "--steps", "1", "--seq-len", "16", "--batch-size", "2",
         "--eval-batches", "1", "--corpus-mb", "0.05"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--lora", "r=16,rank=4"],
            "--lora='r=16,rank=4' is invalid: unknown key 'rank'; the "
            "keys are r, alpha, dropout, target",
        ),
        (
            ["--lora", "r=16,alpha=-1"],
            "--lora='r=16,alpha=-1' is invalid: alpha='-1': must be a number > 0",
        ),
        (["--lora", "r=2.5"], "r='2.5': must be a whole number >= 1"),
        (["--lora", "dropout=1.5"], "dropout='1.5': must be a number in [0, 1)"),
        (["--lora", "r=4,q_proj"], "'q_proj' is not key=value (only target=... takes several"),
        (["--lora", "r=4,,alpha=8"], "an empty item"),
        (["--lora", "r=4,target=nowhere"], "Target modules {{'nowhere'}} not found"),
        (
            ["--lora", "r=4", "--freeze", "lm_head.*"],
            "--freeze=lm_head.* is invalid with LoRA adapters",
        ),
        (["--lora", "r=4", "--peft-config", "{model}"], "give --lora=SPEC or --peft-config=FILE"),
        (["--export-merged", "--export", "{tmp}/out"], "--export-merged=True is invalid"),
        (["--lora", "r=4", "--export-merged"], "--export-merged=True is invalid"),
        (["--peft-config", "{tmp}/missing.json"], "--peft-config {tmp}/missing.json: cannot read"),
        (["--peft-config", "{tmp}/ia3.json"], "peft_type 'IA3': zero3-offload train takes LoRA"),
        (["--peft-config", "{tmp}/unknown.json"], "not a LoraConfig"),
        (
            ["--freeze", "model.embed*,decoder.*"],
            "--freeze 'decoder.*' matches no parameter of "
            "the model (names are like model.embed_tokens.weight",
        ),
        (["--freeze", "*"], "freezes every parameter: nothing to train"),
        (["--freeze", "a,"], "--freeze='a,' is invalid: an empty pattern"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_bad_adapter_flags_are_refused_in_one_line(
    dirs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    expected: str,
) -> None:
    (tmp_path / "ia3.json").write_text(json.dumps({"peft_type": "IA3"}))
    (tmp_path / "unknown.json").write_text(json.dumps({"peft_type": "LORA", "rank": 4}))
    names = {"tmp": str(tmp_path), "model": str(dirs["model"])}
    flags = [f.format(**names) for f in flags]
    data = ["--data", str(dirs["data"])]
    code, _, err = run_cli(capsys, "--model", str(dirs["model"]), *data, *SHORT, *flags)
    assert code == 2, err
    assert err.startswith("zero3-offload train: error: ")
    assert expected.format(**names) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_adapter_flags_without_model_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, name in ((["--lora", "r=4"], "--lora"), (["--freeze", "x.*"], "--freeze")):
        code, _, err = run_cli(capsys, *SHORT, *flags)
        assert code == 2
        assert f"{name}=" in err and "it applies to a transformers model (--model=DIR)" in err


def test_lora_and_freeze_in_config_files(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'model = "{dirs["model"]}"\n'
        "[lora]\nr = 16\nalpha = 32\ndropout = 0.05\ntarget = ['q_proj', 'v_proj']\n"
    )
    code, out, err = run_cli(capsys, "--config", str(toml), "--print-config")
    assert code == 0, err
    printed = json.loads(out)["train"]
    assert printed["lora"] == {"r": 16, "alpha": 32.0, "dropout": 0.05,
                               "target": ["q_proj", "v_proj"]}  # fmt: skip
    # What --print-config writes is a --config file: the same options again.
    again = tmp_path / "printed.json"
    again.write_text(out)
    code, out2, _ = run_cli(capsys, "--config", str(again), "--print-config")
    assert code == 0 and json.loads(out2) == json.loads(out)
    # The flag and the file's string give the same spec; the flag wins over the file.
    code, out3, _ = run_cli(
        capsys, "--config", str(toml), "--lora", "r=16,alpha=32,dropout=0.05,target=q_proj",
        "--print-config",
    )  # fmt: skip
    assert json.loads(out3)["train"]["lora"]["target"] == ["q_proj"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": str(dirs["model"]), "lora": {"rank": 4}}))
    code, _, err = run_cli(capsys, "--config", str(bad), "--print-config")
    assert code == 2 and f"{bad}: lora={{'rank': 4}} is invalid: unknown key 'rank'" in err
    frozen = tmp_path / "freeze.json"
    frozen.write_text(json.dumps({"model": str(dirs["model"]), "freeze": ["lm_head.*", "x"]}))
    code, out, err = run_cli(capsys, "--config", str(frozen), "--print-config")
    assert code == 0 and json.loads(out)["train"]["freeze"] == ["lm_head.*", "x"]


def test_resume_refuses_other_adapters_or_other_frozen_weights(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(dirs["model"]), "--data", str(dirs["data"]), *SHORT]
    lora_run, frozen_run = ["--out", str(tmp_path / "lora")], ["--out", str(tmp_path / "frozen")]
    assert run_cli(capsys, *args, *lora_run, "--lora", "r=4,target=q_proj")[0] == 0
    assert run_cli(capsys, *args, *frozen_run, "--freeze", "lm_head.*")[0] == 0
    resume = [*args, "--steps", "2", "--resume"]
    # The run's record (OUT/run.json) is checked first, naming the option that differs.
    code, _, err = run_cli(capsys, *resume, *lora_run, "--lora", "r=4,target=q_proj,dropout=0.1")
    assert code == 2 and "holds checkpoints of another run: --lora (" in err, err
    for out in (lora_run, frozen_run):
        (Path(out[1]) / "run.json").unlink()  # below: what the checkpoints record

    def refused(flags: list[str], expected: str) -> None:
        code, _, err = run_cli(capsys, *resume, *flags)
        assert code == 2, err
        assert "--resume: " in err and expected in err, err
        assert "another --out" in err and len(err.strip().splitlines()) == 1

    # The options the checkpoint recorded (training_state.adapters).
    lora = "--lora r=4,alpha=8,dropout=0,target=q_proj"
    refused(
        [*lora_run, "--lora", "r=4,target=q_proj,dropout=0.1"],
        f"was trained with {lora}, this run has {lora.replace('0,', '0.1,')}",
    )
    refused(lora_run, f"was trained with {lora}, this run has no --lora")
    refused(
        [*frozen_run, "--freeze", "lm_head.*,model.norm.*"],
        "was trained with --freeze lm_head.*, this run has --freeze lm_head.*,model.norm.*",
    )
    refused([*frozen_run, "--lora", "r=4"], "was trained with no --lora, --freeze lm_head.*, "
            "this run has --lora r=4,alpha=8,dropout=0, no --freeze")  # fmt: skip
    # Without them (a checkpoint of the library's own save_checkpoint): what the options
    # made of the model, its adapter config and its trainable parameters.
    for run in ("lora", "frozen"):
        root = tmp_path / run / "checkpoints"
        meta_file = root / (root / "latest").read_text().strip() / "metadata.json"
        meta = json.loads(meta_file.read_text())
        assert meta["training_state"]["adapters"]["lora" if run == "lora" else "freeze"]
        meta_file.write_text(json.dumps({**meta, "training_state": None}))
    refused(
        [*lora_run, "--lora", "r=4,target=q_proj,dropout=0.1"],
        "was trained with other LoRA adapters (lora_dropout: 0.0 there, 0.1 here)",
    )
    refused([*lora_run, "--lora", "r=8,target=q_proj"], "(r: 4 there, 8 here)")
    refused([*lora_run, "--lora", "r=4,target=q_proj,v_proj"], "target_modules: ['q_proj'] there")
    refused(lora_run, "was trained with LoRA adapters and this run has no adapters")
    refused([*frozen_run, "--lora", "r=4"], "was trained with no adapters and this run has LoRA")
    refused(frozen_run, "1 frozen there are trained here: lm_head.weight")
    refused([*frozen_run, "--freeze", "lm_head.*,model.norm.*"],
            "1 trained there are frozen here: model.norm.weight")  # fmt: skip
    # The same options resume.
    for flags in (
        [*frozen_run, "--freeze", "lm_head.*"],
        [*lora_run, "--lora", "r=4,target=q_proj"],
    ):
        code, out, err = run_cli(capsys, *resume, *flags)
        assert code == 0, err
        assert "resumed from" in out and "finished step 2/2" in out


@pytest.mark.parametrize("flags", [["--lora", "r=4,target=q_proj"], ["--freeze", "lm_head.*"]])
def test_a_config_only_model_takes_adapters_and_frozen_weights(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    """Without weights the model is the seeded random init (``--seed``): the adapters go
    on it, or its matching parameters are frozen, and the export loads on that init."""
    from zero3_offload.integrations.meta_model import build_model_from_directory

    config_only = tmp_path / "config_only"
    transformers.AutoConfig.from_pretrained(dirs["model"]).save_pretrained(config_only)
    export = tmp_path / "export"
    code, out, err = run_cli(
        capsys, "--model", str(config_only), "--data", str(dirs["data"]), *SHORT, *flags,
        "--lr", "1e-2", "--export", str(export),
    )  # fmt: skip
    assert code == 0, err
    assert "starting from random init (seed 0)" in out and "the rest frozen" in out
    torch.manual_seed(0)  # the run's --seed: the init every rank drew
    fresh = build_model_from_directory(config_only, on_meta=False)
    if flags[0] == "--lora":
        loaded = peft.PeftModel.from_pretrained(fresh, export)
        state = peft.get_peft_model_state_dict(loaded)
        assert len(state) == 4 and any(v.abs().max() > 0 for k, v in state.items() if "lora_B" in k)
        base = {n: p for n, p in fresh.named_parameters() if "lora" not in n}
        assert all(not p.requires_grad for p in base.values())
    else:
        trained = dict(transformers.AutoModelForCausalLM.from_pretrained(export).named_parameters())
        start = dict(fresh.named_parameters())
        assert torch.equal(trained["lm_head.weight"], start["lm_head.weight"])
        assert not torch.equal(trained["model.norm.weight"], start["model.norm.weight"])
