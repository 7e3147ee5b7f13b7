"""Rank side of the API fuzz: a command loop over one manager, inputs built by kind,
and a fingerprint of the training state.

:func:`serve` is the rank function ``run_ranks`` starts (module level, so rank
processes import it by name; ``conftest.py`` puts ``tests/`` on the path). It
connects back to the driver, then answers messages until told to stop:

- ``("open", Setup)``: build a manager (closing the previous one); an Outcome.
- ``("call", Call)``: run one API call on it; an :class:`~fuzz_calls.Outcome`
  with the fingerprints before and after.
- ``("replay", [Call, ...])``: take the fuzzed manager's final fingerprint, close
  it, build a fresh manager from the same setup, run the calls on it and
  return ``(fuzzed fingerprint, outcomes, fresh fingerprint)``.
- ``("end", None)``: close the manager. ``("stop", None)``: return.

Calls name their inputs by kind (``x="nan"``); each rank builds its own data
from the call's seed and its rank, so ranks train on different micro-batches
while a bad input is bad on every rank alike.
"""

from __future__ import annotations

import faulthandler
import hashlib
import math
import os
import signal
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch
from fuzz_calls import (
    MODELS,
    Call,
    Outcome,
    Setup,
    build_model,
    input_shape,
    make_input,
    vocab,
    with_first,
)

from zero3_offload import Zero3CpuOffloadConfig, Zero3CpuOffloadManager, Zero3Error
from zero3_offload.testing import RankContext

__all__ = ["Session", "digest", "fingerprint", "serve"]


def digest(*tensors: torch.Tensor | None) -> str:
    """A short digest of tensors' dtypes, shapes and bytes (so NaN equals NaN)."""
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        if t is None:
            h.update(b"none;")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _float(value: float | None) -> str:
    return "None" if value is None else float(value).hex()


def fingerprint(session: Session) -> dict[str, str]:
    """Everything that defines this rank's training state, as digests and counters.

    Per layer: the fp32 master shard, its compute copy (what gathers send), the
    optimizer state and the accumulated gradient shard (what a checkpoint
    holds, see ``ShardCheckpointer._tensors``); then the step counters, the loss
    scale, the open window and the pending forward. Timings, prefetch and
    memory figures are not state: they may differ between equal runs.
    """
    m = session.manager
    engine = m.engine
    # The step state has no public view (as in test_errors.py): read the components.
    state = m._state
    fp: dict[str, str] = {}
    for name, layout in engine.layouts.items():
        if not layout.numel:
            continue
        copy = engine.params.compute_copy(name)
        optim = engine.optimizer.layer_state(name)
        fp[f"{name}.master"] = digest(engine.params.master(name))
        fp[f"{name}.copy"] = digest(copy.payload, copy.scales)
        fp[f"{name}.optim"] = (
            ",".join(sorted(optim)) + ":" + digest(*(optim[k] for k in sorted(optim)))
        )
        fp[f"{name}.grad"] = digest(engine.grads.get(name))
    forward = state.forward
    scaler = engine.steps.loss_scaler
    fp |= {
        "micro_steps": str(engine.grads.micro_steps),
        "calls_since_update": str(engine.counter.window_calls),
        "early_lr": _float(state.early_lr),
        "stepped": repr(sorted(engine.steps.stepped)),
        "steps_completed": str(m.steps_completed),
        "optimizer_steps": str(engine.counter.updates),
        "last_grad_norm": _float(m.last_grad_norm),
        "loss_scaler": "None" if scaler is None else repr(sorted(scaler.state_dict().items())),
        "pending": "None"
        if forward is None
        else repr(
            (
                tuple(forward.layers),
                tuple(forward.output_shape or ()),
                [s is None for s in forward.steps],
            )
        ),
        "closed": str(m._closed),
    }
    return fp


