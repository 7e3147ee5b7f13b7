"""One rank's failed call reaches every rank as the same error class naming that rank, the
call is abandoned on every rank, and training goes on exactly as without the bad batch.

Real faults on real gloo ranks (see ``call_faults``): token ids outside the vocabulary
on rank 1 only (forward), in chain mode and in module mode (a 2-layer Llama). The
other cases (backward hooks, the loss, both ranks given the bad batch) are rows of the
fault table (``tests/test_faults.py``, ``-m faults``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from call_faults import CallFault, fault_and_reference, outcome
from helpers import lm_loss, local_slice, make_batches, make_model, run_in_turn

from zero3_offload import (
    InputError,
    OptimizerConfig,
    Zero3CpuOffloadConfig,
    Zero3CpuOffloadManager,
    Zero3Error,
)
from zero3_offload.comm.failure_report import FailureReport
from zero3_offload.testing import RankContext

# Far below a collective's timeout (300 s) and the heartbeat's (5 s): only the failure
# channel explains an error this soon on the rank whose call did not fail.
WITHIN_S = 4.0


def run(fault: CallFault) -> list[dict[str, Any]]:
    return asyncio.run(run_in_turn(2, (fault_and_reference, fault)))[0]


@pytest.mark.parametrize("mode", ["chain", "module"])
def test_a_bad_batch_on_one_rank_reaches_every_rank_and_training_goes_on(mode: str) -> None:
    fault = CallFault(mode=mode, where="forward")
    results = run(fault)
    got = outcome(results, fault)
    failing, other = got.errors[1], got.errors[0]
    assert failing["error"] == "LayerExecutionError", failing
    assert "index out of range" in failing["message"]
    # The same class on the other rank, naming rank 1, its call and its error: not a timeout.
    call = "forward_pass(" if mode == "chain" else "forward(input_ids=tensor"
    assert other["error"] == "LayerExecutionError", other
    assert other["message"].startswith(f"rank 1 failed in {call}"), other["message"]
    assert "index out of range" in other["message"]
    assert "this rank (0) abandoned" in other["message"]
    assert all(s < WITHIN_S for s in got.seconds), got.seconds
    # Every later step trains, and the run ends bitwise equal to one without the bad batch.
    assert got.went_on, results
    assert got.exact


def test_a_failure_report_names_the_rank_the_call_and_the_error() -> None:
    report = FailureReport(
        rank=3, call="backward(tensor) at step 4, micro-step 1", error="InputError", line="bad"
    )
    assert FailureReport.decode(report.encode()) == report
    error = report.peer_error(0, "the start of all_gather of 8 bytes")
    assert type(error) is InputError
    assert str(error).startswith("rank 3 failed in backward(tensor) at step 4, micro-step 1: ")
    assert "this rank (0) abandoned the start of all_gather of 8 bytes" in str(error)
    # An error that is no library error is raised as the library's base class.
    other = FailureReport(rank=1, call="forward(tensor)", error="MemoryError", line="")
    assert type(other.peer_error(0, "x")) is Zero3Error


async def half_updated(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 gives ``optimizer_step`` a learning rate it refuses while rank 0 updates: the
    ranks' states differ, so every later call is refused at once."""
    config = Zero3CpuOffloadConfig(optimizer=OptimizerConfig(kind="adamw"))
    manager = Zero3CpuOffloadManager(config, ctx.group, make_model(d=16, n_blocks=1))
    names = list(manager.layer_names)
    x, y = (local_slice(t, ctx) for t in make_batches(1, 8)[0])
    out = await manager.forward_pass(x, names)
    out.requires_grad_()
    lm_loss(out, y).backward()
    await manager.backward_pass(out.grad, names)
    errors: list[tuple[str, str]] = []
    try:
        await manager.optimizer_step(1e-3 if ctx.rank == 0 else -1.0)
    except Zero3Error as exc:
        errors.append((type(exc).__name__, str(exc)))
    for _ in range(3):
        try:
            await manager.forward_pass(x, names)
        except Zero3Error as exc:
            errors.append((type(exc).__name__, str(exc)))
    await manager.close()
    return {"errors": errors}


def test_a_step_one_rank_refused_while_another_updated_stops_the_run() -> None:
    results = asyncio.run(run_in_turn(2, (half_updated,)))[0]
    assert results[1]["errors"][0][0] == "ConfigError"
    assert "ConfigError" in [e for e, _ in results[0]["errors"]]  # in the step or right after
    for r in results:
        refused = r["errors"][-2:]
        assert [e for e, _ in refused] == ["StateError", "StateError"], r
        for _, message in refused:
            assert "rank 1 failed in optimizer_step(-1.0)" in message
            assert "no further call can run" in message
            assert "resume from the last checkpoint" in message
