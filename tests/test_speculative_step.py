"""Speculative optimizer updates with clipping and fp16: bitwise the step after backward.

See [Note: speculative update]. Each case trains the same model twice on 2
real ranks: with ``learning_rate=`` in ``backward_pass`` (updates start as
each layer's gradient lands, speculatively) and without (every update waits
for ``optimizer_step``), and compares every parameter bitwise.
"""

from __future__ import annotations

import pytest
from helpers import TrainSpec, assert_bitwise, run_in_turn, train

MODEL = {"d": 96, "n_blocks": 4}
STEPS = 5


def started_in_backward(timeline: list[tuple]) -> int:
    """Updates whose next compute interval is a backward one: they started while the
    backward of their step still ran (an update after backward is followed by a forward)."""
    computes = sorted((e[3], e[2]) for e in timeline if e[0] == "compute")
    starts = [e[3] for e in timeline if e[0] == "cpu-optimizer"]
    return sum(next((p for t, p in computes if t > s), None) == "backward" for s in starts)


def pair(config: dict, **kw: object) -> tuple[tuple, tuple]:
    common = {"steps": STEPS, "model": MODEL, "timeline": True, **kw}
    speculative = TrainSpec(early_lr=True, config={"speculative_step": True, **config}, **common)
    return (train, speculative), (train, TrainSpec(config=config, **common))


def same_run(spec: list[dict], plain: list[dict]) -> None:
    assert_bitwise(spec[0]["state"], plain[0]["state"])
    for a, b in zip(spec, plain, strict=True):
        assert a["losses"] == b["losses"]
        assert a["grad_norms"] == b["grad_norms"]
        assert a["stepped"] == b["stepped"]


@pytest.mark.parametrize(
    ("clip", "rollbacks"),
    [(1e6, "none"), (0.05, "every step"), (None, "some steps")],
    ids=["clip-never-fires", "clip-always-fires", "clip-fires-sometimes"],
)
async def test_speculation_under_clipping_is_bitwise_the_step_after_backward(
    clip: float | None, rollbacks: str
) -> None:
    if clip is None:  # between the smallest and the largest norm of the plain run
        (plain,) = await run_in_turn(2, pair({"gradient_clipping": 1e6})[1])
        norms = sorted(plain[0]["grad_norms"])
        clip = (norms[0] + norms[-1]) / 2
    spec, plain = await run_in_turn(2, *pair({"gradient_clipping": clip}))
    same_run(spec, plain)
    fired = sum(n > clip for n in plain[0]["grad_norms"])
    assert {"none": fired == 0, "every step": fired == STEPS}.get(rollbacks, 0 < fired < STEPS)
    for r in spec:
        # One rollback per step whose clipping applied; the updates did start during backward.
        assert r["performance"].speculative_rollbacks == fired
        assert started_in_backward(r["timeline"]) > 0
        memory = r["memory"]
        assert memory["speculation_backup_bytes"] == (
            memory["master_param_bytes"] + memory["optimizer_state_bytes"]
        )
    for r in plain:
        assert started_in_backward(r["timeline"]) == 0
        assert r["performance"].speculative_rollbacks == 0
        assert r["memory"]["speculation_backup_bytes"] == 0


async def test_speculation_under_fp16_rolls_back_an_inf_on_one_rank() -> None:
    config = {"compute_dtype": "fp16", "gradient_clipping": 1.0}
    spec, plain = await run_in_turn(2, *pair(config, inject_inf=(1, 2)))
    same_run(spec, plain)
    for a, b in zip(spec, plain, strict=True):
        assert a["loss_scales"] == b["loss_scales"]
    if spec[0]["states"] is not None:
        for a, b in zip(spec[0]["states"], plain[0]["states"], strict=True):
            assert_bitwise(a, b)  # after every step, the skipped one included
    assert spec[0]["stepped"][2] is False
    skipped = spec[0]["stepped"].count(False)
    assert spec[0]["performance"].speculative_rollbacks >= skipped >= 1


async def test_speculation_with_accumulation_matches() -> None:
    config = {"gradient_clipping": 0.05, "gradient_accumulation_steps": 2}
    spec, plain = await run_in_turn(2, *pair(config, micro_steps=2))
    same_run(spec, plain)
    assert spec[0]["performance"].speculative_rollbacks == STEPS


async def test_without_speculative_step_clipping_waits_for_the_backward() -> None:
    # The default: speculative_step=False, learning_rate given to backward_pass.
    common = {"steps": STEPS, "model": MODEL, "config": {"gradient_clipping": 1e6}}
    off, plain = await run_in_turn(
        2,
        (train, TrainSpec(early_lr=True, timeline=True, **common)),
        (train, TrainSpec(timeline=True, **common)),
    )
    same_run(off, plain)
    for r in off:
        assert started_in_backward(r["timeline"]) == 0
        assert r["memory"]["speculation_backup_bytes"] == 0
