"""Prefetch under a hard budget: exact results, bounded bytes, hits, order changes."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    OrderSpec,
    assert_bitwise,
    lm_loss,
    make_batches,
    make_model,
    make_torch_optimizer,
    max_abs_diff,
    parameters,
    run_named,
    train_orders,
)

# Every test here reads the runs of one fixture (about 3 s on 2 cores).
pytestmark = pytest.mark.slow

WORLD = 2
FULL = ("embed", "block0", "block1", "ln_f", "head")


def layer_bytes() -> dict[str, int]:
    """Gathered fp32 bytes per layer at 2 ranks (padded to a multiple of 2)."""
    out = {}
    for name, module in make_model().named_children():
        numel = sum(p.numel() for p in module.parameters())
        out[name] = 4 * (numel + (-numel) % WORLD)
    return out


def reference(orders: tuple[tuple[str, ...], ...]) -> dict[str, torch.Tensor]:
    """Plain PyTorch with the same per-step layer orders."""
    model = make_model()
    opt = make_torch_optimizer("adamw", model.parameters())
    for names, (x, y) in zip(orders, make_batches(len(orders), 8), strict=True):
        opt.zero_grad(set_to_none=True)
        h = x
        for name in names:
            h = getattr(model, name)(h)
        lm_loss(h, y).backward()
        opt.step()
    return parameters(model)


def budgets() -> list[int]:
    sizes = layer_bytes()
    return [
        max(sizes.values()),
        2 * max(sizes.values()),
        sum(sizes.values()) // 2,
        sum(sizes.values()),
    ]


BUDGET_IDS = ["one-layer", "two-layers", "half", "whole"]
SKIPPED = tuple(n for n in FULL if n != "block1")
CHANGED_ORDERS = (FULL, FULL, SKIPPED, FULL)


def specs() -> dict[str, OrderSpec]:
    out = {
        # The spine's behaviour: no prefetch, no persistence, ample budget.
        "baseline": OrderSpec(orders=(FULL,) * 4, config={"async_prefetch": False}),
        "hit-rate": OrderSpec(orders=(FULL,) * 4, config={"prefetch_buffer_size": 1}),
        "changed-order": OrderSpec(orders=CHANGED_ORDERS),
        "tools": OrderSpec(
            orders=(FULL,) * 3,
            config={"param_persistence_threshold": 1000, "prefetch_buffer_size": 2},
        ),
    }
    for name, budget in zip(BUDGET_IDS, budgets(), strict=True):
        config = {
            "gpu_param_memory_budget": budget,
            "prefetch_buffer_size": 3,
            "param_persistence_threshold": 1000,  # ln_f and head may persist
        }
        out[name] = OrderSpec(orders=(FULL,) * 4, config=config)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """Every run of this file, one after another in one rank run."""
    calls = {name: (train_orders, spec) for name, spec in specs().items()}
    return run_named(WORLD, calls)


@pytest.mark.parametrize("budget_index", range(4), ids=BUDGET_IDS)
def test_high_water_within_budget_and_results_identical(runs: dict, budget_index: int) -> None:
    budget = budgets()[budget_index]
    results = runs[BUDGET_IDS[budget_index]]
    for r in results:
        assert 0 < r["high_water"] <= budget
    if budget_index == 3:
        assert results[0]["high_water"] > max(layer_bytes().values()), "prefetch never overlapped"
    baseline = runs["baseline"][0]
    assert_bitwise(results[0]["state"], baseline["state"])
    assert max_abs_diff(baseline["state"], reference((FULL,) * 4)) < 1e-4


def test_steady_state_hit_rate_is_full(runs: dict) -> None:
    for r in runs["hit-rate"]:
        first, last = r["per_step"][0], r["per_step"][-1]
        assert first["misses"] >= 1  # the first forward has no trace yet
        steady = {k: last[k] - first[k] for k in ("hits", "partial_hits", "misses")}
        assert steady["misses"] == 0
        assert steady["hits"] + steady["partial_hits"] == 3 * 2 * len(FULL)
        assert last["wasted"] == 0 and last["trace_rebuilds"] == 0


def test_changed_order_rebuilds_trace_with_correct_results(runs: dict) -> None:
    results = runs["changed-order"]
    for r in results:
        assert r["per_step"][-1]["trace_rebuilds"] >= 2  # to the skip and back
        assert r["events"].count("prefetch_order_changed") >= 2
    assert max_abs_diff(results[0]["state"], reference(CHANGED_ORDERS)) < 1e-4


def test_nothing_in_flight_after_close_and_memory_tools(runs: dict) -> None:
    results = runs["tools"]
    for r in results:
        assert r["persistent"] == ["head", "ln_f"]
        # After an optimizer step the next forward's first layers are already in flight.
        assert r["statuses"][-1]["active_operations"] >= 1
        assert r["freed"] > 0
        assert r["after_force"]["gathered_param_bytes"] == 0
        assert r["closed_status"]["active_operations"] == 0
        assert r["closed_status"]["gathered_bytes"] == 0
        assert r["memory_cycles"] == 3  # one pressure check per update
        assert 1 <= r["adapted"] <= 2
    assert results[0]["adapted"] == results[1]["adapted"], "ranks must agree on the depth"
