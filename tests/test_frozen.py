"""Frozen parameters and peft models on real ranks == plain single-process training.

LoRA through peft (tiny Llama, Qwen2 and GPT-2 built from configs), a frozen input
embedding alone, and a model frozen except its last two decoder layers: the loss of
every micro-step and the trained parameters equal plain peft / transformers training
on the whole batch, the frozen base stays bitwise as it was, no gradient, master or
optimizer state exists for it, and no collective runs for it in backward where no
gradient needs it. One rank run per world size trains every variant in turn.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")

import torch
from helpers import run_named
from hf_models import (
    ACC,
    CLIP,
    LR,
    TINY_DECODER,
    batch,
    call_kwargs,
    enable_model_checkpointing,
    global_mean,
    guarded,
    local,
    loss_of,
    make_config,
    max_diff,
    params,
    unwrap,
)
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from zero3_offload import Zero3CpuOffloadManager
from zero3_offload.parameter import nf4_roundtrip
from zero3_offload.parameter.frozen_embedding import FrozenEmbeddingForward
from zero3_offload.parameter.frozen_linear import FrozenLinearForward
from zero3_offload.testing import RankContext

MICRO_STEPS = 20  # 10 AdamW steps (accumulation 2, clipping 1.0)
SAVE_AT = 10  # micro-steps of the run the checkpoint is saved after
LORAS = ["lora-llama", "lora-qwen2", "lora-gpt2"]  # LoRA on each architecture

AT_USE = {"frozen_decode_at_use": True, "activation_checkpointing": True}
# variant -> (architecture, how it is frozen, manager config fields, model checkpointing)
VARIANTS: dict[str, tuple[str, str, dict[str, Any], str | None]] = {
    "lora-llama": ("llama", "lora", {}, None),
    "lora-qwen2": ("qwen2", "lora", {}, None),
    "lora-gpt2": ("gpt2", "lora", {}, None),
    "lora-ours-ckpt": ("llama", "lora", {"activation_checkpointing": True}, None),
    "lora-model-ckpt": ("llama", "lora", {}, "reentrant"),
    "lora-nf4": ("llama", "lora", {"frozen_compression": "nf4"}, None),
    "lora-bf16": ("qwen2", "lora", {"frozen_compression": "bf16"}, None),
    # Frozen weights decoded at use, under our checkpointing and the model's own.
    "lora-nf4-at-use": ("llama", "lora", {"frozen_compression": "nf4", **AT_USE}, None),
    "lora-bf16-at-use": ("qwen2", "lora", {"frozen_compression": "bf16", **AT_USE}, "reentrant"),
    # Both decoder layers also save their products (LoRA's low-rank ones recomputed).
    "lora-nf4-selective": (
        "llama",
        "lora",
        {"frozen_compression": "nf4", **AT_USE, "selective_checkpointing_units": 2},
        None,
    ),
    "lora-plus": ("llama", "lora", {}, None),
    "frozen-embedding": ("llama", "embedding", {"keep_gathered_for_backward": False}, None),
    "last-two-layers": ("llama4", "last-two", {"keep_gathered_for_backward": False}, None),
    "trainable-llama4": ("llama4", "none", {"keep_gathered_for_backward": False}, None),
}


def _build(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(cfg)
    if arch == "llama4":
        return LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": 4}))
    from hf_models import build

    return build(arch)


def _targets(arch: str) -> list[str]:
    return ["c_attn", "c_proj"] if arch == "gpt2" else ["q_proj", "v_proj", "down_proj"]


def model_of(variant: str) -> nn.Module:
    """The variant's model, frozen as the variant says (the same values on every call)."""
    arch, how, _, ckpt = VARIANTS[variant]
    model = _build(arch)
    model.train()
    if ckpt is not None:
        enable_model_checkpointing(model, reentrant=ckpt == "reentrant")
        model.enable_input_require_grads()  # the frozen embedding's output needs a gradient
    if how == "lora":
        torch.manual_seed(1)
        lora = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=_targets(arch),
            init_lora_weights=False,  # B != 0: the adapters change the loss from step 0
        )  # fmt: skip
        return get_peft_model(model, lora)
    if how == "embedding":
        model.get_input_embeddings().requires_grad_(False)
    elif how == "last-two":
        model.requires_grad_(False)
        for layer in model.model.layers[-2:]:
            layer.requires_grad_(True)
    return model


def stored(variant: str, t: torch.Tensor) -> torch.Tensor:
    """A frozen value as the variant's ``frozen_compression`` stores and decodes it (fp32
    compute): what plain training on the dequantized base weights starts from."""
    method = VARIANTS[variant][2].get("frozen_compression", "none")
    if method == "nf4":
        return nf4_roundtrip(t.detach(), dtype=torch.float32)
    if method == "bf16":
        return t.detach().to(torch.bfloat16).float()
    return t.detach()


