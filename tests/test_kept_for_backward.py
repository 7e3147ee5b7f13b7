"""Layers kept gathered from a training forward to its backward: fewer gathers, same numbers.

See [Note: kept for backward]. Bytes gathered are the prefetcher's own count
of the buffers it launched; the expected figures are computed here from the
layouts, the order and the budget.
"""

from __future__ import annotations

import pytest
from helpers import TrainSpec, assert_bitwise, make_model, run_named, train

from zero3_offload.prefetch.scheduler import choose_kept

MODEL = {"d": 96, "n_blocks": 4}
STEPS = 3
DEPTH = 2  # prefetch_buffer_size's default


def sizes_of(result: dict) -> dict[str, int]:
    return {name: padded * 4 for name, (_, padded, _) in result["layouts"].items()}


def test_choose_kept_takes_the_longest_tail_that_fits_beside_the_working_set() -> None:
    sizes = {"a": 10, "b": 40, "c": 20, "d": 30}
    forward = ["a", "b", "c", "d"]
    backward = forward[::-1]
    # Room for the depth + 1 largest others: keeping d leaves b, c, a -> 40 + 20 = 60 at depth 1.
    assert choose_kept(backward, forward, sizes, budget=89, depth=1, resident=None) == set()
    assert choose_kept(backward, forward, sizes, budget=90, depth=1, resident=None) == {"d"}
    # Depth 0: d + c = 50 beside b = 40 fits 95; adding b (90) beside a (10) does not.
    assert choose_kept(backward, forward, sizes, budget=95, depth=0, resident=None) == {"d", "c"}
    # Everything kept needs only the whole model.
    assert choose_kept(backward, forward, sizes, budget=100, depth=1, resident=None) == set(forward)
    # At most ``limit`` bytes kept (the gather pool's bytes on the CPU device).
    assert choose_kept(backward, forward, sizes, budget=100, depth=1, resident=None, limit=49) == {
        "d"
    }
    # A resident layer is never kept, and its bytes are always held.
    assert choose_kept(backward, forward, sizes, budget=100, depth=1, resident="d") == set()
    # Only layers of this forward, in the backward's order.
    assert choose_kept(
        ["x", "d", "c"], ["c", "d"], sizes, budget=10**6, depth=1, resident=None
    ) == {
        "c",
        "d",
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    names = make_model(**MODEL).layer_names
    (first,) = run_named(2, {"probe": (train, TrainSpec(steps=1, model=MODEL))}).values()
    sizes = sizes_of(first[0])
    # A budget that keeps some layers but not all: the last three of the forward.
    backward = names[::-1]
    kept_bytes = sum(sizes[n] for n in backward[:3])
    room = sum(sorted((sizes[n] for n in names if n not in backward[:3]), reverse=True)[:3])
    tight = kept_bytes + room
    # A byte limit that holds the last two layers of the forward, not three.
    limited = sizes[backward[0]] + sizes[backward[1]]
    specs = {
        "on": {},
        "off": {"keep_gathered_for_backward": False},
        "tight": {"gpu_param_memory_budget": tight},
        "limited": {"keep_gathered_bytes": limited},
    }
    results = run_named(
        2, {k: (train, TrainSpec(steps=STEPS, model=MODEL, config=c)) for k, c in specs.items()}
    )
    return {"names": names, "sizes": sizes, "tight_budget": tight, "limit": limited, **results}


def gathered_per_step(result: dict, sizes: dict[str, int], names: list[str]) -> float:
    # The last update also prefetches the first layers of a forward that never comes.
    ahead = sum(sizes[n] for n in names[:DEPTH])
    return (result["performance"].prefetch["gathered_bytes"] - ahead) / STEPS


def test_kept_layers_are_not_gathered_again_in_backward(runs: dict) -> None:
    names, sizes = runs["names"], runs["sizes"]
    total = sum(sizes.values())
    backward = names[::-1]
    last = {names[-1]}  # where the backward starts: never released, even without keeping
    pool = (DEPTH + 2) * max(sizes.values())  # the CPU's limit: the gather pool's bytes
    default = choose_kept(
        backward, names, sizes, budget=2 * 2**30, depth=DEPTH, resident=None, limit=pool
    )
    assert 1 < len(default) < len(names)
    for r in runs["on"]:
        assert gathered_per_step(r, sizes, names) == 2 * total - sum(
            sizes[n] for n in default | last
        )
    for r in runs["off"]:
        assert gathered_per_step(r, sizes, names) == 2 * total - sum(sizes[n] for n in last)
    tight = runs["tight_budget"]
    kept = choose_kept(backward, names, sizes, budget=tight, depth=DEPTH, resident=None, limit=pool)
    assert kept and kept != default
    for r in runs["tight"]:
        assert gathered_per_step(r, sizes, names) == 2 * total - sum(sizes[n] for n in kept | last)
        assert r["memory"]["gathered_high_water_bytes"] <= runs["tight_budget"]
    # keep_gathered_bytes replaces the CPU's pool limit: the last two layers are kept.
    limited = choose_kept(
        backward, names, sizes, budget=2 * 2**30, depth=DEPTH, resident=None, limit=runs["limit"]
    )
    assert limited == set(backward[:2]) and len(default) > 2
    for r in runs["limited"]:
        assert gathered_per_step(r, sizes, names) == 2 * total - sum(
            sizes[n] for n in limited | last
        )


def test_keeping_changes_no_number(runs: dict) -> None:
    for other in ("off", "tight", "limited"):
        assert_bitwise(runs["on"][0]["state"], runs[other][0]["state"])
        assert runs["on"][0]["losses"] == runs[other][0]["losses"]
