"""``skip_nonfinite_steps``: a step with an inf/nan gradient on one rank is skipped on every
rank, bitwise, logged with its layer and rank; too many in a row raise NonFiniteError.

See [Note: non-finite guard]. Each case trains the same model twice on 2 real ranks: once
with a bad batch at one step on rank 1 (a NaN loss, or a NaN entering the backward at one
layer), and once, the reference, without that step's update (its forward, backward and
step left out; the learning rate is the same at every step). Parameters, every rank's
optimizer state and the optimizer's step counts must be bitwise equal.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
import structlog
import torch
from helpers import assert_bitwise, lm_loss, local_slice, make_batches, make_model, run_in_turn

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.errors import NonFiniteError
from zero3_offload.gradient.store import GradientStore
from zero3_offload.stats.step_counter import StepCounter
from zero3_offload.stats.timeline import Timeline
from zero3_offload.testing import RankContext

STEPS, BAD_STEP, LR = 4, 2, 1e-2


@attrs.frozen
class GuardSpec:
    config: dict[str, Any] = attrs.Factory(dict)
    module: bool = False  # module mode (units block0, block1 and the root) instead of a chain
    bad: str | None = None  # "loss": rank 1's loss is NaN; "block0": NaN enters block0's backward
    bad_steps: tuple[int, ...] = (BAD_STEP,)
    leave_out: tuple[int, ...] = ()  # steps the reference leaves out entirely
    early_lr: bool = False  # learning_rate= in backward_pass (speculative updates)


async def guarded_run(ctx: RankContext, spec: GuardSpec) -> dict[str, Any]:
    """Train ``STEPS`` steps on this rank's slice of each batch; what the test compares."""
    model = make_model()
    config = Zero3CpuOffloadConfig(
        optimizer=OptimizerConfig(kind="adamw", weight_decay=0.01),
        **({"skip_nonfinite_steps": True} | spec.config),
    )
    units = ["block0", "block1"] if spec.module else None
    stepped, error, times = [], None, {}  # times: step -> (its backward began, its step ended)
    with structlog.testing.capture_logs() as logs:
        async with Zero3CpuOffloadManager(config, ctx.group, model, units=units) as manager:
            names = manager.layer_names
            for step, (x, y) in enumerate(make_batches(STEPS, 8)):
                if step in spec.leave_out:
                    continue
                bad = spec.bad if step in spec.bad_steps and ctx.rank == 1 else None
                x, y = local_slice(x, ctx), local_slice(y, ctx)
                try:
                    ok, backward_at = await _step(manager, spec, names, x, y, bad)
                    stepped.append(ok)
                    times[step] = (backward_at, time.time())
                except NonFiniteError as exc:
                    error = str(exc)
                    break
            state = await manager.full_state_dict()
            optimizer = manager.engine.optimizer
            shards = {
                f"{layer}.{key}": value.clone()
                for layer in optimizer.layers()
                for key, value in optimizer.layer_state(layer).items()
            }
            shards |= {f"{layer}.master": optimizer.master(layer).clone() for layer in names}
            stats = manager.get_performance_stats()
    skipped = [e for e in logs if e["event"] == "step_skipped"]
    return {
        "state": state,
        "shards": shards,
        "stepped": stepped,
        "updates": stats.optimizer_steps,
        "skips": stats.nonfinite_skips,
        "steps": manager.steps_completed,
        "skipped": skipped,
        "error": error,
        "times": times,
    }


async def _step(
    manager: Zero3CpuOffloadManager,
    spec: GuardSpec,
    names: tuple[str, ...],
    x: torch.Tensor,
    y: torch.Tensor,
    bad: str | None,
) -> tuple[bool, float]:
    """One step; whether it updated, and when its backward began (``time.time()``)."""
    if spec.module:
        model = manager.model
        assert model is not None
        hook = None
        if bad == "block0":
            # A NaN enters the backward at block0's output: block0 and the layers before
            # it get NaN gradients, block1 and the head do not.
            def poison(_m: object, _i: object, out: torch.Tensor) -> None:
                out.register_hook(lambda g: g * float("nan"))

            hook = model.block0.register_forward_hook(poison)
        try:
            out = await manager.forward(x)
        finally:
            if hook is not None:
                hook.remove()
        loss = lm_loss(out.float(), y)
        if bad == "loss":
            loss = loss * float("nan")
        backward_at = time.time()
        await manager.backward(loss)
        return await manager.optimizer_step(LR), backward_at
    out = await manager.forward_pass(x, names)
    out.requires_grad_()
    loss = lm_loss(out.float(), y)
    if bad == "loss":
        loss = loss * float("nan")
    backward_at = time.time()
    loss.backward()
    await manager.backward_pass(out.grad, names, learning_rate=LR if spec.early_lr else None)
    return await manager.optimizer_step(LR), backward_at


