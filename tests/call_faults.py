"""Rank functions where one rank's call fails for its own reasons, and the run goes on.

The faults are real: token ids outside the vocabulary (the embedding raises in
forward), a backward hook that raises (registered on one rank's layer), a loss
whose targets are outside the vocabulary (the application's cross entropy
raises between forward and backward, and the rank calls ``abandon_step``), in
chain mode (``forward_pass``/``backward_pass`` on the small GPT of
``helpers``) and module mode (``forward``/``backward`` of a 2-layer Llama).
Each rank records, per step, the loss or the error it got (class, message,
when), the faulty rank also when the fault happened; the same ranks then train
a reference run without the bad batch, so a test compares the steps after the
fault and the final parameters bitwise. Used by ``tests/test_call_failure.py``
and ``tests/test_faults.py`` (the fault table).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from helpers import lm_loss, local_slice, make_batches, make_model

from zero3_offload import OptimizerConfig, Zero3CpuOffloadConfig, Zero3CpuOffloadManager
from zero3_offload.errors import Zero3Error
from zero3_offload.testing import RankContext

MODES = ("chain", "module")
WHERE = ("forward", "backward", "loss")
LR = 1e-3
OUTSIDE = 1000  # added to token ids or targets: outside every vocabulary here


@attrs.frozen
class CallFault:
    """One run: where the bad batch hits, on which ranks, at which step."""

    mode: str = "chain"  # one of MODES
    where: str = "forward"  # one of WHERE
    ranks: tuple[int, ...] = (1,)  # the ranks whose batch is bad
    bad_step: int = 2
    steps: int = 5
    heartbeat_s: float = 5.0

    def config(self) -> Zero3CpuOffloadConfig:
        return Zero3CpuOffloadConfig(
            optimizer=OptimizerConfig(kind="adamw"), heartbeat_timeout_s=self.heartbeat_s
        )


def _model_and_batches(fault: CallFault) -> tuple[torch.nn.Module, list[Any]]:
    if fault.mode == "chain":
        return make_model(d=16, n_blocks=1), make_batches(fault.steps, 8)
    import hf_models

    batches = [hf_models.batch(i, "llama") for i in range(fault.steps)]
    return hf_models.build("llama"), [(x, x) for x in batches]


async def _step(
    manager: Zero3CpuOffloadManager,
    fault: CallFault,
    x: torch.Tensor,
    y: torch.Tensor,
    bad: bool,
    fault_at: list[float],
) -> float:
    """One training step; a bad step's loss fails on this rank when ``fault.where`` says."""
    bad_loss = bad and fault.where == "loss"
    if fault.mode == "chain":
        names = list(manager.layer_names)
        out = await manager.forward_pass(x, names)
        out.requires_grad_()
        try:
            fault_at[0] = time.time()
            loss = lm_loss(out, y + OUTSIDE if bad_loss else y)
        except Exception as exc:  # the application's own code: every rank abandons the step
            await manager.abandon_step(exc)
        loss.backward()
        await manager.backward_pass(out.grad, names)
    else:
        out = await manager.forward(input_ids=x, use_cache=False)
        logits, targets = out.logits[:, :-1], y[:, 1:]
        try:
            fault_at[0] = time.time()
            targets = targets + OUTSIDE if bad_loss else targets
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        except Exception as exc:
            await manager.abandon_step(exc)
        await manager.backward(loss)
    await manager.optimizer_step(LR)
    return float(loss.item())


def _hooked(model: torch.nn.Module, fault: CallFault) -> torch.nn.Module:
    """The layer whose backward hook raises."""
    return model.block0 if fault.mode == "chain" else model.model.layers[0]  # type: ignore[union-attr]


async def _train(ctx: RankContext, fault: CallFault, *, skip_bad: bool) -> dict[str, Any]:
    model, batches = _model_and_batches(fault)
    manager = Zero3CpuOffloadManager(fault.config(), ctx.group, model)
    steps: list[dict[str, Any]] = []
    fault_at = [0.0]
    for i, (x, y) in enumerate(batches):
        if i == fault.bad_step and skip_bad:
            continue
        bad = i == fault.bad_step and ctx.rank in fault.ranks
        x, y = local_slice(x, ctx), local_slice(y, ctx)
        handle = None
        fault_at[0] = time.time()
        if bad and fault.where == "forward":
            x = x + OUTSIDE
        if bad and fault.where == "backward":

            def hook(module: torch.nn.Module, grad_in: Any, grad_out: Any) -> None:
                fault_at[0] = time.time()
                raise RuntimeError("a backward hook of this rank raised")

            handle = _hooked(model, fault).register_full_backward_hook(hook)
        try:
            steps.append({"loss": await _step(manager, fault, x, y, bad, fault_at)})
        except Zero3Error as exc:
            steps.append(
                {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
                | ({"fault_at": fault_at[0]} if bad else {})
            )
        finally:
            if handle is not None:
                handle.remove()
    state = await manager.full_state_dict()
    await manager.close()
    return {"steps": steps, "state": state if ctx.rank == 0 else None}


async def fault_and_reference(ctx: RankContext, fault: CallFault) -> dict[str, Any]:
    """Rank function: the run with the bad batch, then the same run without it."""
    return {
        "faulty": await _train(ctx, fault, skip_bad=False),
        "reference": await _train(ctx, fault, skip_bad=True),
    }


@attrs.frozen
class Outcome:
    """What a faulty run and its reference showed, across the ranks."""

    errors: list[dict[str, Any]]  # per rank: the bad step's error (class, message, at)
    seconds: list[float]  # per rank: from the fault to that rank's error
    went_on: bool  # every later step trained on every rank
    exact: bool  # later losses and the final parameters bitwise equal to the reference's


def outcome(results: list[dict[str, Any]], fault: CallFault) -> Outcome:
    """Read the ranks' results of :func:`fault_and_reference`."""
    bad = fault.bad_step
    errors = [r["faulty"]["steps"][bad] for r in results]
    fault_at = min(e["fault_at"] for e in errors if "fault_at" in e)
    seconds = [e["at"] - fault_at if "at" in e else float("inf") for e in errors]
    later = [r["faulty"]["steps"][bad + 1 :] for r in results]
    went_on = all("loss" in s for steps in later for s in steps)
    reference = [r["reference"]["steps"][bad:] for r in results]
    losses_equal = went_on and later == reference
    a, b = results[0]["faulty"]["state"], results[0]["reference"]["state"]
    exact = losses_equal and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return Outcome(errors=errors, seconds=seconds, went_on=went_on, exact=exact)