LORA_PLUS = 16.0  # LoRA+: the B matrices at 16 times the learning rate


def groups_of(variant: str, model: nn.Module) -> list[dict[str, Any]] | None:
    """The variant's parameter groups, by name (LoRA+: B matrices at ``LORA_PLUS`` x lr)."""
    if variant != "lora-plus":
        return None
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [n for n in names if "lora_B" in n], "lr_scale": LORA_PLUS},
        {"params": [n for n in names if "lora_B" not in n]},
    ]


def plain_optimizer(variant: str, model: nn.Module) -> torch.optim.Optimizer:
    """torch's AdamW with the variant's groups (group lr = LR x lr_scale)."""
    by_name = dict(model.named_parameters())
    groups = groups_of(variant, model)
    if groups is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    return torch.optim.AdamW(
        [
            {"params": [by_name[n] for n in g["params"]], "lr": LR * g.get("lr_scale", 1.0)}
            for g in groups
        ],
        lr=LR,
        weight_decay=0.0,
    )


def kind_of(variant: str) -> str:
    arch = VARIANTS[variant][0]
    return "llama" if arch == "llama4" else arch


@functools.cache
def plain(variant: str) -> dict[str, Any]:
    """Plain single-process training on whole batches (peft or transformers as is), from
    the frozen values as the variant stores them."""
    model = model_of(variant)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.copy_(stored(variant, p))
    losses = plain_loop(model, plain_optimizer(variant, model), kind_of(variant), MICRO_STEPS)
    return {"losses": losses, "state": params(model), "model": model}


def plain_loop(
    model: nn.Module, opt: torch.optim.Optimizer, kind: str, micro_steps: int
) -> list[float]:
    """Plain training on whole batches (accumulation ``ACC``, clipping ``CLIP``): the
    loss of every micro-step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for i in range(micro_steps):
        loss = loss_of(model(**call_kwargs(kind, batch(i, kind))))
        (loss / ACC).backward()
        losses.append(loss.item())
        if (i + 1) % ACC == 0:
            torch.nn.utils.clip_grad_norm_(trainable, CLIP)
            opt.step()
            opt.zero_grad()
    return losses


async def train_frozen(
    ctx: RankContext,
    variant: str,
    save: str | None = None,
    adapter: str | None = None,
    merged: str | None = None,
) -> dict[str, Any]:
    """Train ``variant`` with the manager on this rank's slice of every batch."""
    model = model_of(variant)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    initial = {n: stored(variant, p).clone() for n, p in model.named_parameters() if n in frozen}
    numels = {
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "frozen_numel": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "frozen_sizes": [p.numel() for p in model.parameters() if not p.requires_grad],
    }
    manager = Zero3CpuOffloadManager(
        make_config(VARIANTS[variant][2]),
        ctx.group,
        model,
        param_groups=groups_of(variant, model),
    )
    kind = kind_of(variant)
    losses, counts = [], []
    for i in range(MICRO_STEPS):
        out = await manager.forward(**call_kwargs(kind, local(batch(i, kind), ctx)))
        await manager.backward(loss_of(out))
        losses.append(await global_mean(ctx, loss_of(out)))
        if await manager.optimizer_step(LR):
            counts.append(_backward_collectives(manager))
        if save is not None and i + 1 == SAVE_AT:
            await manager.save_checkpoint(save)
    memory = manager.get_memory_stats()
    at_use = sorted(type(f).__name__ for f in map(_own_forward, model.modules()) if f is not None)
    state = await manager.full_state_dict()
    if adapter is not None:
        await manager.save_pretrained(adapter)
    if merged is not None:
        await manager.save_pretrained(merged, merged=True)
    await manager.close()
    return {
        "losses": losses,
        "state": state,
        "frozen": frozen,
        "frozen_unchanged": all(torch.equal(state[n], initial[n].float()) for n in frozen),
        "counts": counts[-1],
        "memory": (memory.frozen_param_bytes, memory.master_param_bytes),
        "state_bytes": memory.optimizer_state_bytes,
        "gradients": memory.gradient_bytes,
        "at_use": at_use,
        **numels,
    }


def _own_forward(module: nn.Module) -> FrozenLinearForward | FrozenEmbeddingForward | None:
    """``module``'s forward when it decodes its weight at use (under our checkpointing's
    wrapper, for a unit), else None."""
    forward = module.forward
    while isinstance(forward, functools.partial):
        forward = forward.args[0]
    return forward if isinstance(forward, FrozenLinearForward | FrozenEmbeddingForward) else None


