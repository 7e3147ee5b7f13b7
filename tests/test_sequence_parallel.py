"""Sequence parallelism (Ulysses, ``sequence_parallel_size``) on real gloo ranks == plain
single-process transformers training of the whole sequences.

Every rank of a sequence group passes the same batch; the manager cuts the sequence,
runs attention over the whole of it through all-to-alls, and gives each rank the whole
sequence's loss. The references train the same model (same seed, same attention
implementation) on the whole batch of every group, in one process. The rank runs are
shared: one run per world size trains every variant in turn.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft
import torch
import torch.nn.functional as F
from helpers import LargestTensor, run_named
from hf_models import TINY_DECODER, enable_model_checkpointing, guarded, max_diff, unwrap
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.errors import ConfigError, Zero3Error
from zero3_offload.testing import RankContext

ROWS = 2  # rows of each group's batch
SEQ = 16
LR = 1e-3
STEPS = 5
SAVE_AT = 3  # steps before the checkpoint of the resharding test
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


# ------------------------------------------------------------------------------- models


def build_model(kind: str, attn: str, *, model_ckpt: bool = False) -> nn.Module:
    """A fresh tiny decoder (seed 0) with the attention implementation ``attn`` (and
    transformers' own activation checkpointing with ``model_ckpt``)."""
    torch.manual_seed(0)
    if kind == "llama":  # GQA: 4 query heads, 2 key/value heads
        model: nn.Module = LlamaForCausalLM(LlamaConfig(**TINY_DECODER))
    elif kind == "mistral":  # a sliding window smaller than the sequence
        model = MistralForCausalLM(MistralConfig(**TINY_DECODER, sliding_window=5))
    elif kind == "qwen2":  # q, k, v projections with bias
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_DECODER))
    elif kind == "lora":
        base = LlamaForCausalLM(LlamaConfig(**TINY_DECODER))
        base.set_attn_implementation(attn)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(base, lora)
        # LoRA's B starts at zero: give the adapters values so they change the output.
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.02)
    elif kind == "heads3":  # sequence_parallel_size 2 does not divide 3 heads
        heads = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, **heads}))
    elif kind == "kv1":  # one key/value head for 4 query heads: replicated over 2 ranks
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, "num_key_value_heads": 1}))
    else:  # 6 heads, 3 key/value heads: 2 neither divides nor is a multiple of 3
        heads = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, **heads}))
    if kind != "lora":
        model.set_attn_implementation(attn)
    if model_ckpt:
        enable_model_checkpointing(model)
    model.train()
    return model


@attrs.frozen
class Spec:
    """One training run: the model, the data's shape and the window's rules."""

    kind: str = "llama"
    attn: str = "sdpa"
    size: int = 2  # sequence_parallel_size
    steps: int = STEPS
    first: int = 0  # index of the first step (a run continued from a checkpoint)
    seq: int = SEQ
    packed: bool = False  # position ids restart inside every row
    padded: bool = False  # right padding (a 2D attention mask), labels -100 there
    tokens: bool = False  # token-weighted backwards
    acc: int = 1  # micro-steps per optimizer step
    optimizer: str = "adamw"
    config: tuple[tuple[str, Any], ...] = ()  # Zero3CpuOffloadConfig fields
    model_ckpt: bool = False  # transformers' own activation checkpointing
    save_dir: str | None = None
    load_dir: str | None = None


def optimizer_config(spec: Spec) -> OptimizerConfig:
    return OptimizerConfig(kind=spec.optimizer, weight_decay=0.0)


