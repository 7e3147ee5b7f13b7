"""Kept activations vs recomputation (``activation_checkpointing``): same numbers, and
the kept graphs never hold on to released parameter storage."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import (
    SEQ,
    VOCAB,
    TrainSpec,
    assert_bitwise,
    eval_probe,
    max_abs_diff,
    memory_probe,
    reference,
    run_named,
    train,
)
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from zero3_offload.errors import StateError
from zero3_offload.execution.layer_runner import LayerRunner

# mode -> its config; "selective": the last 4 layers (2 blocks, ln_f, the head) also save
# their products (see [Note: saved products])
MODES = {
    "kept": {"activation_checkpointing": False},
    "recompute": {"activation_checkpointing": True},
    "selective": {"activation_checkpointing": True, "selective_checkpointing_units": 4},
}


def _layer() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5, bias=False))


def _bind(module: nn.Module, flat: torch.Tensor) -> None:
    """Make ``module``'s parameters views of ``flat`` (as the parameter cache does)."""
    offset = 0
    for p in module.parameters():
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def _gathered_layer() -> tuple[nn.Module, dict[str, torch.Tensor], LayerRunner]:
    """A layer bound to a flat buffer registered as gathered, and a kept-graph executor."""
    layer = _layer()
    flat = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])
    _bind(layer, flat)
    gathered = {"l": flat}
    executor = LayerRunner(
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        recompute=False,
        gathered_flat=gathered.__getitem__,
    )
    return layer, gathered, executor


def test_kept_graph_rebuilds_parameters_from_the_new_gather() -> None:
    """Backward must read the parameters of the *new* gather, not the released buffer."""
    reference = _layer()
    x = torch.randn(4, 8)
    grad = torch.randn(4, 5)
    ref_x = x.clone().requires_grad_()
    torch.autograd.backward(reference(ref_x), grad)

    layer, gathered, executor = _gathered_layer()
    flat = gathered["l"]
    out, saved = executor.forward("l", layer, x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert not out.requires_grad
    # Nothing autograd saved refers to the gathered buffer's storage...
    assert flat.untyped_storage().data_ptr() not in saved.saved
    assert saved.saved  # ...while the activations are saved.

    # Release: the old buffer is overwritten; a new gather brings the same values.
    regathered = flat.clone()
    flat.zero_()
    _bind(layer, regathered)
    gathered["l"] = regathered
    grad_in = executor.backward("l", layer, saved, grad)
    torch.testing.assert_close(grad_in, ref_x.grad)
    for p, q in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_kept_graph_does_not_keep_the_released_buffer_alive() -> None:
    layer, gathered, executor = _gathered_layer()
    flat = gathered["l"]
    released = StorageWeakRef(flat.untyped_storage())
    _, saved = executor.forward("l", layer, torch.randn(4, 8))
    # Release as the cache does: parameters point elsewhere, the buffer is dropped.
    for p in layer.parameters():
        p.data = torch.empty(0)
    del gathered["l"], flat
    gc.collect()
    assert released.expired(), "the kept graph still holds the released parameter buffer"
    assert saved.saved


def test_kept_graph_needs_the_layer_gathered() -> None:
    layer, gathered, executor = _gathered_layer()
    _, saved = executor.forward("l", layer, torch.randn(4, 8))
    del gathered["l"]
    with pytest.raises(StateError, match=r"'l'.*not gathered"):
        executor.backward("l", layer, saved, torch.randn(4, 5))


@pytest.fixture(scope="module")
def one_rank_dropout() -> dict[str, dict]:
    """4 steps with dropout on one rank, each mode; one rank run."""
    runs = run_named(1, {mode: (train, dropout_spec(mode)) for mode in MODES})
    return {mode: result for mode, (result,) in runs.items()}


def dropout_spec(mode: str) -> TrainSpec:
    return TrainSpec(steps=4, seed=100, model={"dropout": 0.2}, config=MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_dropout_matches_torch_on_one_rank(one_rank_dropout: dict[str, dict], mode: str) -> None:
    """Dropout draws the same masks as plain torch (kept: the forward's; recompute:
    replayed from the saved RNG state, without disturbing the global stream)."""
    ref_losses, ref_state = reference(dropout_spec(mode), "adamw")
    result = one_rank_dropout[mode]
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses, strict=True)) < 1e-6
    assert max_abs_diff(result["state"], ref_state) < 1e-5
    # Dropout really changed the numbers: without it the run differs.
    plain, _ = reference(TrainSpec(steps=4, seed=100), "adamw")
    assert abs(plain[0] - ref_losses[0]) > 1e-3