def _backward_collectives(manager: Zero3CpuOffloadManager) -> dict[str, int]:
    """The last step's backward gathers and reduce-scatters (from the timeline)."""
    events = manager.get_performance_stats().timeline
    last = max(e.step for e in events)
    mine = [e for e in events if e.step == last and e.phase == "backward"]
    return {
        "gathers": sum(e.kind == "gather" for e in mine),
        "reduce_scatters": sum(e.kind == "reduce-scatter" for e in mine),
    }


async def load_frozen(ctx: RankContext, variant: str, path: str) -> dict[str, Any]:
    """A fresh manager of ``variant`` (other initial values) loading ``path``."""
    model = model_of(variant)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing of the initial values may survive the load
    manager = Zero3CpuOffloadManager(make_config(VARIANTS[variant][2]), ctx.group, model)
    await manager.load_checkpoint(path)
    state = await manager.full_state_dict()
    await manager.close()
    return {"state": state}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("frozen")


def _run(calls: dict[str, tuple[Any, ...]], world: int) -> dict[str, list[Any]]:
    return run_named(world, {k: (guarded, *call) for k, call in calls.items()})


PRETRAINED_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "o_proj"])
ADAPTER_SEED = 7


async def pretrained_lora(ctx: RankContext, directory: str) -> dict[str, Any]:
    """``from_pretrained`` with a LoRA config: train 6 micro-steps."""
    manager = Zero3CpuOffloadManager.from_pretrained(
        make_config({}),
        ctx.group,
        directory,
        peft_config=LoraConfig(**PRETRAINED_LORA),
        seed=ADAPTER_SEED,
    )
    losses = []
    for i in range(6):
        out = await manager.forward(**call_kwargs("llama", local(batch(i, "llama"), ctx)))
        await manager.backward(out.loss)
        losses.append(await global_mean(ctx, out.loss))
        await manager.optimizer_step(LR)
    state = await manager.full_state_dict()
    frozen_bytes = manager.get_memory_stats().frozen_param_bytes
    await manager.close()
    return {"losses": losses, "state": state, "frozen_bytes": frozen_bytes}


@pytest.fixture(scope="module")
def runs2(root: Path) -> dict[str, list[Any]]:
    _build("llama").save_pretrained(root / "base")
    calls: dict[str, tuple[Any, ...]] = {v: (train_frozen, v) for v in VARIANTS}
    calls["pretrained-lora"] = (pretrained_lora, str(root / "base"))
    calls["lora-llama"] = (
        train_frozen, "lora-llama", str(root / "ckpt"), str(root / "adapter"), str(root / "merged")
    )  # fmt: skip
    calls["lora-gpt2"] = (train_frozen, "lora-gpt2", None, None, str(root / "merged-gpt2"))
    return _run(calls, 2)


@pytest.fixture(scope="module")
def runs3(runs2: dict[str, list[Any]], root: Path) -> dict[str, list[Any]]:
    calls: dict[str, tuple[Any, ...]] = {v: (train_frozen, v) for v in LORAS}
    calls["load"] = (load_frozen, "lora-llama", str(root / "ckpt"))
    return _run(calls, 3)


@pytest.fixture(scope="module")
def runs1() -> dict[str, list[Any]]:
    return _run({v: (train_frozen, v) for v in LORAS}, 1)


def _results(runs: dict[str, list[Any]], name: str) -> list[dict[str, Any]]:
    return [unwrap(r) for r in runs[name]]


def _assert_trains_like_plain(results: list[dict[str, Any]], variant: str) -> None:
    ref = plain(variant)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True)) < 1e-5
        assert r["state"].keys() == ref["state"].keys()
        trainable = {n: t for n, t in r["state"].items() if n not in r["frozen"]}
        assert max_diff(trainable, {n: ref["state"][n] for n in trainable}) < 1e-4
        # The frozen base is bitwise what it was (and what plain training left).
        assert r["frozen_unchanged"]
        assert all(torch.equal(r["state"][n], ref["state"][n].float()) for n in r["frozen"])


# Every variant at 2 ranks; LoRA on each architecture at 3 and 1 ranks too.
WORLD_CASES = [(2, v) for v in VARIANTS] + [(w, v) for w in (3, 1) for v in LORAS]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "variant"), WORLD_CASES)
def test_frozen_and_lora_train_like_plain(
    request: pytest.FixtureRequest, world: int, variant: str
) -> None:
    runs = request.getfixturevalue(f"runs{world}")
    _assert_trains_like_plain(_results(runs, variant), variant)