def micro_batch(spec: Spec, index: int, groups: int) -> dict[str, torch.Tensor]:
    """Micro-step ``index``'s whole batch: ``ROWS`` rows per group, ``groups`` groups."""
    g = torch.Generator().manual_seed(1000 + index)
    rows = ROWS * groups
    ids = torch.randint(0, TINY_DECODER["vocab_size"], (rows, spec.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if spec.packed:  # two documents per row, the second starting at a row-dependent place
        starts = torch.randint(3, spec.seq - 3, (rows,), generator=g)
        batch["position_ids"] = torch.stack(
            [torch.cat([torch.arange(int(s)), torch.arange(spec.seq - int(s))]) for s in starts]
        )
    if spec.padded:  # right padding of a row-dependent length
        lengths = torch.randint(spec.seq // 2, spec.seq + 1, (rows,), generator=g)
        mask = torch.arange(spec.seq)[None] < lengths[:, None]  # bool: padded as such too
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(~mask, -100)
    return batch


def rows_of(batch: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    return {k: v[group * ROWS : (group + 1) * ROWS] for k, v in batch.items()}


def valid_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Labels a causal LM predicts (the first position predicts nothing)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of the next-token cross entropies, and their count (transformers' shift)."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shifted.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return total, int((shifted != -100).sum())


# -------------------------------------------------------------------- plain reference


@functools.cache
def plain(spec: Spec, groups: int) -> dict[str, Any]:
    """Plain single-process training on every group's rows at once (AdamW or SGD).

    Returns each group's loss of every micro-step and the final parameters. Without
    ``tokens`` the update follows the mean over micro-steps of the mean over groups of
    each group's token mean; with it, the token mean of the whole window.
    """
    model = build_model(spec.kind, spec.attn, model_ckpt=spec.model_ckpt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    kind = torch.optim.AdamW if spec.optimizer == "adamw" else torch.optim.SGD
    opt = kind(trainable, lr=LR, weight_decay=0.0)
    losses: list[list[float]] = []
    for step in range(spec.first + spec.steps):
        micros = [micro_batch(spec, step * spec.acc + m, groups) for m in range(spec.acc)]
        window_tokens = sum(valid_tokens(b) for b in micros)
        for batch in micros:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            # No KV cache in training (transformers detects packed rows only without one).
            logits = model(**inputs, use_cache=False).logits
            group_losses, objective = [], logits.new_zeros(())
            for group in range(groups):
                part = rows_of(batch, group)
                total, count = token_losses(
                    logits[group * ROWS : (group + 1) * ROWS], part["labels"]
                )
                group_losses.append((total / count).item())
                if spec.tokens:
                    objective = objective + total / window_tokens
                else:
                    objective = objective + total / count / (groups * spec.acc)
            objective.backward()
            if step >= spec.first:
                losses.append(group_losses)
        opt.step()
        opt.zero_grad()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "state": state}


# -------------------------------------------------------------------------- rank runs


def make_config(spec: Spec) -> Zero3CpuOffloadConfig:
    fields = dict(spec.config)
    if "nvme" in fields.values():  # a disk tier directory of this rank's own
        fields["nvme_path"] = tempfile.mkdtemp(prefix="zero3-sp-")
    return Zero3CpuOffloadConfig(
        optimizer=optimizer_config(spec),
        sequence_parallel_size=spec.size,
        gradient_accumulation_steps=spec.acc,
        cpu_memory_budget=2**30,
        gpu_param_memory_budget=2**28,
        collective_timeout_s=120.0,
        **fields,
    )


async def train_sp(ctx: RankContext, spec: Spec) -> dict[str, Any]:
    """Train with the manager: every rank of a group passes its group's whole rows.

    Returns this rank's ``out.loss`` of every micro-step and the full parameters.
    """
    model = build_model(spec.kind, spec.attn, model_ckpt=spec.model_ckpt)
    groups = ctx.world_size // spec.size
    group = ctx.rank // spec.size
    config = make_config(spec)
    manager = Zero3CpuOffloadManager(config, ctx.group, model)
    try:
        if spec.load_dir is not None:
            await manager.load_checkpoint(spec.load_dir)
        losses = []
        for step in range(spec.first, spec.first + spec.steps):
            for m in range(spec.acc):
                batch = rows_of(micro_batch(spec, step * spec.acc + m, groups), group)
                out = await manager.forward(**batch)
                tokens = valid_tokens(batch) if spec.tokens else None
                await manager.backward(out.loss, tokens=tokens)
                losses.append(out.loss.item())
                kept_logits = out.logits is not None
                await manager.optimizer_step(LR)
        if spec.save_dir is not None:
            await manager.save_checkpoint(spec.save_dir)
        state = await manager.full_state_dict()
        attention = manager.model.config._attn_implementation  # type: ignore[union-attr]
    finally:
        await manager.close()
        if config.nvme_path is not None:
            shutil.rmtree(config.nvme_path)
    restored = model.config._attn_implementation  # type: ignore[union-attr]
    return {
        "losses": losses,
        "state": state,
        "attention": (attention, restored),
        "kept_logits": kept_logits,
    }


async def refusal(ctx: RankContext, spec: Spec) -> str:
    """The ConfigError the manager's construction raises for ``spec``."""
    model = build_model(spec.kind, spec.attn, model_ckpt=spec.model_ckpt)
    try:
        manager = Zero3CpuOffloadManager(make_config(spec), ctx.group, model)
    except ConfigError as exc:
        return str(exc)
    await manager.close()
    return "built"


def _raise(module: nn.Module, args: Any) -> None:
    raise RuntimeError("injected into rank 1's last attention")


async def misuse(ctx: RankContext) -> dict[str, Any]:
    """Calls sequence parallelism refuses (each one's error class), then a step that must
    train like a fresh run's first."""
    spec = Spec(steps=1)
    model = build_model(spec.kind, spec.attn, model_ckpt=spec.model_ckpt)
    manager = Zero3CpuOffloadManager(make_config(spec), ctx.group, model)
    batch = micro_batch(spec, 0, 1)
    out: dict[str, Any] = {}
    calls = {
        "positional": lambda: manager.forward(batch["input_ids"]),
        "embeds": lambda: manager.forward(inputs_embeds=torch.ones(ROWS, SEQ, 32)),
        "ragged_labels": lambda: manager.forward(
            input_ids=batch["input_ids"], labels=batch["labels"][:, :-1]
        ),
        "generate": lambda: manager.generate(batch["input_ids"][:, :4], max_new_tokens=2),
        # each rank its own batch: found at the first attention, on every rank
        "different": lambda: manager.forward(**micro_batch(spec, 7 + ctx.rank, 1)),
        # rank 1's model raises as its last attention starts: rank 0, waiting in that
        # attention's all-to-all, is told by rank 1's failure report
        "one_rank": lambda: manager.forward(**batch),
    }
    for name, call in calls.items():
        hook = None
        if name == "one_rank" and ctx.rank == 1:
            hook = model.model.layers[-1].self_attn.register_forward_pre_hook(_raise)
        try:
            await call()
            out[name] = "ok"
        except Zero3Error as exc:
            out[name] = type(exc).__name__
            out[f"{name}_message"] = str(exc)
        finally:
            if hook is not None:
                hook.remove()
    result = await manager.forward(**batch)
    await manager.backward(result.loss)
    await manager.optimizer_step(LR)
    out["losses"] = [result.loss.item()]
    out["state"] = await manager.full_state_dict()
    await manager.close()
    return out


EXACT2: dict[str, Spec] = {
    # Each family once; eager attention (its additive mask) with Mistral's window, packed
    # rows and a replicated key/value head below.
    "llama-sdpa": Spec(kind="llama", attn="sdpa"),
    "mistral-eager": Spec(kind="mistral", attn="eager"),
    "mistral-sdpa": Spec(kind="mistral", attn="sdpa"),
    "qwen2-sdpa": Spec(kind="qwen2", attn="sdpa"),
    "packed-sdpa": Spec(kind="llama", attn="sdpa", packed=True),
    "packed-eager": Spec(kind="mistral", attn="eager", packed=True),
    # Right padding, a length S does not divide, token weighting over 2 micro-steps; SGD
    # (its update is proportional to the gradient: a wrong scale shows).
    "padded-tokens-sgd": Spec(seq=15, padded=True, tokens=True, acc=2, optimizer="sgd"),
    "sgd": Spec(optimizer="sgd", acc=2),
    "recompute": Spec(config=(("activation_checkpointing", True),)),
    # transformers' checkpointing: the decoder layers' all-to-alls run again in backward
    "model-ckpt": Spec(attn="eager", model_ckpt=True),
    "lora": Spec(kind="lora"),
    # The slice's loss tiled in chunks of 3 positions (a ragged last one), and the model's
    # own loss from the slice's full logits (the default 256 tiles a slice in one chunk).
    "tiled-chunks": Spec(config=(("loss_chunk_tokens", 3),)),
    "own-loss": Spec(config=(("loss_chunk_tokens", 0),)),
    # LoRA (a frozen base) with every long-sequence option and the disk tiers: the tiled
    # MLP, checkpointed inputs, compute copies and optimizer state on disk.
    "lora-offloaded": Spec(
        kind="lora",
        config=(
            ("activation_checkpointing", True),
            ("mlp_chunk_tokens", 3),
            ("offload_activations", "nvme"),
            ("offload_param_device", "nvme"),
            ("offload_optimizer_device", "nvme"),
        ),
    ),
    # One key/value head for 4 query heads: each rank gets a copy of it.
    "kv1-eager": Spec(kind="kv1", attn="eager"),
    "kv1-sdpa": Spec(kind="kv1", attn="sdpa"),
}
BF16 = Spec(config=(("compute_dtype", torch.bfloat16),))  # bf16 all-to-alls through gloo
EXACT4: dict[str, Spec] = {  # S = 2 x data parallel 2, and S = 4
    "llama-sdpa": Spec(kind="llama", attn="sdpa"),
    "mistral-eager": Spec(kind="mistral", attn="eager", packed=True),
    "padded-tokens-sgd": Spec(padded=True, tokens=True, acc=2, optimizer="sgd"),
    # S = 4 on 4 ranks: 2 key/value heads replicated, each one over the 2 ranks whose
    # query heads use it.
    "s4-replicated-kv": Spec(size=4, attn="eager"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("sequence-parallel") / "ckpt")


@pytest.fixture(scope="module")
def runs2(saved: str) -> dict[str, list[Any]]:
    calls: dict[str, tuple[Any, ...]] = {
        name: (guarded, train_sp, spec) for name, spec in EXACT2.items()
    }
    calls["save"] = (guarded, train_sp, Spec(steps=SAVE_AT, save_dir=saved))
    calls["odd-world"] = (guarded, refusal, Spec(size=3))
    calls["odd-heads"] = (guarded, refusal, Spec(kind="heads3"))
    calls["three-kv-heads"] = (guarded, refusal, Spec(kind="kv3"))
    calls["misuse"] = (guarded, misuse)
    calls["bf16"] = (guarded, train_sp, BF16)
    return run_named(2, calls)


@pytest.fixture(scope="module")
def runs4() -> dict[str, list[Any]]:
    return run_named(4, {name: (guarded, train_sp, spec) for name, spec in EXACT4.items()})


def assert_exact(results: list[Any], spec: Spec, groups: int) -> None:
    ref = plain(spec, groups)
    for rank, result in enumerate(unwrap(r) for r in results):
        group = rank // spec.size
        expected = [losses[group] for losses in ref["losses"]]
        diffs = [abs(a - b) for a, b in zip(result["losses"], expected, strict=True)]
        assert max(diffs) < LOSS_TOL, (rank, result["losses"], expected)
        assert max_diff(result["state"], ref["state"]) < PARAM_TOL
        # The model's own attention implementation is set back when the manager closes.
        assert result["attention"] == ("zero3_ulysses", spec.attn)
        # The slice's loss is the tiled one (no logits kept) unless loss_chunk_tokens=0.
        assert result["kept_logits"] == (dict(spec.config).get("loss_chunk_tokens") == 0)


@pytest.mark.parametrize("name", list(EXACT2))
def test_two_ranks_one_sequence_train_like_plain_transformers(
    runs2: dict[str, list[Any]], name: str
) -> None:
    assert_exact(runs2[name], EXACT2[name], groups=1)


@pytest.mark.parametrize("name", list(EXACT4))
def test_four_ranks_train_like_plain_transformers_on_every_group_batch(
    runs4: dict[str, list[Any]], name: str
) -> None:
    assert_exact(runs4[name], EXACT4[name], groups=4 // EXACT4[name].size)


def test_checkpoint_saved_at_two_loads_at_one_rank_and_continues(
    runs2: dict[str, list[Any]], saved: str
) -> None:
    unwrap(runs2["save"][0])
    spec = Spec(size=1, first=SAVE_AT, steps=STEPS - SAVE_AT, load_dir=saved)
    (result,) = run_named(1, {"resume": (guarded, train_sp, spec)})["resume"]
    resumed = unwrap(result)
    ref = plain(Spec(), 1)
    expected = [losses[0] for losses in ref["losses"][SAVE_AT:]]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], expected, strict=True)) < LOSS_TOL
    assert max_diff(resumed["state"], ref["state"]) < PARAM_TOL


def test_refuses_a_size_that_does_not_divide_the_world_or_the_heads(
    runs2: dict[str, list[Any]],
) -> None:
    for message in (unwrap(r) for r in runs2["odd-world"]):
        assert "sequence_parallel_size=3 is invalid with 2 ranks" in message
    for message in (unwrap(r) for r in runs2["odd-heads"]):
        assert "must divide the model's 3 attention heads" in message
    for message in (unwrap(r) for r in runs2["three-kv-heads"]):
        assert "must divide the model's 3 key/value heads" in message
        assert "or be a multiple of them" in message


def _train_command(root: Path, world: int, size: int) -> dict[str, Any]:
    """``zero3-offload train`` on packed chat examples; the step losses and the export."""
    from safetensors.torch import load_file

    out, export = root / f"run-{world}-{size}", root / f"export-{world}-{size}"
    command = [
        sys.executable, "-m", "zero3_offload", "train", "--model", str(root / "model"),
        "--data", str(root / "chat.jsonl"), "--world-size", str(world),
        "--sequence-parallel-size", str(size), "--batch-size", "2", "--max-seq-len", "48",
        "--pack", "--steps", "3", "--lr", "1e-2", "--warmup-steps", "0", "--eval-batches",
        "1", "--out", str(out), "--export", str(export), "--no-progress", "--threads", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "logs" / "rank0.jsonl").open()]
    losses = [e["loss"] for e in events if e["event"] == "train_step"]
    return {"losses": losses, "state": load_file(export / "model.safetensors"), "out": proc.stdout}


@pytest.mark.slow
def test_train_command_splits_packed_sequences_like_one_rank(tmp_path: Path) -> None:
    """``--sequence-parallel-size 2`` on 2 ranks (one data-parallel group) trains on the
    same packed SFT rows as 1 rank does, with the same numbers."""
    from chat_data import conversations, save_model_dir, write_jsonl

    save_model_dir(tmp_path / "model")
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(24, seed=3)])
    one = _train_command(tmp_path, 1, 1)
    split = _train_command(tmp_path, 2, 2)
    assert "each sequence split over 2 ranks, 1 data-parallel group(s)" in split["out"]
    assert len(one["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(one["losses"], split["losses"], strict=True)) < 1e-5
    assert max_diff(one["state"], split["state"]) < PARAM_TOL


def test_train_command_refuses_sequence_parallelism_it_cannot_run() -> None:
    from zero3_offload.train.sources import OptionError, resolve

    with pytest.raises(OptionError, match=r"--sequence-parallel-size=2 is invalid: needs"):
        resolve({"sequence_parallel_size": 2}, env={})
    with pytest.raises(OptionError, match=r"must divide --world-size=3"):
        resolve({"sequence_parallel_size": 2, "world_size": 3, "model": "m"}, env={})
    assert resolve({}, env={}).zero3.sequence_parallel_size == 1


def test_refused_calls_leave_the_manager_usable(runs2: dict[str, list[Any]]) -> None:
    ref = plain(Spec(steps=1), 1)
    for result in (unwrap(r) for r in runs2["misuse"]):
        assert result["positional"] == "InputError"
        assert result["embeds"] == "InputError"
        assert result["ragged_labels"] == "InputError"
        assert result["generate"] == "StateError"
        assert result["different"] == "InputError"
        # One rank's failure in the model, reported on both; the group's collectives are
        # completed (rank 1 launches the all-to-all rank 0 abandoned) and it trains on.
        assert result["one_rank"] == "LayerExecutionError"
        assert "injected into rank 1's last attention" in result["one_rank_message"]
        assert abs(result["losses"][0] - ref["losses"][0][0]) < LOSS_TOL
        assert max_diff(result["state"], ref["state"]) < PARAM_TOL
    message = unwrap(runs2["misuse"][0])["one_rank_message"]
    assert message.startswith("rank 1 failed in forward("), message
    assert "this rank (0) abandoned the sequence group's all-to-all" in message, message


def test_bf16_compute_trains_close_to_fp32(runs2: dict[str, list[Any]]) -> None:
    ref = plain(Spec(), 1)
    for result in (unwrap(r) for r in runs2["bf16"]):
        expected = [losses[0] for losses in ref["losses"]]
        assert max(abs(a - b) for a, b in zip(result["losses"], expected, strict=True)) < 2e-3
        assert max_diff(result["state"], ref["state"]) < 1e-2


def test_a_plain_causal_sequence_builds_no_whole_sequence_mask() -> None:
    # sdpa without a window, padding or packed rows takes is_causal: no [T, T] tensor is
    # made, not even to find that out (at 32k tokens one would be 1 GiB).
    from zero3_offload.sequence import full_sequence_mask

    length = 4096
    with LargestTensor() as mode:
        assert full_sequence_mask(torch.arange(length)[None], None, None, None) is None
    assert mode.largest < length * 16


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rows", ["plain", "packed", "padded"])
def test_whole_sequence_mask_is_transformers_own(attn: str, window: int | None, rows: str) -> None:
    """``full_sequence_mask`` == the mask transformers builds for the model's own
    implementation from the same whole-sequence inputs (no cache, as in training)."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    from zero3_offload.sequence import full_sequence_mask

    spec = Spec(packed=rows == "packed", padded=rows == "padded")
    batch = micro_batch(spec, 3, 2)
    rows_, length = batch["input_ids"].shape
    positions = batch.get("position_ids", torch.arange(length)[None].expand(rows_, -1))
    padding = batch.get("attention_mask")
    config = MistralConfig(**TINY_DECODER, sliding_window=window)
    config._attn_implementation = attn
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    embeds = torch.zeros(rows_, length, TINY_DECODER["hidden_size"])
    theirs = make(config, embeds, padding, cache=None, position_ids=positions)
    dtype = torch.float32 if attn == "eager" else None  # eager: additive; sdpa: boolean
    ours = full_sequence_mask(positions, padding, window, dtype)
    if theirs is None:  # sdpa's is_causal
        assert ours is None
        return
    assert ours is not None
    assert torch.equal(ours.expand_as(theirs), theirs)
