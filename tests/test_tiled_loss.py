"""The tiled causal-LM loss (no full logits), module mode's loss from ``labels=``,
``manager.gathered()`` and the error for a read of a sharded parameter.

The rank runs (2 ranks, one shared run: a module fixture) train each variant 5 AdamW
steps and are compared with plain single-process transformers training of the same model
and data (``tiled_ranks``); the single-process tests check the loss function itself and
that it never makes a full logits tensor.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
import torch.nn.functional as F
from helpers import LargestTensor, run_named
from hf_models import TINY_DECODER, guarded, unwrap
from tiled_ranks import CHUNK, ROWS, SEQ, Spec, plain_train, train
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.loss.loss_utils import ForCausalLMLoss

from zero3_offload import InputError, tiled_causal_lm_loss
from zero3_offload.execution.head_loss import HeadLoss

EXACT = ("llama", "qwen3_tied", "gemma2", "lora_head", "masked", "frozen_head")
GATHERED = ("fused", "fused_library", "fused_recompute")


@pytest.fixture(scope="module")
def runs2() -> dict[str, list[Any]]:
    specs = {kind: Spec(kind) for kind in (*EXACT, *GATHERED, "fused_ungathered", "mixtral")}
    specs["own_logits"] = Spec("llama", return_logits=True)
    # The LoRA head is not an nn.Linear: its forward is checkpointed too (and recomputed
    # inside the tiled loss's backward).
    specs["lora_head_recompute"] = Spec("lora_head", config={"activation_checkpointing": True})
    return run_named(2, {name: (guarded, train, spec) for name, spec in specs.items()})


@functools.cache
def plain(kind: str) -> dict[str, Any]:
    return plain_train(kind)


def assert_trains_like_plain(results: list[dict[str, Any]], kind: str) -> None:
    """Every step's loss within 1e-5 and every rank's final parameters within 1e-4 of
    plain transformers training; the parameters really moved."""
    ref = plain(kind)
    results = [unwrap(r) for r in results]
    assert "error" not in results[0], results[0]["error"]
    losses = results[0]["losses"]
    assert len(losses) == len(ref["losses"])
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)) < 1e-5
    for r in results:
        assert r["state"].keys() == ref["state"].keys()
        err = max((r["state"][n] - ref["state"][n]).abs().max().item() for n in ref["state"])
        assert err < 1e-4, err
    moved = max((ref["state"][n] - ref["start"][n]).abs().max().item() for n in ref["state"])
    assert moved > 1e-3


@pytest.mark.parametrize("kind", EXACT)
def test_tiled_loss_trains_like_the_models_own_loss(runs2: dict[str, list[Any]], kind: str) -> None:
    assert_trains_like_plain(runs2[kind], kind)
    for r in runs2[kind]:
        assert r["logits"] == [None] * len(r["losses"])  # no logits were kept
        assert r["fallbacks"] == []


def test_tiled_loss_with_activation_checkpointing_trains_exactly(
    runs2: dict[str, list[Any]],
) -> None:
    assert_trains_like_plain(runs2["lora_head_recompute"], "lora_head")
    assert runs2["lora_head_recompute"][0]["logits"][0] is None


def test_return_logits_gives_the_models_own_logits_and_loss(
    runs2: dict[str, list[Any]],
) -> None:
    assert_trains_like_plain(runs2["own_logits"], "llama")
    vocab = TINY_DECODER["vocab_size"]
    assert runs2["own_logits"][0]["logits"][0] == (ROWS // 2, SEQ, vocab)
    assert runs2["own_logits"][0]["fallbacks"] == []


def test_the_tiled_loss_keeps_no_logits_for_the_backward(runs2: dict[str, list[Any]]) -> None:
    # The model's own loss keeps its logits' log-softmax (fp32, logits-sized) for the
    # backward; the tiled loss keeps the hidden states and the targets, already kept.
    logits_bytes = ROWS // 2 * SEQ * TINY_DECODER["vocab_size"] * 4
    for tiled, own in zip(runs2["llama"], runs2["own_logits"], strict=True):
        assert own["saved_bytes"] - tiled["saved_bytes"] >= logits_bytes


@pytest.mark.parametrize("kind", GATHERED)
def test_code_reading_the_head_weight_trains_exactly_inside_gathered(
    runs2: dict[str, list[Any]], kind: str
) -> None:
    # A chunked F.linear over lm_head.weight (the head is a unit of its own), or
    # tiled_causal_lm_loss of the weight; "fused_recompute" runs the block under
    # non-reentrant checkpointing, so it runs again in the backward.
    assert_trains_like_plain(runs2[kind], kind)


def test_reading_a_sharded_head_without_gathered_names_it_and_the_fix(
    runs2: dict[str, list[Any]],
) -> None:
    for r in runs2["fused_ungathered"]:
        kind, message = unwrap(r)["error"]
        assert kind == "StateError"
        assert "lm_head.weight" in message
        assert "without its module being called" in message
        assert "manager.gathered(model.lm_head)" in message


def test_a_head_it_cannot_reproduce_falls_back_with_one_log_line(
    runs2: dict[str, list[Any]],
) -> None:
    # Mixtral may add its router's auxiliary loss after ForCausalLMLoss: its own loss.
    assert_trains_like_plain(runs2["mixtral"], "mixtral")
    for r in runs2["mixtral"]:
        assert len(r["fallbacks"]) == 1  # 5 steps, one line
        assert "MixtralForCausalLM" in r["fallbacks"][0]["reason"]
        assert r["logits"][0] == (ROWS // 2, SEQ, TINY_DECODER["vocab_size"])


# ------------------------------------------------------------------------- single process


def _data(vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 13, 8, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 13), generator=g)
    labels[0, 2:9] = -100
    return hidden, weight, labels


def _grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("num_items", [None, 29])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("shifted", [False, True])
def test_tiled_loss_equals_for_causal_lm_loss(
    num_items: int | None, softcap: bool, shifted: bool
) -> None:
    hidden, weight, labels = _data()
    transform = (lambda x: torch.tanh(x / 1.5) * 1.5) if softcap else None
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    given = {"shift_labels": targets} if shifted else {"labels": labels}
    tiled = tiled_causal_lm_loss(
        hidden,
        weight,
        chunk_tokens=4,
        num_items_in_batch=num_items,
        logit_transform=transform,
        **given,
    )
    logits = F.linear(hidden, weight)
    logits = transform(logits) if transform else logits
    own = ForCausalLMLoss(
        logits,
        given.get("labels"),
        vocab_size=50,
        num_items_in_batch=num_items,
        shift_labels=given.get("shift_labels"),
    )
    assert abs(tiled.item() - own.item()) < 1e-6
    for a, b in zip(_grads(tiled, hidden, weight), _grads(own, hidden, weight), strict=True):
        assert (a - b).abs().max().item() < 1e-6


def test_tiled_loss_summed() -> None:
    hidden, weight, labels = _data()
    tiled = tiled_causal_lm_loss(hidden, weight, labels, chunk_tokens=4, reduction="sum")
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    own = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 50), targets, reduction="sum")
    assert abs(tiled.item() - own.item()) < 1e-4
    for a, b in zip(_grads(tiled, hidden, weight), _grads(own, hidden, weight), strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_tiled_loss_of_a_module_head_gives_each_parameter_one_gradient() -> None:
    hidden, _, labels = _data()
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    tiled_causal_lm_loss(hidden, head, labels, chunk_tokens=5).backward()
    tiled = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    ForCausalLMLoss(head(hidden), labels, vocab_size=50).backward()
    for a, p in zip(tiled, head.parameters(), strict=True):
        assert (a - p.grad).abs().max().item() < 1e-6


def test_a_random_module_head_sees_the_same_random_numbers_in_the_recomputation() -> None:
    # A dropout in the head (a LoRA dropout): the backward's recomputation of each chunk
    # must draw the forward's masks, as plain autograd over the same chunks does.
    hidden, _, labels = _data()
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 50))
    torch.manual_seed(7)
    tiled = tiled_causal_lm_loss(hidden, head, labels, chunk_tokens=5)
    after = torch.rand(())  # the generator moved on as in the forward, not rewound
    tiled_grads = _grads(tiled, hidden, *head.parameters())
    torch.manual_seed(7)
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    flat = hidden.reshape(-1, 8)
    total = sum(
        F.cross_entropy(head(flat[i : i + 5]), targets[i : i + 5], reduction="sum")
        for i in range(0, flat.shape[0], 5)
    )
    plain = total / (targets != -100).sum()
    assert torch.rand(()) == after
    assert abs(tiled.item() - plain.item()) < 1e-6
    for a, b in zip(tiled_grads, _grads(plain, hidden, *head.parameters()), strict=True):
        assert (a - b).abs().max().item() < 1e-6


def test_tiled_loss_refuses_mismatched_labels() -> None:
    hidden, weight, labels = _data()
    with pytest.raises(InputError, match="do not match hidden states"):
        tiled_causal_lm_loss(hidden, weight, labels[:, :5])
    with pytest.raises(InputError, match="either labels"):
        tiled_causal_lm_loss(hidden, weight)
    with pytest.raises(InputError, match="chunk_tokens"):
        tiled_causal_lm_loss(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(InputError, match="reduction"):
        tiled_causal_lm_loss(hidden, weight, labels, reduction="none")


def test_the_tiled_loss_never_makes_a_full_logits_tensor() -> None:
    tokens, vocab, d = 96, 400, 8  # full logits: 38,400 elements; the weight: 3,200
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, d, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    with LargestTensor() as tiled:
        tiled_causal_lm_loss(hidden, weight, labels, chunk_tokens=16).backward()
    with LargestTensor() as own:  # the control: the model's own loss makes them
        ForCausalLMLoss(F.linear(hidden, weight), labels, vocab_size=vocab).backward()
    assert own.largest >= tokens * vocab
    assert tiled.largest <= 16 * vocab


def _cohere() -> torch.nn.Module:
    return CohereForCausalLM(CohereConfig(**TINY_DECODER, logit_scale=0.3))


def _granite() -> torch.nn.Module:
    return GraniteForCausalLM(GraniteConfig(**TINY_DECODER, logits_scaling=4.0))


def _gemma3() -> torch.nn.Module:
    cfg = Gemma3TextConfig(**TINY_DECODER, head_dim=8, final_logit_softcapping=2.0)
    return Gemma3ForCausalLM(cfg)


def _llama() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER))


@pytest.mark.parametrize("build", [_cohere, _granite, _gemma3, _llama])
def test_the_head_loss_reproduces_each_familys_logit_transform(build: Any) -> None:
    # Cohere's logit_scale, Granite's logits_scaling, Gemma 3's soft-capping: the tiled
    # call (the model's forward with its head's forward replaced) against the model's own.
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, TINY_DECODER["vocab_size"], (2, 11))
    own = model(input_ids=ids, labels=ids)
    head_loss = HeadLoss(model=model, chunk_tokens=CHUNK)
    assert head_loss.reason is None
    method, kwargs = head_loss.prepare(
        model, {"input_ids": ids, "labels": ids}, lambda _: contextlib.nullcontext()
    )
    tiled = method(**kwargs)
    assert tiled.logits is None
    assert "forward" not in model.lm_head.__dict__  # the head's own forward is back
    assert abs(tiled.loss.item() - own.loss.item()) < 1e-6
    params = [p for p in model.parameters() if p.requires_grad]
    for a, b in zip(_grads(tiled.loss, *params), _grads(own.loss, *params), strict=True):
        assert (a - b).abs().max().item() < 1e-6


@pytest.mark.parametrize("upstream", [1.0, 0.25, 3.0])
def test_a_frozen_heads_gradient_taken_in_the_forward_is_bitwise_the_recomputed_one(
    upstream: float,
) -> None:
    # A frozen head: the hidden states' gradient is taken in the forward (for an upstream
    # gradient of 1, scaled exactly by a power of two, recomputed otherwise); a trained
    # head's loss recomputes its chunks in the backward. Same values either way.
    hidden, weight, labels = _data()
    grads = []
    for trained in (False, True):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_(trained)
        loss = tiled_causal_lm_loss(h, w, labels, chunk_tokens=4)
        (loss * upstream).backward()
        grads.append(h.grad)
    assert torch.equal(grads[0], grads[1])