@pytest.mark.slow
def test_frozen_parameters_hold_only_their_compute_copy(runs2: dict[str, list[Any]]) -> None:
    for r in _results(runs2, "lora-llama"):
        frozen_bytes, master_bytes = r["memory"]
        # fp32 compute, frozen_compression none: 4 bytes per frozen element / 2 ranks
        # (plus padding), and masters for the adapters only.
        assert r["frozen_numel"] * 2 <= frozen_bytes <= r["frozen_numel"] * 2 + 4 * 2 * 16
        assert r["trainable_numel"] * 2 <= master_bytes <= r["trainable_numel"] * 2 + 4 * 2 * 16
        # AdamW's two moments and step counts: for the adapters only.
        assert r["state_bytes"] < 3 * master_bytes


@pytest.mark.slow
def test_nf4_frozen_copies_hold_their_true_compressed_bytes(runs2: dict[str, list[Any]]) -> None:
    for r in _results(runs2, "lora-nf4"):
        # Each frozen parameter starts a 64-element block; the unit's frozen part is
        # padded to whole blocks per rank: half a byte per element and 4 per block.
        aligned = sum(-(-n // 64) * 64 for n in r["frozen_sizes"])
        frozen_bytes, _ = r["memory"]
        assert aligned // 2 * 9 // 16 <= frozen_bytes <= (aligned // 2 + 64 * 5) * 9 // 16
        # ... against 2 bytes per element for fp32 at 2 ranks.
        assert frozen_bytes < r["frozen_numel"] * 2 / 3.5
    for r in _results(runs2, "lora-bf16"):
        assert r["memory"][0] <= r["frozen_numel"] + 2 * 2 * 16 * 5


@pytest.mark.slow
def test_frozen_weights_decoded_at_use_replace_their_modules_forward(
    runs2: dict[str, list[Any]],
) -> None:
    # The tiny Llama and Qwen2 tie no weights: every frozen plain linear and the
    # embedding and head are decoded at use (4 of 7 projections per layer are frozen
    # plain ones, 3 are LoRA's base layers, plain too: 7 per layer, 2 layers, + head).
    for variant in ("lora-nf4-at-use", "lora-bf16-at-use"):
        for r in _results(runs2, variant):
            assert r["at_use"].count("FrozenEmbeddingForward") == 1
            assert r["at_use"].count("FrozenLinearForward") == 7 * 2 + 1
    assert not _results(runs2, "lora-nf4")[0]["at_use"]


@pytest.mark.slow
def test_no_collective_runs_for_what_no_gradient_needs(runs2: dict[str, list[Any]]) -> None:
    full = _results(runs2, "trainable-llama4")[0]["counts"]
    frozen = _results(runs2, "last-two-layers")[0]["counts"]
    embedding = _results(runs2, "frozen-embedding")[0]["counts"]
    # Per step (2 backward passes). The units: the embedding, 4 (or 2) decoder layers,
    # the LM head, and the final norm in the root; the head, the last unit of a forward,
    # stays gathered for the backward that starts there. All trainable: the layers and
    # the embedding are gathered again, and every unit reduces. Frozen but the last two
    # layers: no gradient goes through layers 0 and 1 (nor the embedding), so only
    # layers 2 and 3 are gathered again and reduce; the frozen head, norm and embedding
    # reduce nothing.
    assert full == {"gathers": 10, "reduce_scatters": 14}
    assert frozen == {"gathers": 4, "reduce_scatters": 4}
    # A frozen input embedding (2 layers): never gathered again for backward and never
    # reduced; the trainable layers, head and norm reduce.
    assert embedding == {"gathers": 4, "reduce_scatters": 8}


@pytest.mark.slow
def test_checkpoint_with_frozen_shards_loads_at_another_world_size(
    runs3: dict[str, list[Any]],
) -> None:
    loaded = _results(runs3, "load")
    saved = plain_at(SAVE_AT)
    for r in loaded:
        assert r["state"].keys() == saved.keys()
        assert max_diff(r["state"], saved) < 1e-4


@functools.cache
def plain_at(micro_steps: int) -> dict[str, torch.Tensor]:
    """The lora-llama plain run's parameters after ``micro_steps``."""
    return params(plain_model_at(micro_steps))


@functools.cache
def plain_model_at(micro_steps: int) -> nn.Module:
    """The lora-llama plain run's model after ``micro_steps``."""
    model = model_of("lora-llama")
    plain_loop(model, plain_optimizer("lora-llama", model), "llama", micro_steps)
    return model


@pytest.mark.slow
def test_adapter_directory_loads_with_peft_and_gives_equal_logits(
    runs2: dict[str, list[Any]], root: Path
) -> None:
    _results(runs2, "lora-llama")
    adapter = root / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    base = _build("llama")
    loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
    ref = plain("lora-llama")["model"].eval()
    x = batch(99, "llama")
    with torch.no_grad():
        got, want = loaded(input_ids=x).logits, ref(input_ids=x).logits
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["lora-llama", "lora-gpt2"])
def test_merged_save_loads_as_the_plain_merged_model(
    runs2: dict[str, list[Any]], root: Path, variant: str
) -> None:
    from transformers import AutoModelForCausalLM

    _results(runs2, variant)
    directory = root / ("merged" if variant == "lora-llama" else "merged-gpt2")
    loaded = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    merged = copy.deepcopy(plain(variant)["model"]).merge_and_unload().eval()
    kind = kind_of(variant)
    x = batch(98, kind)
    with torch.no_grad():
        got, want = loaded(input_ids=x).logits, merged(input_ids=x).logits
    assert (got - want).abs().max().item() < 1e-4
    assert not any("lora" in n for n, _ in loaded.named_parameters())


@pytest.mark.slow
def test_from_pretrained_with_lora_trains_like_plain_peft(
    runs2: dict[str, list[Any]], root: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from zero3_offload.integrations.peft_pretrained import reset_adapters

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(root / "base")), LoraConfig(**PRETRAINED_LORA)
    )
    reset_adapters(model, ADAPTER_SEED)
    model.train()
    losses = plain_loop(model, plain_optimizer("pretrained-lora", model), "llama", 6)
    for r in _results(runs2, "pretrained-lora"):
        assert max(abs(a - b) for a, b in zip(r["losses"], losses, strict=True)) < 1e-5
        assert max_diff(r["state"], params(model)) < 1e-4
        assert r["frozen_bytes"] > 0


