"""Tiled MLP (``mlp_chunk_tokens``, see [Note: tiled MLP]): module-mode training at 2
ranks equals plain single-process transformers training (Llama, Qwen2, with and without
activation checkpointing, LoRA on the MLP's projections), and the tiled MLP never holds
the whole sequence's intermediate activations."""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from helpers import LargestTensor, run_named
from hf_models import (
    ACC,
    LR,
    build,
    call_kwargs,
    global_mean,
    guarded,
    loss_of,
    make_config,
    max_diff,
    params,
    unwrap,
    vocab_size,
)
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from zero3_offload import Zero3CpuOffloadManager
from zero3_offload.errors import ConfigError
from zero3_offload.execution.product_saving import ProductSaving
from zero3_offload.execution.tiled_mlp import TiledMlp
from zero3_offload.testing import RankContext

CHUNK = 5  # 3 rows x 16 tokens per rank: 9 chunks of 5 and a ragged one of 3
MICRO_STEPS = 10  # 5 AdamW steps
ROWS, SEQ = 6, 16
LORA_TARGETS = ["gate_proj", "up_proj", "down_proj"]
CKPT = {"activation_checkpointing": True}
# name -> (kind, lora, extra config)
VARIANTS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "llama": ("llama", False, {}),
    "llama-ckpt": ("llama", False, CKPT),
    "qwen2": ("qwen2", False, {}),
    "qwen2-ckpt": ("qwen2", False, CKPT),
    "llama-lora": ("llama", True, {}),
    "llama-lora-ckpt": ("llama", True, CKPT),
}


def model_of(kind: str, lora: bool) -> nn.Module:
    """The tiny model (same values on every call); with ``lora``, LoRA on the MLP only."""
    model = build(kind)
    if not lora:
        return model
    import peft

    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
        init_lora_weights=False,  # B != 0: the adapters change the loss from step 0
    )  # fmt: skip
    return peft.get_peft_model(model, config)


def batch(index: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + index)
    return torch.randint(0, vocab_size(kind), (ROWS, SEQ), generator=g)


@functools.cache
def plain(kind: str, lora: bool) -> dict[str, Any]:
    """Plain single-process training (untiled) on whole batches: AdamW, accumulation 2."""
    model = model_of(kind, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    losses = []
    for i in range(MICRO_STEPS):
        loss = loss_of(model(**call_kwargs(kind, batch(i, kind))))
        (loss / ACC).backward()
        losses.append(loss.item())
        if (i + 1) % ACC == 0:
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "state": params(model)}


async def train_tiled(ctx: RankContext, name: str) -> dict[str, Any]:
    """Train variant ``name`` with the manager in module mode on this rank's rows."""
    kind, lora, extra = VARIANTS[name]
    model = model_of(kind, lora)
    config = make_config({"gradient_clipping": 0.0, "mlp_chunk_tokens": CHUNK, **extra})
    manager = Zero3CpuOffloadManager(config, ctx.group, model)
    losses, tiled_nodes = [], []
    per = ROWS // ctx.world_size
    for i in range(MICRO_STEPS):
        x = batch(i, kind)[ctx.rank * per : (ctx.rank + 1) * per]
        loss = loss_of(await manager.forward(**call_kwargs(kind, x)))
        tiled_nodes.append(_tiled_nodes(loss))
        await manager.backward(loss)
        losses.append(await global_mean(ctx, loss))
        await manager.optimizer_step(LR)
    state = await manager.full_state_dict()
    await manager.close()
    return {"losses": losses, "state": state, "tiled_nodes": tiled_nodes}


