"""ZeRO-3 training on N real ranks == plain single-process PyTorch on the whole batch."""

from __future__ import annotations

import pytest
from helpers import TrainSpec, compare, make_model, parameters, reference, run_named, train

from zero3_offload.testing import run_ranks


# World 1: no peer, every shard is a whole layer, nothing padded. World 4: every layer is
# split four ways, and the layer sizes (all different) leave some with padding. Every
# other multi-rank test runs on 2 ranks.
@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])
async def test_adamw_matches_torch_on_unequal_padded_layers(world: int) -> None:
    spec = TrainSpec(optimizer={"kind": "adamw", "weight_decay": 0.01}, model={"n_blocks": 3})
    ref_losses, ref_state = reference(spec, "adamw", weight_decay=0.01)
    results = await run_ranks(train, world, spec)
    loss_err, param_err = compare(results, ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4
    # The parameters really moved, so the comparison is not trivially met.
    start = parameters(make_model(**spec.model))
    assert max((ref_state[n] - start[n]).abs().max().item() for n in start) > 5e-3
    for result in results:
        layouts = result["layouts"].values()
        numels = [numel for numel, _, _ in layouts]
        assert len(set(numels)) == len(numels), "every layer has its own size"
        assert world == 1 or any(n % world for n in numels), "some layer needs padding"
        for numel, padded, shard in layouts:
            assert padded % world == 0 and padded - numel < world and shard * world == padded


# name: (optimizer settings, TrainSpec overrides, parameter tolerance)
SGD = {"kind": "sgd", "momentum": 0.9, "weight_decay": 0.001}
OPTIMIZERS = {
    "sgd-momentum": ({**SGD, "nesterov": False}, {"lr": 1e-2}, 1e-6),
    "sgd-nesterov": ({**SGD, "nesterov": True}, {"lr": 1e-2}, 1e-6),
    "adam": ({"kind": "adam", "weight_decay": 0.01}, {"steps": 6}, 1e-4),
}


def optimizer_spec(name: str) -> TrainSpec:
    opt, overrides, _ = OPTIMIZERS[name]
    return TrainSpec(optimizer=opt, **overrides)


@pytest.fixture(scope="module")
def optimizer_runs() -> dict[str, list[dict]]:
    """Each optimizer other than AdamW trained on 2 ranks, all in one rank run."""
    return run_named(2, {name: (train, optimizer_spec(name)) for name in OPTIMIZERS})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_torch(optimizer_runs: dict[str, list[dict]], name: str) -> None:
    opt, _, tolerance = OPTIMIZERS[name]
    kw = {k: v for k, v in opt.items() if k != "kind"}
    ref_losses, ref_state = reference(optimizer_spec(name), opt["kind"], **kw)
    loss_err, param_err = compare(optimizer_runs[name], ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < tolerance
