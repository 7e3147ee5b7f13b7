"""Gradient accumulation and global-norm clipping match plain PyTorch."""

from __future__ import annotations

import pytest
from helpers import (
    TrainSpec,
    compare,
    make_batches,
    make_model,
    make_torch_optimizer,
    parameters,
    reference,
    train,
    train_reference,
)

from zero3_offload.testing import run_ranks


# Two ranks: the window's path (accumulate on every rank, then one update) does not
# depend on the world size; test_equivalence.py runs 4 ranks.
@pytest.mark.slow
async def test_four_micro_steps_equal_one_big_batch() -> None:
    spec = TrainSpec(steps=5, batch=16, micro_steps=4, config={"gradient_accumulation_steps": 4})
    ref_losses, ref_state = reference(spec, "adamw")
    loss_err, param_err = compare(await run_ranks(train, 2, spec), ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4


async def test_clipping_matches_clip_grad_norm() -> None:
    clip = 0.5
    spec = TrainSpec(steps=6, config={"gradient_clipping": clip})
    model = make_model()
    norms: list[float] = []
    ref_losses = train_reference(
        model,
        make_batches(spec.steps, spec.batch),
        make_torch_optimizer("adamw", model.parameters()),
        clip=clip,
        norms=norms,
    )
    ref_state = parameters(model)
    assert min(norms) > clip, "every step must actually clip for the test to mean anything"
    results = await run_ranks(train, 2, spec)
    for r in results:
        assert r["grad_norms"] == pytest.approx(norms, rel=1e-5)
    loss_err, param_err = compare(results, ref_losses, ref_state)
    assert loss_err < 1e-5
    assert param_err < 1e-4
