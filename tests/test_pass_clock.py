"""The passes' clock: one accounting for both modes. The accumulation window opens at the
first training forward only, so an evaluation between steps (a forward under no_grad) is not
part of the next step's seconds, in chain mode and in module mode alike."""

from __future__ import annotations

import time

import pytest
import structlog
import torch
from helpers import Block, lm_loss, make_batches, make_model

from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.stats import PassClock, Phase, Timeline, Zero3PerformanceStats
from zero3_offload.stats.timeline import wall_time
from zero3_offload.testing import RankContext


def test_only_a_training_forward_opens_the_window() -> None:
    stats = Zero3PerformanceStats()
    clock = PassClock(stats=stats, timeline=Timeline())
    clock.start(Phase.INFERENCE)
    clock.start(Phase.GENERATE)
    clock.start(Phase.BACKWARD)
    assert clock.end_window(5.0) == 5.0  # nothing opened it: the step starts at its end
    opened = clock.start(Phase.FORWARD)
    clock.start(Phase.FORWARD)  # a second micro-step's forward: the window stays open
    assert clock.end_window(opened + 9.0) == opened
    clock.start(Phase.FORWARD)
    clock.reset()
    assert clock.end_window(7.0) == 7.0


def test_passes_and_compute_add_up_per_phase() -> None:
    stats, timeline = Zero3PerformanceStats(), Timeline()
    clock = PassClock(stats=stats, timeline=timeline)
    for phase in (Phase.FORWARD, Phase.INFERENCE, Phase.BACKWARD):
        started = clock.start(phase)
        clock.compute("block0", phase, started)
        clock.finish(phase, started, samples=4)
    assert (stats.forward_passes, stats.backward_passes, stats.forward_samples) == (2, 1, 8)
    timing = stats.layer_timings["block0"]
    assert (timing.forward_executions, timing.backward_executions) == (2, 1)
    # Evaluation's compute is logged as forward work.
    assert [e.phase for e in timeline.events()] == ["forward", "forward", "backward"]


@pytest.mark.ranks(1)
@pytest.mark.parametrize("module_mode", [False, True])
async def test_an_evaluation_between_steps_is_not_in_the_next_steps_seconds(
    rank: RankContext, module_mode: bool
) -> None:
    model = make_model()
    config = Zero3CpuOffloadConfig(device="cpu")
    units = (Block,) if module_mode else None
    manager = Zero3CpuOffloadManager(config, rank.group, model, units=units)
    names = list(model.layer_names)
    (x, y), (ex, _), (x2, y2) = make_batches(3, 4)

    async def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if module_mode:
            await manager.backward(lm_loss(await manager.forward(x), y))
        else:
            logits = (await manager.forward_pass(x, names)).requires_grad_()
            lm_loss(logits, y).backward()
            await manager.backward_pass(logits.grad, names)
        assert await manager.optimizer_step(1e-3)

    async with manager:
        await step(x, y)
        with torch.no_grad():
            if module_mode:
                await manager.forward(ex)
            else:
                await manager.forward_pass(ex, names)
        evaluated = wall_time(time.perf_counter())
        with structlog.testing.capture_logs() as logs:
            await step(x2, y2)
        stats = manager.get_performance_stats()
    (event,) = [e for e in logs if e["event"] == "step"]
    assert event["step"] == 1
    # The window opened at the second step's training forward, after the evaluation.
    assert event["start"] >= evaluated
    assert stats.forward_passes == 3  # the evaluation counts as a forward pass