class Session:
    """One manager on this rank, with the last training forward's output gradient.

    Args:
        ctx: this rank.
        setup: the model, seed and config.
        label: ``"run"`` (the fuzzed manager) or ``"replay"``; checkpoints go
            under ``setup.directory/label``.
    """

    def __init__(self, ctx: RankContext, setup: Setup, label: str) -> None:
        self.ctx = ctx
        self.setup = setup
        self.spec = MODELS[setup.model]
        self.root = Path(setup.directory) / label
        model = build_model(setup.model, setup.seed, setup.dropout)
        config = Zero3CpuOffloadConfig.from_dict(setup.config)
        self.manager = Zero3CpuOffloadManager(config, ctx.group, model)
        self.grad: torch.Tensor | None = None  # d(loss)/d(output) of the last training forward

    # ------------------------------------------------------------------ inputs

    def make_x(self, kind: str, seed: int) -> Any:
        """This rank's input of the given kind (see ``fuzz_calls.make_input``)."""
        return make_input(self.setup.model, kind, seed, self.ctx.rank)

    def make_grad(self, kind: str) -> Any:
        """An output gradient of the given kind, from the last training forward's."""
        base = self.grad
        if base is None:  # no forward yet: the shape a full forward would give
            rows = self.spec.batch
            base = torch.ones(
                (rows, *input_shape(self.setup.model, rows)[1:], vocab())
                if self.spec.token_input
                else input_shape(self.setup.model, rows)
            )
        if kind == "good":
            return base
        if kind == "zeros":
            return torch.zeros_like(base)
        if kind == "nan":
            return with_first(base, math.nan)
        if kind == "inf":
            return with_first(base, math.inf)
        if kind == "float64":
            return base.double()
        if kind == "int":
            return (base * 1000).long()
        if kind == "complex":
            return base.to(torch.complex64)
        if kind == "wrong_shape":
            return torch.zeros((base.shape[0] + 1, *base.shape[1:]), dtype=base.dtype)
        if kind == "scalar":
            return torch.tensor(1.0)
        if kind == "meta":
            return torch.empty(base.shape, dtype=base.dtype, device="meta")
        if kind == "not_tensor":
            return base.tolist()
        raise ValueError(f"unknown gradient kind {kind!r}")

    def checkpoint(self, index: int) -> Path:
        return self.root / f"ckpt{index}"

    # ------------------------------------------------------------------- calls

    async def forward(self, x: str, layers: Any, training: bool, seed: int) -> dict[str, str]:
        inp = self.make_x(x, seed)
        torch.manual_seed(seed)  # dropout draws the same masks in the replay
        with torch.set_grad_enabled(training):
            out = await self.manager.forward_pass(inp, layers)
        result = {"out": digest(out)}
        if training:
            out.requires_grad_()
            loss = out.float().square().mean()  # the loss lives outside the manager
            loss.backward()
            self.grad = out.grad
            result["loss"] = _float(loss.item())
        return result

    async def backward(self, grad: str, layers: Any, lr: Any) -> str:
        g = await self.manager.backward_pass(self.make_grad(grad), layers, learning_rate=lr)
        return digest(g)

    async def step(self, lr: Any) -> bool:
        return await self.manager.optimizer_step(lr)

    async def save(self, index: int) -> str:
        return (await self.manager.save_checkpoint(self.checkpoint(index))).name

    async def load(self, index: int) -> str:
        return (await self.manager.load_checkpoint(self.checkpoint(index))).name

    async def reset(self) -> None:
        await self.manager.reset_state()

    async def adapt(self) -> int:
        return await self.manager.adapt_performance()

    async def force(self) -> int:
        return await self.manager.force_memory_optimization()

    async def state_dict(self) -> str:
        state = await self.manager.full_state_dict()
        return digest(*(state[k] for k in sorted(state))) + ":" + ",".join(sorted(state))

    async def close(self) -> None:
        await self.manager.close()

    # Harness self-tests only (tests/test_fuzz.py): each breaks one invariant on purpose.

    async def tamper(self) -> None:
        """Change a master shard behind the manager's back (the replay must notice)."""
        name = next(n for n, lay in self.manager.engine.layouts.items() if lay.numel)
        self.manager.engine.params.master(name).add_(1.0)

    async def hang(self) -> None:
        """Rank 0 enters a collective that no other rank enters (the driver must time out)."""
        if self.ctx.rank == 0:
            await self.manager.engine.comm.all_reduce_sum(torch.zeros(1))

    async def crash(self) -> None:
        """The last rank exits at once (the driver must report a dead rank)."""
        if self.ctx.rank == self.ctx.world_size - 1:
            os._exit(3)

    OPS = frozenset(
        {"forward", "backward", "step", "save", "load", "reset", "adapt", "force", "state_dict"}
        | {"close", "tamper", "hang", "crash"}
    )

    def handler(self, op: str) -> Callable[..., Awaitable[Any]]:
        if op not in self.OPS:
            raise ValueError(f"unknown op {op!r}")
        return getattr(self, op)

    async def run(self, call: Call) -> Outcome:
        """Run ``call``; its result or error, with the fingerprints around it."""
        before = fingerprint(self)
        fn = self.handler(call.op)
        try:
            result = await fn(**call.args)
        except Exception as exc:  # reported to the driver, which judges it
            return _failed(exc, before, fingerprint(self))
        return Outcome(True, result, None, False, "", "", before, fingerprint(self))


