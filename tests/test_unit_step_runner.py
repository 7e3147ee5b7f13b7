"""Unit tests of ``StepRunner``: updates, early updates, speculative updates and rollbacks.

See [Note: optimizer update during backward] and [Note: speculative update] in
``zero3_offload.optimizer_state.step_runner``. Real components throughout: the
parameter and gradient stores, ``ShardOptimizers``, ``SpeculationBackup``,
``WorkerThreads``, a ``GradientReducer`` for the gradients that land, and collectives
over a one-rank gloo group made in this process (``tests/one_rank.py``). The expected
values come from ``torch.optim`` run on copies of the masters with the same kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from one_rank import one_rank_collectives
from torch import nn

from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.comm.worker_threads import WorkerThreads
from zero3_offload.config import OptimizerConfig, Zero3CpuOffloadConfig
from zero3_offload.gradient.buffers import GradientBuffers
from zero3_offload.gradient.reducer import GradientReducer, PendingGradient
from zero3_offload.gradient.store import GradientStore
from zero3_offload.optimizer_state.shard_optimizers import ShardOptimizers
from zero3_offload.optimizer_state.speculation_backup import SpeculationBackup
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.parameter.codec import ShardCodec
from zero3_offload.parameter.flat_layout import LayerLayout, build_layouts
from zero3_offload.parameter.rank_mapping import Zero3RankMapping
from zero3_offload.parameter.store import ParameterStore
from zero3_offload.stats.timeline import Timeline

CPU = torch.device("cpu")
LR = 1e-2
NAMES = ("a", "b")


@pytest.fixture(scope="module")
def comm() -> Iterator[Collectives]:
    collectives = one_rank_collectives()
    yield collectives
    collectives.close()


@attrs.define
class Setup:
    runner: StepRunner
    config: Zero3CpuOffloadConfig
    store: ParameterStore
    grads: GradientStore
    optimizer: ShardOptimizers
    backup: SpeculationBackup
    reducer: GradientReducer
    modules: dict[str, nn.Module]
    layouts: dict[str, LayerLayout]
    initial: dict[str, torch.Tensor]  # layer -> its master before any update

    def masters(self) -> dict[str, torch.Tensor]:
        return {name: self.store.master(name).clone() for name in NAMES}

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        return {n: {k: v.clone() for k, v in self.optimizer.layer_state(n).items()} for n in NAMES}

    async def send(self, name: str, grad: torch.Tensor) -> PendingGradient:
        """Reduce-scatter ``grad`` (the layer's flat gradient) as a backward does."""
        module = self.modules[name]
        for slot in self.layouts[name].slots:
            param = dict(module.named_parameters())[slot.name]
            param.grad = grad[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        prepared = await self.reducer.prepare(name, module, in_place=False)
        return await self.reducer.start_reduce_scatter(name, module, prepared)

    async def commit(self, name: str, grad: torch.Tensor) -> None:
        """Land ``grad`` at the end of a backward (no early update)."""
        pending = await self.send(name, grad)
        await self.grads.commit_layer(name, await self.reducer.finish(pending))
        self.reducer.forget_pending(name)

    async def step(self, **kwargs: Any) -> list[str] | None:
        """The step as ``optimizer_step`` runs it: apply, then the window's gradients go."""
        updated = await self.runner.apply(LR, **kwargs)
        self.grads.clear()
        return updated

    async def land_early(self, name: str, grad: torch.Tensor) -> None:
        """Land ``grad`` into its layer's early update, as ``GradientLanding`` does."""
        await self.runner.land_and_update(self.reducer, await self.send(name, grad), LR)


def build(comm: Collectives, **config: Any) -> Setup:
    """Two layers on one rank and a step runner over them."""
    cfg = Zero3CpuOffloadConfig(**config)
    torch.manual_seed(0)
    modules: dict[str, nn.Module] = {"a": nn.Linear(4, 3), "b": nn.Linear(3, 2)}
    layouts = build_layouts(modules, Zero3RankMapping(rank=0, world_size=comm.world_size))
    codec = ShardCodec(cfg.compute_copy_compression(), cfg.compute_dtype, block_size=8)
    store = ParameterStore(codec=codec, master_device=CPU, copy_device=CPU)
    initial = {}
    for name, layout in layouts.items():
        initial[name] = layout.flatten(modules[name], dtype=torch.float32)
        store.put_master(name, initial[name].clone())
    timeline = Timeline(rank=0)
    workers = WorkerThreads(threads=2, timeline=timeline)
    streams = CopyStreams(CPU)
    grads = GradientStore(device=CPU, streams=streams, workers=workers, timeline=timeline)
    optimizer = ShardOptimizers(cfg.optimizer, [(n, store.master(n)) for n in NAMES], device=CPU)
    backup = SpeculationBackup(optimizer)
    runner = StepRunner(
        config=cfg,
        params=store,
        grads=grads,
        optimizer=optimizer,
        workers=workers,
        comm=comm,
        backup=backup,
    )
    largest = max(layout.padded_numel for layout in layouts.values())
    reducer = GradientReducer(
        layouts=layouts,
        comm=comm,
        buffers=GradientBuffers(numel=largest, device=CPU),
        timeline=timeline,
    )
    return Setup(runner, cfg, store, grads, optimizer, backup, reducer, modules, layouts, initial)


def gradient(name: str, micro_step: int, scale: float = 1.0) -> torch.Tensor:
    """A layer's flat gradient for one micro-step (the same in every setup)."""
    numel = {"a": 15, "b": 8}[name]
    g = torch.Generator().manual_seed(1000 * micro_step + ord(name))
    return torch.randn(numel, generator=g) * scale


def kernel(s: Setup) -> dict[str, bool]:
    """The kernel choice ``s``'s optimizers made (bitwise comparisons need the same one)."""
    return {"fused": True} if s.optimizer.fused else {"foreach": True}


def adamw(s: Setup) -> Callable[[torch.Tensor], torch.optim.Optimizer]:
    cfg = s.config.optimizer
    hyper = {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    return lambda p: torch.optim.AdamW([p], lr=LR, **hyper, **kernel(s))


def reference(
    s: Setup,
    grads: list[dict[str, torch.Tensor]],
    *,
    clip: float = 0.0,
    make: Callable[[torch.Tensor], torch.optim.Optimizer] | None = None,
) -> dict[str, torch.Tensor]:
    """The masters after one step of ``make``'s optimizer (AdamW by default) per window in
    ``grads`` (each the summed gradient of the window's micro-steps), averaged and
    clipped as the runner does."""
    k = s.config.gradient_accumulation_steps
    params = {n: s.initial[n].clone() for n in NAMES}
    opts = {n: (make or adamw(s))(params[n]) for n in NAMES}
    for window in grads:
        averaged = {n: g.clone().mul_(1.0 / k) if k > 1 else g.clone() for n, g in window.items()}
        if clip > 0:
            norm = torch.zeros(1, dtype=torch.float64)
            for n in sorted(averaged):
                norm += torch.linalg.vector_norm(averaged[n], dtype=torch.float64).square()
            coef = clip / (float(norm.sqrt().item()) + 1e-6)
            if coef < 1.0:
                for g in averaged.values():
                    g.mul_(coef)
        for n, g in averaged.items():
            params[n].grad = g
            opts[n].step()
    return params


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rule: str):
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"rule: {rule} ({name} differs)"


# ------------------------------------------------------------------ updates in the step


async def test_a_step_updates_each_layer_with_its_window_mean_and_refreshes_its_copy(
    comm: Collectives,
) -> None:
    # SGD: its update shows the gradient's scale (Adam's is nearly blind to it).
    sgd = OptimizerConfig(kind="sgd")
    s = build(comm, gradient_accumulation_steps=2, cpu_compression="bf16", optimizer=sgd)
    for micro in range(2):
        for name in NAMES:
            await s.commit(name, gradient(name, micro))
    updated = await s.step()
    assert updated == ["a", "b"], "rule: apply returns the layers updated in the window"
    summed = {n: gradient(n, 0).add_(gradient(n, 1)) for n in NAMES}
    expected = reference(s, [summed], make=lambda p: torch.optim.SGD([p], lr=LR, **kernel(s)))
    assert_bitwise(s.masters(), expected, "an update uses the mean gradient of the window")
    for name in NAMES:
        copy = s.store.compute_copy(name).payload
        assert torch.equal(copy, s.store.master(name).to(torch.bfloat16)), (
            "rule: an update re-encodes the layer's compute copy from the new master"
        )
    assert s.runner.stepped == set(), "rule: the window's progress is cleared after the step"


async def test_a_layer_without_a_gradient_is_not_updated(comm: Collectives) -> None:
    s = build(comm)
    await s.commit("a", gradient("a", 0))
    assert await s.step() == ["a"], "rule: only layers with a gradient are updated"
    assert torch.equal(s.store.master("b"), s.initial["b"]), (
        "rule: a layer that got no gradient is skipped, as torch.optim skips grad=None"
    )
    assert s.optimizer.layer_state("b") == {}, "rule: a skipped layer gets no optimizer state"


async def test_ready_is_called_once_the_first_layers_hold_the_step_values(
    comm: Collectives,
) -> None:
    s = build(comm)
    for name in NAMES:
        await s.commit(name, gradient(name, 0))
    expected = reference(s, [{n: gradient(n, 0) for n in NAMES}])
    seen: list[tuple[list[str], bool]] = []

    def ready(first: list[str]) -> None:
        seen.append((first, torch.equal(s.store.master("b"), expected["b"])))

    await s.step(first=["b"], ready=ready)
    assert seen == [(["b"], True)], (
        "rule: ready is called with the first layers once they hold this step's values"
    )


# ------------------------------------------------------------------ early updates


@pytest.mark.parametrize(
    ("config", "calls_since_update", "names", "early"),
    [
        ({}, 0, NAMES, True),
        ({"overlap_computation": False}, 0, NAMES, False),
        ({"gradient_accumulation_steps": 2}, 0, NAMES, False),  # not the window's last
        ({"gradient_accumulation_steps": 2}, 1, NAMES, True),
        ({"gradient_clipping": 1.0}, 0, NAMES, False),  # needs every gradient first
        ({"gradient_clipping": 1.0, "speculative_step": True}, 0, NAMES, True),
        ({"compute_dtype": "fp16"}, 0, NAMES, False),  # the inf check needs them all
        ({"compute_dtype": "fp16", "speculative_step": True}, 0, NAMES, True),
        ({}, 0, ("a", "b", "a"), False),  # a layer used twice
    ],
)
def test_a_backward_updates_early_only_when_its_gradients_are_final_and_need_no_check(
    comm: Collectives, config: dict, calls_since_update: int, names: tuple, early: bool
) -> None:
    s = build(comm, **config)
    assert s.runner.can_start_early(names, calls_since_update) is early, (
        "rule: early updates need overlap, the window's last micro-step, no repeated layer, "
        "and no clipping or fp16 check unless speculative"
    )


async def test_an_early_update_drops_its_shard_and_the_step_does_not_update_it_again(
    comm: Collectives,
) -> None:
    s = build(comm)
    for name in NAMES:
        await s.land_early(name, gradient(name, 0))
        assert s.grads.get(name) is None, "rule: an early update drops its gradient shard"
    expected = reference(s, [{n: gradient(n, 0) for n in NAMES}])
    assert_bitwise(s.masters(), expected, "an early update is the step's update")
    assert s.runner.stepped == set(NAMES), "rule: early updates are remembered for the window"
    assert await s.step() == ["a", "b"], "rule: early updates count as the window's"
    assert_bitwise(s.masters(), expected, "a layer updated early is not updated again")


# ------------------------------------------------------------------ speculative updates


async def test_speculative_updates_stand_when_clipping_does_not_apply(comm: Collectives) -> None:
    s = build(comm, gradient_clipping=1e6, speculative_step=True)
    for name in NAMES:
        await s.land_early(name, gradient(name, 0))
    assert s.backup.saved() == ["a", "b"], "rule: a speculative update saves its layer first"
    assert all(s.grads.get(n) is not None for n in NAMES), (
        "rule: a speculative update keeps its shard for the validation"
    )
    await s.step()
    assert s.runner.rollbacks == 0, "rule: no rollback when clip_grad_norm_ would change nothing"
    expected = reference(s, [{n: gradient(n, 0) for n in NAMES}])
    assert_bitwise(s.masters(), expected, "speculative updates that stand are the step's")
    assert s.backup.saved() == [], "rule: after the step no save is left pending"
    flat = torch.cat([gradient(n, 0) for n in NAMES]).double()
    assert s.runner.last_grad_norm == pytest.approx(float(flat.norm()), rel=1e-12), (
        "rule: the global norm before clipping is recorded"
    )


async def test_a_rollback_restores_master_and_state_bitwise_and_the_step_is_redone_clipped(
    comm: Collectives,
) -> None:
    spec = build(comm, gradient_clipping=0.5, speculative_step=True)
    plain = build(comm, gradient_clipping=0.5)
    windows = []
    for step in range(3):  # the later steps roll back layers that hold optimizer state
        window = {n: gradient(n, step) for n in NAMES}
        windows.append(window)
        for name in NAMES:
            await spec.land_early(name, window[name])
            await plain.commit(name, window[name])
        await spec.step()
        await plain.step()
        assert spec.runner.rollbacks == step + 1, "rule: clipping that applies rolls back"
        assert_bitwise(spec.masters(), plain.masters(), "a rolled-back step is the plain step")
        for name in NAMES:
            got, want = spec.states()[name], plain.states()[name]
            assert got.keys() == want.keys(), "rule: a rollback restores the state's keys"
            assert_bitwise(got, want, f"a rollback restores {name}'s optimizer state bitwise")
    assert_bitwise(spec.masters(), reference(plain, windows, clip=0.5), "clipped as torch clips")


async def test_an_inf_under_fp16_rolls_the_speculative_updates_back_and_skips_the_step(
    comm: Collectives,
) -> None:
    s = build(comm, compute_dtype="fp16", speculative_step=True)
    scale = s.runner.loss_scaler.scale  # type: ignore[union-attr]  # fp16 has one
    await s.land_early("a", gradient("a", 0, scale))
    assert not torch.equal(s.store.master("a"), s.initial["a"]), (
        "setup: the speculative update changed the master"
    )  # updated speculatively
    bad = gradient("b", 0, scale)
    bad[3] = float("inf")
    await s.commit("b", bad)
    called: list[list[str]] = []
    assert await s.step(first=["a"], ready=called.append) is None, (
        "rule: an inf/nan gradient skips the step"
    )
    assert_bitwise(s.masters(), s.initial, "a rollback restores the master bitwise")
    assert s.optimizer.layer_state("a") == {}, (
        "rule: a layer without state before the update gets none back"
    )
    assert torch.equal(s.store.compute_copy("a").payload, s.initial["a"].half()), (
        "rule: a rollback re-encodes the compute copy from the restored master"
    )
    assert s.runner.rollbacks == 1 and called == [], "rule: a skipped step calls no ready"
    scaler = s.runner.loss_scaler
    assert scaler is not None and scaler.scale == scale / 2 and scaler.skipped_steps == 1, (
        "rule: an overflow halves the loss scale"
    )


async def test_the_backup_holds_an_adamw_layers_master_and_moments_once_it_has_state(
    comm: Collectives,
) -> None:
    s = build(comm, gradient_clipping=1e6, speculative_step=True)
    sizes = []
    for step in range(3):
        for name in NAMES:
            await s.land_early(name, gradient(name, step))
        await s.step()
        sizes.append(s.backup.nbytes())
    shards = sum(s.layouts[n].shard_numel * 4 for n in NAMES)
    assert sizes[0] == shards, "rule: a layer without state saves its master only"
    steps = sum(s.optimizer.layer_state(n)["step"].nbytes for n in NAMES)
    assert sizes[1] == sizes[2] == 3 * shards + steps, (
        "rule: AdamW's backup is the master, exp_avg and exp_avg_sq (and the step), held"
    )


async def test_reset_forgets_the_window_the_loss_scale_and_the_backup(comm: Collectives) -> None:
    s = build(comm, compute_dtype="fp16", speculative_step=True)
    scaler = s.runner.loss_scaler
    assert scaler is not None, "setup: fp16 compute has a loss scaler"
    await s.land_early("a", gradient("a", 0, scaler.scale))
    await s.commit("b", torch.full((8,), float("nan")))
    await s.step()
    assert s.runner.loss_scaler is not None and s.runner.loss_scaler.skipped_steps == 1, (
        "rule: the skipped step is counted"
    )
    s.runner.reset()
    assert s.runner.loss_scaler is not None and s.runner.loss_scaler.scale == 2.0**16, (
        "rule: reset starts the loss scale again"
    )
    assert s.backup.nbytes() == 0 and s.backup.saved() == [], "rule: reset frees the backup"
    assert s.runner.stepped == set(), "rule: reset forgets the window's updates"


@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_updates_follow_torch_optim_for_each_kind(comm: Collectives, kind: str) -> None:
    extra = {"momentum": 0.9} if kind == "sgd" else {"weight_decay": 0.1}
    s = build(comm, optimizer=OptimizerConfig(kind=kind, **extra))
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.Adam
    windows = [{n: gradient(n, step) for n in NAMES} for step in range(2)]
    for window in windows:
        for name in NAMES:
            await s.commit(name, window[name])
        await s.step()
    expected = reference(s, windows, make=lambda p: cls([p], lr=LR, **extra, **kernel(s)))
    assert_bitwise(s.masters(), expected, f"a {kind} update is torch.optim's, bitwise")
