"""ZeRO-3 training on N real ranks == plain single-process PyTorch on the whole batch."""

from __future__ import annotations

import pytest
from models import make_batches, make_model, make_torch_optimizer, train_reference
from rank_bodies import TrainSpec, train

from zero3_offload.testing import run_ranks


def reference(spec: TrainSpec, kind: str, **kw: float) -> tuple[list[float], dict]:
    model = make_model(**spec.model)
    opt = make_torch_optimizer(kind, model.parameters(), **kw)
    losses = train_reference(model, make_batches(spec.steps, spec.batch), opt)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def compare(results: list[dict], ref_losses: list[float], ref_state: dict) -> tuple[float, float]:
    world = len(results)
    # Each rank's loss is its micro-batch mean; equal splits make their mean the global loss.
    losses = [sum(r["losses"][i] for r in results) / world for i in range(len(ref_losses))]
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    state = results[0]["state"]
    assert state.keys() == ref_state.keys()
    for name, value in state.items():
        assert value.shape == ref_state[name].shape, name
    param_err = max((state[n] - ref_state[n]).abs().max().item() for n in ref_state)
    return loss_err, param_err


@pytest.mark.parametrize("world", [1, 2, 4])
async def test_adamw_matches_torch(world: int) -> None:
    spec = TrainSpec(optimizer={"kind": "adamw", "weight_decay": 0.01}, model={"n_blocks": 3})
    ref_losses, ref_state = reference(spec, "adamw", weight_decay=0.01)
    results = await run_ranks(train, world, spec)
    loss_err, param_err = compare(results, ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4
    # The parameters really moved, so the comparison is not trivially met.
    start = {n: p.detach() for n, p in make_model(**spec.model).named_parameters()}
    assert max((ref_state[n] - start[n]).abs().max().item() for n in start) > 5e-3


@pytest.mark.parametrize("world", [2, 4])
async def test_layers_are_unequal_and_not_divisible(world: int) -> None:
    spec = TrainSpec(steps=1)
    (result, *_) = await run_ranks(train, world, spec)
    numels = [numel for numel, _, _ in result["layouts"].values()]
    assert len(set(numels)) == len(numels), "every layer has its own size"
    assert any(n % world for n in numels), "some layer needs padding"
    for numel, padded, shard in result["layouts"].values():
        assert padded % world == 0 and padded - numel < world and shard * world == padded


@pytest.mark.parametrize(
    ("world", "nesterov"), [(2, False), (4, True)], ids=["momentum-2", "nesterov-4"]
)
async def test_sgd_momentum_matches_torch(world: int, nesterov: bool) -> None:
    opt = {"kind": "sgd", "momentum": 0.9, "nesterov": nesterov, "weight_decay": 0.001}
    spec = TrainSpec(lr=1e-2, optimizer=opt)
    ref_losses, ref_state = reference(
        spec, "sgd", momentum=0.9, nesterov=nesterov, weight_decay=0.001
    )
    results = await run_ranks(train, world, spec)
    loss_err, param_err = compare(results, ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-6


async def test_adam_matches_torch() -> None:
    spec = TrainSpec(steps=6, optimizer={"kind": "adam", "weight_decay": 0.01})
    ref_losses, ref_state = reference(spec, "adam", weight_decay=0.01)
    loss_err, param_err = compare(await run_ranks(train, 2, spec), ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4
