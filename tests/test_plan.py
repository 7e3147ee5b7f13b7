"""``zero3-offload plan``: predicted peaks against real training runs, the JSON and table
output, and ``--memory-per-rank``'s choice.

Two tiny models with weights (a Llama and a Qwen2, built from configs) are trained for
real with ``zero3-offload train`` on one rank; each rank's peak resident set (``VmHWM``,
logged at the end) must be within ±10% of the plan's ``host_peak_bytes``. The machine's
figures are measured once for the module (``plan.calibrate.measure``: its runtime comes
from two training runs of a 32-wide Llama), and written where the command reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from helpers import run_named  # noqa: E402

from zero3_offload import ConfigError, Zero3CpuOffloadConfig, Zero3CpuOffloadManager  # noqa: E402
from zero3_offload.cli import main  # noqa: E402
from zero3_offload.plan import (  # noqa: E402
    HEADROOM,
    MemoryBudget,
    NothingFitsError,
    choose_config,
    measure,
    plan,
)
from zero3_offload.plan.budget_config import _FIXED  # noqa: E402
from zero3_offload.plan.calibration import Calibration, cache_path, in_own_loop  # noqa: E402
from zero3_offload.plan.planner import plan_run  # noqa: E402
from zero3_offload.testing import RankContext  # noqa: E402
from zero3_offload.train.adapters import peft_config_of  # noqa: E402
from zero3_offload.train.options import TRAIN_DEFAULTS, TrainOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN = {"world_size": 1, "batch_size": 1, "seq_len": 512, "corpus_mb": 0.2}
RUN_FLAGS = ["--steps", "3", "--eval-batches", "1", "--eval-every", "0", "--warmup-steps", "1"]
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan")
    common = dict(max_position_embeddings=1024, tie_word_embeddings=False, vocab_size=1024)
    llama = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        **common,
    )
    qwen = transformers.Qwen2Config(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        **common,
    )
    out = {}
    for name, config, cls in (
        ("llama", llama, transformers.LlamaForCausalLM),
        ("qwen2", qwen, transformers.Qwen2ForCausalLM),
    ):
        cls(config).save_pretrained(root / name)  # weights: the run loads with from_pretrained
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> tuple[Calibration, dict[str, str]]:
    """The figures of this machine for one rank, and an environment whose cache has them."""
    figures = measure(1)
    cache = tmp_path_factory.mktemp("cache")
    env = {"XDG_CACHE_HOME": str(cache)}
    for ranks in (1, 2):  # the 2-rank manager below plans with the same figures
        path = cache_path(ranks).relative_to(cache_path(ranks).parents[1])
        (cache / path).parent.mkdir(parents=True, exist_ok=True)
        (cache / path).write_text(json.dumps(figures.to_dict()))
    return figures, env


def measured_peak(model: Path, out: Path, *flags: str, env: dict[str, str]) -> tuple[int, str]:
    """The peak RSS of a real ``zero3-offload train`` run (largest rank), and its stderr."""
    args = ["--model", str(model), "--out", str(out), *RUN_FLAGS, *flags]
    args += ["--world-size", "1", "--batch-size", "1", "--seq-len", "512", "--corpus-mb", "0.2"]
    done = subprocess.run(
        [sys.executable, "-m", "zero3_offload", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = [
        record["peak_rss_bytes"]
        for log in (out / "logs").glob("rank*.jsonl")
        for record in map(json.loads, log.read_text().splitlines())
        if record["event"] == "train_done"
    ]
    return max(peaks), done.stderr


def within(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


def test_a_full_run_peaks_as_planned(
    models: dict[str, Path], calibration: tuple[Calibration, dict[str, str]], tmp_path: Path
) -> None:
    figures, env = calibration
    config = Zero3CpuOffloadConfig(**TRAIN_DEFAULTS, activation_checkpointing=True)
    planned = plan(models["llama"], config, calibration=figures, **RUN)
    measured, _ = measured_peak(
        models["llama"], tmp_path / "run", "--activation-checkpointing", env=env
    )
    assert within(planned.host_peak_bytes, measured), (planned.host_peak_bytes, measured)
    assert planned.host_peak_bytes == sum(planned.breakdown.values())
    # The model state is the engine's own count: an fp32 master and AdamW's two moments per
    # parameter (the gradient shards are let go before the forward's end: one micro-step).
    state = ("master shards", "optimizer state")
    assert sum(planned.breakdown[k] for k in state) >= 12 * planned.params


def test_memory_per_rank_chooses_a_lora_run_that_fits_and_trains(
    models: dict[str, Path], calibration: tuple[Calibration, dict[str, str]], tmp_path: Path
) -> None:
    figures, env = calibration
    opts = TrainOptions(model=str(models["qwen2"]), lora="r=8", **RUN)
    start = Zero3CpuOffloadConfig(**TRAIN_DEFAULTS)
    default = plan(models["qwen2"], start, calibration=figures, lora="r=8", **RUN)
    # The defaults do not fit: a plan must leave HEADROOM of the budget free.
    budget = int(default.host_peak_bytes / (1 - HEADROOM)) - (8 << 20)
    choice = choose_config(opts, start, budget, calibration=figures)
    usable = budget * (1 - HEADROOM)
    assert choice.chosen.plan.host_peak_bytes <= usable < default.host_peak_bytes
    assert choice.config_file(), "something had to change"
    assert all(c.why for c in choice.runners_up)
    faster_fitting = [
        r
        for r in choice.runners_up
        if r.fits and r.plan.predicted_step_s < choice.chosen.plan.predicted_step_s
    ]
    assert faster_fitting == []
    measured, stderr = measured_peak(
        models["qwen2"],
        tmp_path / "run",
        "--lora",
        "r=8",
        "--memory-per-rank",
        str(budget),
        env=env,
    )
    assert "memory_per_rank=" in stderr and "chose" in stderr
    assert within(choice.chosen.plan.host_peak_bytes, measured), (
        choice.chosen.plan.host_peak_bytes,
        measured,
    )
    with pytest.raises(NothingFitsError, match="the smallest peak is") as caught:
        choose_config(opts, start, 64 << 20, calibration=figures)
    assert caught.value.smallest.host_peak_bytes > 64 << 20


# Every option the search changes but the loss's chunk.
_ALL_BUT_THE_LOSS_CHUNK = (
    "activation_checkpointing", "selective_checkpointing_units", "frozen_compression",
    "frozen_decode_at_use", "mlp_chunk_tokens", "prefetch_buffer_size", "keep_gathered_bytes",
    "offload_activations", "sequence_parallel_size", "gradient_accumulation_steps",
    "trim_heap_after_forward", "batch_split",
)  # fmt: skip


def test_a_budget_only_a_smaller_loss_chunk_fits_chooses_it(
    models: dict[str, Path], calibration: tuple[Calibration, dict[str, str]]
) -> None:
    figures, _ = calibration
    opts = TrainOptions(model=str(models["qwen2"]), lora="r=8", **RUN)
    start = Zero3CpuOffloadConfig(**TRAIN_DEFAULTS)
    given = plan_run(opts, start, figures)
    quarter = plan_run(opts, start.evolve(loss_chunk_tokens=64), figures)
    # Its logits: 256 tokens of the vocabulary in fp32 at once, then 64.
    assert quarter.host_peak_bytes < given.host_peak_bytes
    budget = int(given.host_peak_bytes / (1 - HEADROOM)) - 1  # the given chunk just misses
    choice = choose_config(opts, start, budget, fixed=_ALL_BUT_THE_LOSS_CHUNK, calibration=figures)
    assert choice.chosen.zero3.loss_chunk_tokens == 64
    assert choice.chosen.plan.host_peak_bytes == quarter.host_peak_bytes
    # A chunk the user gave stays as given, and then nothing fits.
    with pytest.raises(NothingFitsError):
        choose_config(
            opts, start, budget, fixed=(*_ALL_BUT_THE_LOSS_CHUNK, "loss_chunk_tokens"),
            calibration=figures,
        )  # fmt: skip


def test_the_plan_command_prints_a_table_and_json(
    models: dict[str, Path],
    calibration: tuple[Calibration, dict[str, str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, env = calibration
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    args = ["plan", "--model", str(models["llama"]), "--seq-len", "256", "--batch-size", "2"]
    args += ["--world-size", "1", "--activation-checkpointing"]
    assert main([*args, "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    keys = {"host_peak_bytes", "device_peak_bytes", "disk_bytes", "breakdown", "predicted_step_s"}
    assert keys <= set(data)
    assert data["config"]["activation_checkpointing"] is True
    assert data["config"] == Zero3CpuOffloadConfig.from_dict(data["config"]).to_dict()
    assert data["host_peak_bytes"] == sum(data["breakdown"].values())
    assert data["device_peak_bytes"] == 0 and data["disk_bytes"] == 0  # cpu, no disk tier
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "total (peak RSS)" in table and f"{data['host_peak_bytes'] / 2**20:,.1f}" in table
    assert main(["plan", "--seq-len", "256"]) == 2
    assert "give --model" in capsys.readouterr().err


async def budget_manager(
    ctx: RankContext, path: str, cache: str, peft: Any, budget: int | str
) -> dict[str, Any] | str:
    """``from_pretrained(memory_per_rank=budget)`` of a LoRA model on this rank, planned
    from the cache under ``cache``: its configuration after a step, or the error."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache
    try:
        manager = Zero3CpuOffloadManager.from_pretrained(
            Zero3CpuOffloadConfig(**TRAIN_DEFAULTS),
            ctx.group,
            path,
            peft_config=peft,
            memory_per_rank=MemoryBudget(budget, batch_shape=(1, 512)),
        )
    except ConfigError as exc:
        return str(exc)
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before
    async with manager:
        ids = torch.randint(0, 1024, (1, 512), generator=torch.Generator().manual_seed(ctx.rank))
        out = await manager.forward(input_ids=ids, labels=ids)
        await manager.backward(out.loss)
        await manager.optimizer_step(1e-3)
        return manager.config.to_dict()