@pytest.mark.slow
def test_export_of_a_peft_checkpoint_writes_the_adapter_or_the_merged_model(
    runs2: dict[str, list[Any]], root: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from zero3_offload.cli import main

    _results(runs2, "lora-llama")
    assert main(["export", str(root / "ckpt"), str(root / "exported-adapter")]) == 0
    assert main(["export", str(root / "ckpt"), str(root / "exported-merged"), "--merged"]) == 0
    ref = copy.deepcopy(plain_model_at(SAVE_AT)).eval()
    x = batch(97, "llama")
    adapter = PeftModel.from_pretrained(_build("llama"), str(root / "exported-adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(root / "exported-merged")).eval()
    with torch.no_grad():
        want = ref(input_ids=x).logits
        assert (adapter(input_ids=x).logits - want).abs().max().item() < 1e-4
        assert (merged(input_ids=x).logits - want).abs().max().item() < 1e-4


# ------------------------------------------------------------------------- chain mode


def chain_model() -> nn.Sequential:
    """A chain whose input embedding is frozen and whose middle layer mixes frozen and
    trainable parameters (weight frozen, bias trained)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(31, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 31))
    model[0].requires_grad_(False)
    model[1].weight.requires_grad_(False)
    return model


def chain_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + i)
    return torch.randint(0, 31, (6, 5), generator=g), torch.randint(0, 31, (6, 5), generator=g)


def chain_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, 31), y.reshape(-1))


async def train_chain(ctx: RankContext) -> dict[str, Any]:
    model = chain_model()
    manager = Zero3CpuOffloadManager(make_config({}), ctx.group, model)
    names = list(manager.layer_names)
    grads_in = []
    for i in range(8):
        x, y = (local(t, ctx) for t in chain_batch(i))
        out = (await manager.forward_pass(x, names)).requires_grad_()
        chain_loss(out, y).backward()
        grads_in.append(await manager.backward_pass(out.grad, names))
        await manager.optimizer_step(LR)
    state = await manager.full_state_dict()
    await manager.close()
    return {"state": state, "input_grads": grads_in}


def test_chain_with_frozen_layers_trains_like_plain() -> None:
    results = run_named(2, {"chain": (train_chain,)})["chain"]
    model = chain_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    for i in range(8):
        x, y = chain_batch(i)
        (chain_loss(model(x), y) / ACC).backward()
        if (i + 1) % ACC == 0:
            torch.nn.utils.clip_grad_norm_(trainable, CLIP)
            opt.step()
            opt.zero_grad()
    for r in results:
        assert max_diff(r["state"], params(model)) < 1e-5
        # The frozen embedding on token ids is skipped in backward: no input gradient.
        assert all(g is None for g in r["input_grads"])
        assert torch.equal(r["state"]["0.weight"], chain_model()[0].weight.detach())