def _failed(exc: Exception, before: dict[str, str], after: dict[str, str]) -> Outcome:
    """The outcome of a call (or an open) that raised ``exc``."""
    return Outcome(
        ok=False,
        result=None,
        error=type(exc).__name__,
        zero3=isinstance(exc, Zero3Error),
        message=str(exc),
        detail=traceback.format_exc(),
        before=before,
        after=after,
    )


def _failed_open(exc: Exception) -> Outcome:
    return _failed(exc, {}, {})


async def _open(ctx: RankContext, setup: Setup, label: str) -> tuple[Session | None, Outcome]:
    try:
        session = Session(ctx, setup, label)
    except Exception as exc:  # reported to the driver, which judges it
        return None, _failed_open(exc)
    fp = fingerprint(session)
    return session, Outcome(True, None, None, False, "", "", {}, fp)


async def _replay(
    ctx: RankContext, setup: Setup, calls: list[Call]
) -> tuple[list[Outcome], dict[str, str]]:
    fresh, opened = await _open(ctx, setup, "replay")
    if fresh is None:
        return [opened], {}
    try:
        outcomes = [await fresh.run(call) for call in calls]
        return outcomes, fingerprint(fresh)
    finally:
        await fresh.manager.close()


async def serve(ctx: RankContext, address: tuple[str, int], authkey: bytes, dumps: str) -> int:
    """Rank function: answer the driver's messages until ``stop``; the number answered.

    On SIGUSR1 the rank writes every thread's Python stack to ``dumps/rank<r>.txt``
    (the driver asks for it when the rank hangs).
    """
    dump = Path(dumps, f"rank{ctx.rank}.txt").open("w")  # noqa: SIM115 (open while serving)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    conn = Client(address, authkey=authkey)
    conn.send(("hello", ctx.rank, os.getpid()))
    session: Session | None = None
    setup: Setup | None = None
    fuzzed: dict[str, str] = {}  # the fuzzed manager's last fingerprint
    answered = 0
    try:
        while True:
            kind, payload = await anyio.to_thread.run_sync(conn.recv)
            if kind == "stop":
                return answered
            if kind in ("open", "replay", "end") and session is not None:
                # Every message but "call" ends the fuzzed manager first.
                fuzzed = fingerprint(session)
                await session.manager.close()
                session = None
            if kind == "open":
                setup = payload
                session, reply = await _open(ctx, payload, "run")
            elif kind == "call":
                assert session is not None, "call before open"
                reply = await session.run(payload)
            elif kind == "replay":
                assert setup is not None, "replay before open"
                outcomes, fresh = await _replay(ctx, setup, payload)
                reply = (fuzzed, outcomes, fresh)
            elif kind == "end":
                reply = None
            else:
                raise ValueError(f"unknown message {kind!r}")
            conn.send(reply)
            answered += 1
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        dump.close()
        if session is not None:
            await session.manager.close()
        conn.close()