CASES = {
    # The fp32 chain with updates started in backward (speculative: rolled back).
    "fp32-speculative": GuardSpec(config={"speculative_step": True}, bad="loss", early_lr=True),
    # bf16 compute, clipping on: the norm clipping computes is the check.
    "bf16-clipped": GuardSpec(
        config={"compute_dtype": "bf16", "gradient_clipping": 1.0}, bad="loss"
    ),
    # Module mode: the NaN enters the backward at one unit.
    "module-block0": GuardSpec(module=True, bad="block0"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_nonfinite_step_on_one_rank_is_skipped_on_both_bitwise(case: str) -> None:
    spec = CASES[case]
    reference = attrs.evolve(spec, bad=None, leave_out=(BAD_STEP,))
    bad, ref = await run_in_turn(2, (guarded_run, spec), (guarded_run, reference))
    assert_bitwise(bad[0]["state"], ref[0]["state"])
    for rank in (0, 1):
        got, want = bad[rank], ref[rank]
        assert_bitwise(got["shards"], want["shards"])  # masters and AdamW state, step included
        assert got["stepped"] == [True, True, False, True]
        assert (got["updates"], got["skips"], got["steps"]) == (3, 1, 4)
        assert (want["updates"], want["skips"], want["steps"]) == (3, 0, 3)
        (event,) = got["skipped"]
        assert event["reason"] == "inf/nan gradient"
        if spec.bad == "loss":
            # Every layer got the NaN; the head is the first in backward order.
            assert event["layer"] == "head"
            assert event["loss_ranks"] == [1]
        else:
            assert event["layer"] == "block0" and "block1" not in event["layers"]
            assert event["loss_ranks"] == []  # the loss was finite
        assert event["detail"].startswith("inf/nan gradient first in backward order in")


async def test_too_many_skips_in_a_row_raise_on_every_rank() -> None:
    spec = GuardSpec(config={"max_consecutive_nonfinite": 2}, bad="loss", bad_steps=(1, 2, 3))
    reference = GuardSpec(leave_out=(1, 2, 3))
    bad, ref = await run_in_turn(2, (guarded_run, spec), (guarded_run, reference))
    for rank in (0, 1):
        got = bad[rank]
        assert got["error"] is not None and got["stepped"] == [True, False]
        assert "2 optimizer steps in a row were skipped" in got["error"]
        assert "the loss was not finite on rank(s) 1" in got["error"]
        assert "first in backward order in 'head'" in got["error"]
        assert_bitwise(got["shards"], ref[rank]["shards"])


async def test_without_the_guard_a_nan_loss_is_applied() -> None:
    spec = GuardSpec(config={"skip_nonfinite_steps": False}, bad="loss")
    (bad,) = await run_in_turn(2, (guarded_run, spec))
    assert bad[0]["stepped"] == [True, True, True, True] and bad[0]["skipped"] == []
    assert all(v.isnan().all() for v in bad[0]["state"].values())


async def test_under_fp16_the_loss_scaler_skips_and_the_guard_names_the_rank() -> None:
    # fp16's own check decides (the loss scale backs off, so the run after it is not the
    # reference's bit for bit); a non-finite loss counts towards the limit.
    spec = GuardSpec(
        config={"compute_dtype": "fp16", "max_consecutive_nonfinite": 2},
        bad="loss",
        bad_steps=(1, 2),
    )
    (bad,) = await run_in_turn(2, (guarded_run, spec))
    for got in bad:
        assert got["stepped"] == [True, False] and got["error"] is not None
        assert [e["loss_ranks"] for e in got["skipped"]] == [[1], [1]]
        assert all("scale" in e for e in got["skipped"])  # the scaler's skip


def test_the_check_is_exact_where_a_sum_of_finite_values_overflows() -> None:
    timeline = Timeline(rank=0, counter=StepCounter())
    cpu = torch.device("cpu")
    store = GradientStore(
        device=cpu,
        streams=CopyStreams(device=cpu),
        workers=WorkerThreads(threads=1, timeline=timeline),
        timeline=timeline,
    )
    store.load({"big": torch.full((10,), 3e38), "small": torch.zeros(3)}, micro_steps=1)
    assert not store.has_nonfinite()  # the sum overflows; every element is finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        store.get("small")[1] = bad
        assert store.has_nonfinite() and not store.has_nonfinite(["big"])
        assert store.scale_layers_(["big", "small"], 0.5, check=True)  # the fused kernel's
