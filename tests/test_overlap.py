"""Overlap is real: CPU optimizer work runs while other layers' backward computes.

The evidence is the library's own timeline (``time.perf_counter`` intervals
recorded around the compute on the event loop's thread and around each
worker-thread job), not sleeps or injected delays.
"""

from __future__ import annotations

from helpers import TrainSpec, assert_bitwise, run_in_turn, train

MODEL = {"d": 96, "n_blocks": 4}


def overlaps(timeline: list[tuple]) -> list[tuple[str, str]]:
    """(optimizer layer, backward layer) pairs whose intervals intersect."""
    steps = [e for e in timeline if e[0] == "cpu-optimizer"]
    backs = [e for e in timeline if e[0] == "compute" and e[2] == "backward"]
    return [
        (s[1], b[1]) for s in steps for b in backs if s[1] != b[1] and s[3] < b[4] and b[3] < s[4]
    ]


async def test_optimizer_runs_during_backward_with_identical_results() -> None:
    common = {"steps": 6, "early_lr": True, "model": MODEL, "timeline": True}
    on, off = await run_in_turn(
        2,
        (train, TrainSpec(config={"overlap_computation": True}, **common)),
        (train, TrainSpec(config={"overlap_computation": False}, **common)),
    )
    found = [pair for r in on for pair in overlaps(r["timeline"])]
    assert found, "no CPU optimizer interval overlapped another layer's backward compute"
    for r in off:
        assert overlaps(r["timeline"]) == []
        # Without overlap every update runs after the whole backward of its step.
        assert all(e[2] == "step" for e in r["timeline"] if e[0] == "cpu-optimizer")
    # Worker threads, not the event loop's thread, ran the optimizer.
    workers = {e[5] for r in on for e in r["timeline"] if e[0] == "cpu-optimizer"}
    assert "event-loop" not in workers
    assert_bitwise(on[0]["state"], off[0]["state"])
    assert on[0]["losses"] == off[0]["losses"]
