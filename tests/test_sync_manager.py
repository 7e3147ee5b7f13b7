"""The synchronous face (``SyncManager``): the same numbers as the async API, the same
errors, the caller's grad mode, and a clean close."""

from __future__ import annotations

import threading

import pytest
import torch
from hf_models import LR, build, call_kwargs, global_mean, local, make_config
from hf_models import batch as hf_batch

from zero3_offload import StateError, Zero3CpuOffloadManager
from zero3_offload.sync import SyncManager
from zero3_offload.testing import RankContext

STEPS = 4  # micro-steps: 2 optimizer steps with accumulation 2


async def _async_run(ctx: RankContext) -> tuple[list[float], dict[str, torch.Tensor]]:
    async with Zero3CpuOffloadManager(make_config({}), ctx.group, build("llama")) as manager:
        losses = []
        for i in range(STEPS):
            out = await manager.forward(**call_kwargs("llama", local(hf_batch(i, "llama"), ctx)))
            await manager.backward(out.loss)
            await manager.optimizer_step(LR)
            losses.append(out.loss.item())
        return losses, await manager.full_state_dict()


@pytest.mark.ranks(2)
async def test_sync_face_trains_as_the_async_api(rank: RankContext) -> None:
    reference_losses, reference = await _async_run(rank)
    caller = threading.current_thread()
    with SyncManager(make_config({}), rank.group, build("llama")) as sync:
        assert sync.loop_thread.thread is not caller
        losses, stepped = [], []
        for i in range(STEPS):
            out = sync.forward(**call_kwargs("llama", local(hf_batch(i, "llama"), rank)))
            sync.backward(out.loss)
            stepped.append(sync.optimizer_step(LR))
            losses.append(out.loss.item())
        state = sync.full_state_dict()
        assert sync.steps_completed == 2
        assert sync.last_grad_norm is not None and sync.last_grad_norm > 0
        # The caller's no_grad reaches the loop's thread: an evaluation saves nothing,
        # and the backward that follows is refused as the async API refuses it.
        with torch.no_grad():
            out = sync.forward(**call_kwargs("llama", local(hf_batch(0, "llama"), rank)))
        assert out.loss.grad_fn is None
        with pytest.raises(StateError, match="forward"):
            sync.backward(out.loss)
        # The caller's own grad mode is untouched.
        assert torch.is_grad_enabled()
    assert stepped == [False, True, False, True]
    assert losses == reference_losses  # bitwise
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    assert not sync.loop_thread.thread.is_alive()
    with pytest.raises(StateError, match="closed"):
        sync.forward(input_ids=torch.zeros(1, 2, dtype=torch.long))
    sync.close()  # idempotent
    assert await global_mean(rank, torch.tensor(1.0)) == 1.0  # the group still works


@pytest.mark.ranks(1)
async def test_sync_face_raises_the_managers_errors(rank: RankContext) -> None:
    with pytest.raises(StateError, match="module mode"):
        # A chain of layers (no transformers model): forward() needs module mode.
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        with SyncManager(make_config({}), rank.group, model) as sync:
            sync.forward(torch.zeros(1, 4))
    with SyncManager(make_config({}), rank.group, build("gpt2")) as sync:
        bad = torch.full((1, 4), 10_000)  # ids beyond the vocabulary: the model raises
        with pytest.raises(Exception) as caught:
            sync.forward(input_ids=bad)
        async with Zero3CpuOffloadManager(make_config({}), rank.group, build("gpt2")) as m:
            with pytest.raises(type(caught.value)):
                await m.forward(input_ids=bad)