MODES_AGREE = {"steps": 4, "seed": 7, "model": {"dropout": 0.1, "n_blocks": 3}}
PROBE = {"batch": 8, "model": {"n_blocks": 2}}
EVAL = TrainSpec(steps=2)


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict]]:
    """The 2-rank runs of this file, in one rank run: training with dropout and a memory
    probe in each mode, an evaluation probe and the training it interrupts."""
    calls = {}
    for mode, config in MODES.items():
        calls[f"train-{mode}"] = (train, TrainSpec(config=config, **MODES_AGREE))
        calls[f"probe-{mode}"] = (memory_probe, TrainSpec(config=config, **PROBE))
    calls["eval"] = (eval_probe, EVAL)
    calls["eval-trained"] = (train, EVAL)
    return run_named(2, calls)


def test_modes_agree_on_two_ranks_with_dropout(two_ranks: dict[str, list[dict]]) -> None:
    """With dropout, recompute reproduces the kept forward bitwise (same masks, same math)."""
    kept = two_ranks["train-kept"]
    for mode in ("recompute", "selective"):
        for a, b in zip(kept, two_ranks[f"train-{mode}"], strict=True):
            assert a["losses"] == b["losses"]
        assert_bitwise(kept[0]["state"], two_ranks[f"train-{mode}"][0]["state"])


def test_activation_bytes_are_counted(two_ranks: dict[str, list[dict]]) -> None:
    """Kept mode keeps far more than layer inputs; recompute keeps exactly the inputs."""
    probes = {mode: two_ranks[f"probe-{mode}"][0] for mode in MODES}
    d, layers, local_batch = 24, 5, 4  # TinyGPT defaults: embed, 2 blocks, ln_f, head
    # The token ids are a view of the whole batch's [8, SEQ + 1] int64 storage, which is
    # what keeping them holds; each later layer's input is a [4, SEQ, d] fp32 tensor.
    inputs = 8 * (SEQ + 1) * 8 + (layers - 1) * local_batch * SEQ * d * 4
    assert probes["recompute"]["after_forward"]["activation_bytes"] == inputs
    assert probes["kept"]["after_forward"]["activation_bytes"] > 3 * inputs
    # Selective: the inputs and the products' outputs, fewer than all the activations.
    # Of the products, at least the blocks' qkv (3d columns) and fc2 (d) and the head's
    # (VOCAB) outputs are saved.
    selective = probes["selective"]["after_forward"]["activation_bytes"]
    tokens = local_batch * SEQ
    assert selective >= inputs + tokens * (2 * (3 * d + d) + VOCAB) * 4
    assert selective < probes["kept"]["after_forward"]["activation_bytes"]
    for probe in probes.values():
        assert probe["after_backward"]["activation_bytes"] == 0
        # Activations count towards the memory of their device (CPU here).
        after = probe["after_forward"]
        assert after["cpu_memory_used"] >= after["activation_bytes"]


def test_forward_under_no_grad_keeps_nothing(two_ranks: dict[str, list[dict]]) -> None:
    """Evaluation forward: same output, nothing kept, no backward; training goes on exactly."""
    results, trained = two_ranks["eval"], two_ranks["eval-trained"]
    for r, t in zip(results, trained, strict=True):
        assert torch.equal(r["evaluated"], r["trained_out"])
        assert r["kept_by_eval"] == 0
        assert "torch.no_grad()" in r["error"]
        assert r["losses"] == t["losses"]
    assert_bitwise(results[0]["state"], trained[0]["state"])
