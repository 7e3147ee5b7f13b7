"""The framework integrations (docs/integrations.md), each through its example as a user
runs it, against the plain framework on the same ranks: ``Zero3Trainer`` under torchrun
at 2 ranks against ``Trainer`` with DDP (and a resumed run against the whole one), TRL's
``SFTTrainer`` with the mixin against plain ``SFTTrainer``, Lightning's ``Zero3Strategy``
against ``strategy="ddp"`` at 2 CPU devices. The long profile (``-m frameworks``) adds
GPT-2, one process, TRL at 2 ranks and Lightning's resume. Then what the Trainer
refuses, each refusal naming the argument."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import build

from zero3_offload import CheckpointError, ConfigError, StateError, Zero3CpuOffloadConfig
from zero3_offload.testing import RankContext, free_port

ROOT = Path(__file__).resolve().parents[1]
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


def example(*args: str, ranks: int = 1) -> list[dict[str, Any]]:
    """Run an example (under torchrun for ``ranks`` > 1); the JSON lines it printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable]
    if ranks > 1:
        launch = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}",
        ]  # fmt: skip
    done = subprocess.run(
        [*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]


def comparisons(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {line["compare"]: line for line in lines if "compare" in line}


def check_trainer(lines: list[dict[str, Any]], arch: str) -> None:
    found = comparisons(lines)
    plain = found[f"Zero3Trainer vs Trainer ({arch})"]
    assert plain["steps"] == 8
    assert plain["max_loss_diff"] <= LOSS_TOL and plain["max_weight_diff"] <= WEIGHT_TOL, plain
    resumed = found[f"resumed vs whole ({arch})"]
    assert resumed["max_loss_diff"] == 0.0 and resumed["max_weight_diff"] == 0.0, resumed


def test_trainer_at_two_ranks_equals_trainer_with_ddp_and_resumes_bitwise(tmp_path) -> None:
    # Accumulation 2, clipping 1.0, cosine with warm-up, weight decay (the example's setup).
    check_trainer(
        example("examples/trainer_zero3.py", "--compare", "--resume", "--out", str(tmp_path),
                ranks=2),
        "llama",
    )  # fmt: skip


def test_sft_trainer_with_the_mixin_equals_plain_sft_trainer() -> None:
    # Packing, completion-only loss, the model's own activation checkpointing (TRL's default).
    (line,) = comparisons(example("examples/sft_trl_zero3.py", "--compare")).values()
    assert line["max_loss_diff"] <= LOSS_TOL and line["max_weight_diff"] <= WEIGHT_TOL, line
    assert line["accuracy_equal"]  # TRL's token accuracy, from the fused head under ZeRO-3


def test_lightning_strategy_equals_ddp_on_every_rank(tmp_path) -> None:
    lines = example("examples/lightning_zero3.py", "--compare", "--out", str(tmp_path))
    assert sorted(line["rank"] for line in lines) == [0, 1]
    for line in lines:
        assert line["micro_steps"] == 12  # 6 steps of 2 micro-batches
        assert line["max_loss_diff_vs_ddp"] <= LOSS_TOL, line


@pytest.mark.frameworks
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_trainer_long_profile(tmp_path, arch, ranks) -> None:
    args = ("--arch", arch, "--compare", "--resume", "--out", str(tmp_path))
    check_trainer(example("examples/trainer_zero3.py", *args, ranks=ranks), arch)


@pytest.mark.frameworks
def test_trainer_checkpoint_of_two_ranks_resumes_on_one(tmp_path) -> None:
    example("examples/trainer_zero3.py", "--out", str(tmp_path / "two"), ranks=2)
    middle = tmp_path / "two" / "zero3" / "checkpoint-4"
    (line,) = example("examples/trainer_zero3.py", "--resume-from", str(middle), "--out",
                      str(tmp_path / "one"))  # fmt: skip
    losses = {int(k): v for k, v in line["resumed_losses"].items()}
    assert sorted(losses) == list(range(1, 9))  # steps 1-4 from the checkpoint's history
    assert all(0 < v < 5 for v in losses.values())


@pytest.mark.frameworks
def test_sft_trainer_long_profile_two_ranks(tmp_path) -> None:
    lines = example("examples/sft_trl_zero3.py", "--compare", "--out", str(tmp_path), ranks=2)
    (line,) = comparisons(lines).values()
    assert line["max_loss_diff"] <= LOSS_TOL and line["max_weight_diff"] <= WEIGHT_TOL, line


@pytest.mark.frameworks
def test_lightning_long_profile_resume(tmp_path) -> None:
    args = ("--compare", "--resume", "--out", str(tmp_path))
    for line in example("examples/lightning_zero3.py", *args):
        assert line["max_loss_diff_resumed"] <= LOSS_TOL, line


# ------------------------------------------------------------------- refusals


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.ids = torch.randint(0, 97, (count, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: Path, **fields: Any) -> Any:
    import transformers

    base = dict(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    return transformers.TrainingArguments(**{**base, **fields})


@pytest.mark.ranks(1)
async def test_trainer_refuses_what_it_cannot_honour(rank: RankContext, tmp_path: Path) -> None:
    from zero3_offload.integrations import Zero3Trainer

    model = build("gpt2")
    with pytest.raises(ConfigError, match=r"optim='adafactor'.*not honoured"):
        Zero3Trainer(model=model, args=_args(tmp_path, optim="adafactor"), train_dataset=Rows(8))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"optimizers=\(optimizer"):
        Zero3Trainer(model=model, args=_args(tmp_path), optimizers=(sgd, None))
    clipped = Zero3CpuOffloadConfig(gradient_clipping=0.5)
    with pytest.raises(ConfigError, match=r"gradient_clipping=0.5.*max_grad_norm=1.0"):
        Zero3Trainer(model=model, args=_args(tmp_path), zero3_config=clipped)
    # 3 batches per epoch with accumulation 2: the last window would be short.
    trainer = Zero3Trainer(model=model, args=_args(tmp_path), train_dataset=Rows(6))
    with pytest.raises(StateError, match=r"after 1 micro-batch.*every window must be full"):
        trainer.train()
    with pytest.raises(CheckpointError, match="not saved by a Zero3Trainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    trainer.close()


@pytest.mark.ranks(1)
async def test_zero3_config_from_a_deepspeed_json(rank: RankContext, tmp_path: Path) -> None:
    from zero3_offload.integrations import Zero3Trainer, config_from_deepspeed

    ds = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "stage3_param_persistence_threshold": 1000,
        },
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    config = config_from_deepspeed(path)
    assert (config.offload_params, config.offload_optimizer_states) == (False, True)
    assert (config.pin_cpu_memory, config.param_persistence_threshold) == (False, 1000)
    trainer = Zero3Trainer(
        model=build("gpt2"), args=_args(tmp_path, max_grad_norm=0.5), zero3_config=str(path)
    )
    ours = trainer.zero3.config
    assert ours.offload_params is False and ours.param_persistence_threshold == 1000
    assert (ours.gradient_clipping, ours.gradient_accumulation_steps) == (0.5, 2)  # the args'
    trainer.close()
    bad = tmp_path / "stage2.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="stage"):
        config_from_deepspeed(bad)


@pytest.mark.ranks(1)
async def test_trainer_with_a_peft_model_saves_the_adapter_as_plain_trainer(
    rank: RankContext, tmp_path: Path
) -> None:
    import peft
    import transformers
    from safetensors.torch import load_file

    from zero3_offload.integrations import Zero3Trainer

    def lora() -> Any:
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(build("llama"), lora_config)
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # nonzero B: every adapter weight moves from the first step
                torch.nn.init.normal_(p, std=0.02)
        return model

    args = {"learning_rate": 1e-2, "weight_decay": 0.1, "max_steps": 2, "seed": 0}
    out = {}
    for kind in ("plain", "zero3"):
        cls = transformers.Trainer if kind == "plain" else Zero3Trainer
        trainer = cls(model=lora(), args=_args(tmp_path / kind, **args), train_dataset=Rows(8))
        trainer.train()
        trainer.save_model(str(tmp_path / kind / "final"))
        out[kind] = load_file(tmp_path / kind / "final" / "adapter_model.safetensors")
        assert (tmp_path / kind / "final" / "adapter_config.json").is_file()
        if kind == "zero3":
            trainer.close()
    assert out["zero3"].keys() == out["plain"].keys() and len(out["plain"]) == 8
    for name, value in out["plain"].items():
        assert (out["zero3"][name] - value).abs().max().item() <= WEIGHT_TOL, name


@pytest.mark.ranks(1)
async def test_trainer_from_a_model_directory_reads_slices_and_trains_as_plain_trainer(
    rank: RankContext, tmp_path: Path
) -> None:
    import transformers
    from safetensors.torch import load_file

    from zero3_offload.integrations import Zero3Trainer

    build("llama").save_pretrained(tmp_path / "model")
    args = {"learning_rate": 1e-2, "weight_decay": 0.1, "max_steps": 2, "seed": 0}
    plain = transformers.Trainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model"),
        args=_args(tmp_path / "plain", **args),
        train_dataset=Rows(8),
    )
    plain.train()
    plain.save_model(str(tmp_path / "plain" / "final"))
    ours = Zero3Trainer(
        model=str(tmp_path / "model"), args=_args(tmp_path / "ours", **args), train_dataset=Rows(8)
    )
    assert ours.model is ours.zero3.model  # built on the meta device, each unit read by slices
    ours.train()
    ours.save_model(str(tmp_path / "ours" / "final"))
    ours.close()
    a = load_file(tmp_path / "ours" / "final" / "model.safetensors")
    b = load_file(tmp_path / "plain" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= WEIGHT_TOL
    with pytest.raises(ConfigError, match="peft_config"):
        Zero3Trainer(model=str(tmp_path / "model"), args=_args(tmp_path), peft_config=object())
