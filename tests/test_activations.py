"""Kept activations vs recomputation (``activation_checkpointing``): same numbers, and
the kept graphs never hold on to released parameter storage."""

from __future__ import annotations

import gc

import pytest
import torch
from models import SEQ, lm_loss, make_batches, make_model, make_torch_optimizer
from rank_bodies import TrainSpec, eval_probe, memory_probe, train
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from zero3_offload.errors import StateError
from zero3_offload.execution.layer_runner import LayerRunner
from zero3_offload.testing import run_ranks

MODES = {"kept": False, "recompute": True}


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
        torch.device("cpu"), torch.float32, recompute=False, gathered_flat=gathered.__getitem__
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
    assert flat.untyped_storage().data_ptr() not in saved.kept
    assert saved.kept  # ...while the activations are kept.

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
    assert saved.kept


def test_kept_graph_needs_the_layer_gathered() -> None:
    layer, gathered, executor = _gathered_layer()
    _, saved = executor.forward("l", layer, torch.randn(4, 8))
    del gathered["l"]
    with pytest.raises(StateError, match=r"'l'.*not gathered"):
        executor.backward("l", layer, saved, torch.randn(4, 5))


def _seeded_reference(spec: TrainSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch with the same per-step seeds as ``TrainSpec.seed``."""
    model = make_model(**spec.model)
    opt = make_torch_optimizer("adamw", model.parameters())
    losses = []
    for step, (x, y) in enumerate(make_batches(spec.steps, spec.batch)):
        assert spec.seed is not None
        torch.manual_seed(spec.seed + step)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", list(MODES))
async def test_dropout_matches_torch_on_one_rank(mode: str) -> None:
    """Dropout draws the same masks as plain torch (kept: the forward's; recompute:
    replayed from the saved RNG state, without disturbing the global stream)."""
    spec = TrainSpec(
        steps=4,
        seed=100,
        model={"dropout": 0.2},
        config={"activation_checkpointing": MODES[mode]},
    )
    ref_losses, ref_state = _seeded_reference(spec)
    (result,) = await run_ranks(train, 1, spec)
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses, strict=True)) < 1e-6
    err = max((result["state"][n] - ref_state[n]).abs().max().item() for n in ref_state)
    assert err < 1e-5
    # Dropout really changed the numbers: without it the run differs.
    plain, _ = _seeded_reference(TrainSpec(steps=4, seed=100))
    assert abs(plain[0] - ref_losses[0]) > 1e-3


async def test_modes_agree_on_two_ranks_with_dropout() -> None:
    """With dropout, recompute reproduces the kept forward bitwise (same masks, same math)."""
    common = {"steps": 4, "seed": 7, "model": {"dropout": 0.1, "n_blocks": 3}}
    results = {
        mode: await run_ranks(
            train, 2, TrainSpec(config={"activation_checkpointing": flag}, **common)
        )
        for mode, flag in MODES.items()
    }
    kept, recompute = results["kept"], results["recompute"]
    for a, b in zip(kept, recompute, strict=True):
        assert a["losses"] == b["losses"]
    for name, value in kept[0]["state"].items():
        assert torch.equal(value, recompute[0]["state"][name]), name


async def test_activation_bytes_are_counted() -> None:
    """Kept mode keeps far more than layer inputs; recompute keeps exactly the inputs."""
    spec = {"batch": 8, "model": {"n_blocks": 2}}
    probes = {
        mode: (
            await run_ranks(
                memory_probe, 2, TrainSpec(config={"activation_checkpointing": flag}, **spec)
            )
        )[0]
        for mode, flag in MODES.items()
    }
    d, layers, local_batch = 24, 5, 4  # TinyGPT defaults: embed, 2 blocks, ln_f, head
    # The token ids are a view of the whole batch's [8, SEQ + 1] int64 storage, which is
    # what keeping them holds; each later layer's input is a [4, SEQ, d] fp32 tensor.
    inputs = 8 * (SEQ + 1) * 8 + (layers - 1) * local_batch * SEQ * d * 4
    assert probes["recompute"]["after_forward"]["activation_bytes"] == inputs
    assert probes["kept"]["after_forward"]["activation_bytes"] > 3 * inputs
    for probe in probes.values():
        assert probe["after_backward"]["activation_bytes"] == 0
        # Activations count towards the memory of their device (CPU here).
        after = probe["after_forward"]
        assert after["cpu_memory_used"] >= after["activation_bytes"]


async def test_forward_under_no_grad_keeps_nothing() -> None:
    """Evaluation forward: same output, nothing kept, no backward; training goes on exactly."""
    spec = TrainSpec(steps=2)
    results = await run_ranks(eval_probe, 2, spec)
    trained = await run_ranks(train, 2, spec)
    for r, t in zip(results, trained, strict=True):
        assert torch.equal(r["evaluated"], r["trained_out"])
        assert r["kept_by_eval"] == 0
        assert "torch.no_grad()" in r["error"]
        assert r["losses"] == t["losses"]
    for name, value in results[0]["state"].items():
        assert torch.equal(value, trained[0]["state"][name]), name