def _tiled_nodes(loss: torch.Tensor) -> int:
    """The tiled MLP nodes in ``loss``'s autograd graph."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(nxt for nxt, _ in fn.next_functions)
    return sum(type(fn).__name__ == "_TiledFunctionBackward" for fn in seen)


@pytest.fixture(scope="module")
def runs2() -> dict[str, list[Any]]:
    return run_named(2, {name: (guarded, train_tiled, name) for name in VARIANTS})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiled_mlp_trains_like_plain_transformers(runs2: dict[str, list[Any]], name: str) -> None:
    kind, lora, _ = VARIANTS[name]
    ref = plain(kind, lora)
    results = [unwrap(r) for r in runs2[name]]
    err = max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"], strict=True))
    assert err < 1e-5, (err, results[0]["losses"], ref["losses"])
    for r in results:
        assert max_diff(r["state"], ref["state"]) < 1e-4
        assert r["tiled_nodes"] == [2] * MICRO_STEPS  # each decoder layer's MLP was tiled
    # The trainable parameters moved (LoRA: only the adapters), so the check is not trivial.
    start = params(model_of(kind, lora))
    moved = [n for n in start if not torch.equal(start[n], ref["state"][n])]
    assert moved
    assert all("lora_" in n for n in moved) or not lora
    assert max_diff(ref["state"], start) > LR


# ------------------------------------------------------------- single process


def _largest_intermediate(chunk: int, tokens: int) -> tuple[int, int, torch.Tensor]:
    """Forward and backward of one decoder layer over ``tokens`` tokens, tiled by ``chunk``
    (0: untiled): the largest intermediate-width tensor, the width, the input's gradient."""
    config = LlamaConfig(hidden_size=16, intermediate_size=48, num_attention_heads=2)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    if chunk:
        TiledMlp(chunk, {"layer": layer})
    x = torch.randn(1, tokens, 16, requires_grad=True)
    weights = {s for p in layer.parameters() for s in (tuple(p.shape), tuple(p.shape[::-1]))}
    width = config.intermediate_size  # of the intermediates, not shaped as a weight
    mode = LargestTensor(
        lambda t: tuple(t.shape) not in weights and t.dim() > 0 and t.shape[-1] == width
    )
    with mode:
        y = layer.mlp(x)
        y.square().sum().backward()
    assert x.grad is not None
    return mode.largest, config.intermediate_size, x.grad


def test_tiled_mlp_never_holds_the_whole_sequences_intermediate() -> None:
    tokens, chunk = 64, 7
    tiled, width, grad_tiled = _largest_intermediate(chunk, tokens)
    untiled, _, grad_plain = _largest_intermediate(0, tokens)
    assert untiled == tokens * width  # the rule can fail: untiled, the whole sequence's
    assert tiled == chunk * width  # tiled: one chunk's at a time, in forward and backward
    torch.testing.assert_close(grad_tiled, grad_plain)


def test_a_model_without_mlp_submodules_is_refused() -> None:
    with pytest.raises(ConfigError, match="no unit with an `mlp` submodule"):
        TiledMlp(4, {"block": nn.Sequential(nn.Linear(2, 2))})


def _layer_grads(*, tiled: bool, selective: bool) -> list[torch.Tensor]:
    """The input's and parameters' gradients of one checkpointed decoder layer, its MLP
    tiled by 5 tokens or not, its products saved (selective checkpointing) or not."""
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    if tiled:
        TiledMlp(5, {"layer": layer})
    x = torch.randn(2, 16, 32, requires_grad=True)
    rope = LlamaRotaryEmbedding(config)(x, torch.arange(16)[None])
    context = torch.utils.checkpoint.noop_context_fn
    if selective:
        context = functools.partial(ProductSaving(1).contexts, lambda t: None)
    y = torch.utils.checkpoint.checkpoint(
        layer, x, position_embeddings=rope, use_reentrant=False, context_fn=context
    )
    loss = y.square().sum()
    assert _tiled_nodes(loss) == int(tiled)
    loss.backward()
    assert x.grad is not None
    return [x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("selective", [False, True])
def test_tiled_mlp_composes_with_checkpointing_and_saved_products(selective: bool) -> None:
    plain_grads = _layer_grads(tiled=False, selective=False)
    for a, b in zip(_layer_grads(tiled=True, selective=selective), plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