def test_the_manager_takes_memory_per_rank(
    models: dict[str, Path], calibration: tuple[Calibration, dict[str, str]]
) -> None:
    """Rank 0 plans for the budget, every rank trains its choice; when nothing fits,
    every rank raises the planner's message."""
    figures, env = calibration
    path = str(models["qwen2"])
    peft = peft_config_of(TrainOptions(model=path, lora="r=8"))
    opts = TrainOptions(model=path, world_size=2, batch_size=1, seq_len=512)
    start = Zero3CpuOffloadConfig(**TRAIN_DEFAULTS)
    default = plan_run(opts, start, figures, peft_config=peft)
    budget = int(default.host_peak_bytes / (1 - HEADROOM)) - (8 << 20)  # the defaults do not fit
    want = choose_config(opts, start, budget, fixed=_FIXED, calibration=figures, peft_config=peft)
    cache = env["XDG_CACHE_HOME"]
    results = run_named(
        2,
        {
            "fits": (budget_manager, path, cache, peft, budget),
            "too small": (budget_manager, path, cache, peft, "64MiB"),  # 64 MiB
        },
    )
    assert want.chosen.changes, "something had to change"
    with pytest.raises(ConfigError, match=r"give zero3_offload\.plan\.MemoryBudget"):
        Zero3CpuOffloadManager.from_pretrained(start, None, path, memory_per_rank=budget)
    assert results["fits"] == [want.chosen.zero3.to_dict()] * 2
    for message in results["too small"]:
        assert "memory_per_rank=67108864" in message and "the smallest peak is" in message


def test_figures_measured_inside_a_running_event_loop_run_in_a_loop_of_their_own() -> None:
    # A manager built with memory_per_rank inside an async function measures the
    # calibration there: asyncio.run() cannot run on a thread whose loop is running.
    import asyncio
    import threading

    async def where() -> int:
        return threading.get_ident()

    async def caller() -> tuple[int, int]:
        return threading.get_ident(), in_own_loop(where)

    outer, inner = asyncio.run(caller())
    assert outer != inner
    assert in_own_loop(where) == threading.get_ident()  # no loop running: this thread
