"""Unit tests of ``PrefetchScheduler``: its rules, one each, against a gatherer that records calls.

See [Note: deterministic prefetch] and [Note: kept for backward] in
``zero3_offload.prefetch.scheduler``. The gatherer here is the one double these unit
tests use: it moves no data, but it keeps real state (what is gathered, what is in
flight, their bytes) and records every call that starts or ends work, so a test
states the exact launches and releases a given order, budget and depth must give.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import pytest
from torch import nn

from zero3_offload.errors import MemoryBudgetError
from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.stats.phase import Phase

FWD, EVAL, BWD, STEP = Phase.FORWARD, Phase.INFERENCE, Phase.BACKWARD, Phase.STEP


@attrs.frozen
class Call:
    """One call the scheduler made to the gatherer."""

    op: str  # launch, gather, complete, release, read_ahead
    layer: str | tuple[str, ...]  # read_ahead: the layers asked for
    phase: Phase
    keep_grads: bool = False
    pool: bool = True
    effect: bool = True  # False: a release of a layer not gathered (the gatherer's no-op)


@attrs.define
class Flight:
    """A gather in flight; ``completed`` once its collective would have finished."""

    layer: str
    completed: bool = False

    def is_completed(self) -> bool:
        return self.completed


class RecordingGatherer:
    """The methods of ``ParameterGatherer`` the scheduler calls, with real bookkeeping and no
    data: a launch puts a layer in flight with its bytes, a completion makes it gathered, a
    release frees it. Every launch, gather, completion, release and read-ahead is recorded
    with its arguments, in order; queries answer from the state and are not recorded.
    """

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.modules = {name: nn.Identity() for name in sizes}
        self.calls: list[Call] = []
        self._gathered: dict[str, None] = {}  # insertion-ordered, like the real gatherer
        self._inflight: dict[str, Flight] = {}
        self.high_water = 0  # most reserved bytes at once

    # what the scheduler asks
    def nbytes(self, name: str) -> int:
        return self.sizes[name]

    def is_gathered(self, name: str) -> bool:
        return name in self._gathered

    def is_inflight(self, name: str) -> bool:
        return name in self._inflight

    def inflight(self) -> list[Flight]:
        return list(self._inflight.values())

    def gathered_layers(self) -> list[str]:
        return list(self._gathered)

    def gathered_bytes(self) -> int:
        return sum(self.sizes[n] for n in self._gathered)

    def inflight_bytes(self) -> int:
        return sum(self.sizes[n] for n in self._inflight)

    def reserved_bytes(self) -> int:
        return self.gathered_bytes() + self.inflight_bytes()

    # what the scheduler does
    def launch(self, name: str, phase: Phase) -> Flight:
        assert name not in self._inflight and name not in self._gathered, f"{name} launched twice"
        self.calls.append(Call("launch", name, phase))
        flight = self._inflight[name] = Flight(name)
        self.high_water = max(self.high_water, self.reserved_bytes())
        return flight

    async def complete(self, name: str, phase: Phase) -> nn.Module:
        self.calls.append(Call("complete", name, phase))
        del self._inflight[name]
        self._gathered[name] = None
        return self.modules[name]

    async def gather(self, name: str, phase: Phase) -> nn.Module:
        self.calls.append(Call("gather", name, phase))
        if name in self._gathered:
            return self.modules[name]
        if name not in self._inflight:
            self.launch(name, phase)
        return await self.complete(name, phase)

    def release(
        self, name: str, phase: Phase, *, keep_grads: bool = False, pool: bool = True
    ) -> None:
        held = self._gathered.pop(name, 0) is None
        self.calls.append(Call("release", name, phase, keep_grads, pool, effect=held))

    def read_ahead(self, names: Iterable[str], phase: Phase) -> None:
        self.calls.append(Call("read_ahead", tuple(names), phase))

    # what a test does
    def settle(self) -> None:
        """Every gather in flight has finished its collective (not yet completed)."""
        for flight in self._inflight.values():
            flight.completed = True

    def trail(self, *ops: str) -> list[tuple[str, str | tuple[str, ...]]]:
        """``(op, layer)`` of the calls with an effect, of ``ops`` only when given."""
        return [(c.op, c.layer) for c in self.calls if c.effect and (not ops or c.op in ops)]

    def clear(self) -> None:
        self.calls.clear()


def scheduler(
    sizes: dict[str, int],
    *,
    budget: int = 10**9,
    depth: int = 2,
    bucket: int = 0,
    numels: dict[str, int] | None = None,
    threshold: int = 0,
    **kwargs: object,
) -> tuple[PrefetchScheduler, RecordingGatherer]:
    gatherer = RecordingGatherer(sizes)
    prefetch = PrefetchScheduler(
        gatherer=gatherer,  # type: ignore[arg-type]  # the recording double
        layers=list(sizes),
        numels=numels or dict.fromkeys(sizes, 1000),
        budget=budget,
        depth=depth,
        bucket=bucket,
        persistence_threshold=threshold,
        rank=0,
        **kwargs,  # type: ignore[arg-type]
    )
    return prefetch, gatherer


async def run_pass(
    prefetch: PrefetchScheduler,
    phase: Phase,
    order: list[str],
    *,
    settle: RecordingGatherer | None = None,
) -> None:
    """One chain-mode pass, with the scheduler's calls ``ChainRunner`` makes (``settle``: its
    gathers in flight finish their collectives before each use)."""
    await prefetch.begin_pass(phase, order)
    next_order = prefetch.next_after_forward(order) if phase.trains else ()
    for i in range(len(order)):
        if settle is not None:
            settle.settle()
        await prefetch.acquire(order, i)
        prefetch.finish(order, i, next_order=next_order, keep_grads=phase is BWD)
    prefetch.end_pass(phase, order)


ABCD = ["a", "b", "c", "d"]
EQUAL = dict.fromkeys(ABCD, 100)


# ------------------------------------------------------------------ the look-ahead window


async def test_each_boundary_launches_the_next_depth_layers_and_a_used_layer_is_released() -> None:
    prefetch, g = scheduler(EQUAL, depth=2)
    await run_pass(prefetch, EVAL, ABCD)
    assert g.trail() == [
        ("launch", "a"),  # a miss: gathered now
        ("launch", "b"),  # the window: the next two layers
        ("launch", "c"),
        ("gather", "a"),
        ("complete", "a"),
        ("release", "a"),
        ("launch", "d"),  # the window moved one layer on
        ("gather", "b"),
        ("complete", "b"),
        ("release", "b"),
        ("gather", "c"),
        ("complete", "c"),
        ("release", "c"),
        ("gather", "d"),
        ("complete", "d"),
        ("release", "d"),
    ], "rule: each boundary launches the next `depth` layers; a layer is released after its use"
    assert {c.phase for c in g.calls} == {FWD}, "rule: an inference pass's work is labelled forward"
    assert prefetch.metrics.requests == 3 and prefetch.metrics.misses == 1, (
        "rule: a window's launches count as requests; only the first layer was a miss"
    )


async def test_depth_zero_gathers_each_layer_only_when_it_is_needed() -> None:
    prefetch, g = scheduler(EQUAL, depth=0)
    await run_pass(prefetch, EVAL, ABCD)
    expected = []
    for name in ABCD:
        expected += [("launch", name), ("gather", name), ("complete", name), ("release", name)]
    assert g.trail() == expected, "rule: prefetch off (depth 0) launches no gather ahead"
    assert prefetch.metrics.requests == 0 and prefetch.metrics.misses == 4, (
        "rule: without prefetch no request is made and every use is a miss"
    )


async def test_a_prefetch_that_does_not_fit_the_budget_is_queued_not_launched() -> None:
    prefetch, g = scheduler(EQUAL, depth=3, budget=250)
    await prefetch.begin_pass(EVAL, ABCD)
    await prefetch.acquire(ABCD, 0)
    assert g.trail("launch") == [("launch", "a"), ("launch", "b")], (
        "rule: a prefetch that would pass the budget (a + b + c = 300 > 250) is not launched"
    )
    assert prefetch.status().queued_requests == 2, "rule: the layers left are counted as queued"
    prefetch.finish(ABCD, 0)
    await prefetch.acquire(ABCD, 1)
    assert g.trail("launch")[2:] == [("launch", "c")], (
        "rule: a queued prefetch is retried at the next boundary, when it fits"
    )
    assert prefetch.status().queued_requests == 1, "rule: the queue is recounted at each boundary"
    assert g.high_water <= 250, "rule: gathered plus in-flight bytes never exceed the budget"


async def test_a_prefetch_over_the_bucket_waits_until_in_flight_bytes_drop() -> None:
    prefetch, g = scheduler(EQUAL, depth=3, bucket=200)
    await prefetch.begin_pass(EVAL, ABCD)
    await prefetch.acquire(ABCD, 0)
    # a is in flight while the window is launched: a + b = 200 fits, + c does not.
    assert g.trail("launch") == [("launch", "a"), ("launch", "b")], (
        "rule: at most `bucket` bytes are in flight ahead of use"
    )
    assert prefetch.status().queued_requests == 2, (
        "rule: the layers over the bucket are counted as queued"
    )


async def test_the_budget_is_never_exceeded_over_passes_of_every_kind() -> None:
    sizes = {"a": 60, "b": 140, "c": 90, "d": 120, "e": 30}
    order = list(sizes)
    for budget in (140, 200, 260, 330):
        prefetch, g = scheduler(sizes, depth=3, budget=budget, keep_for_backward=True)
        for _ in range(2):
            await run_pass(prefetch, FWD, order)
            await run_pass(prefetch, BWD, order[::-1])
            await prefetch.drain()
            fresh = prefetch.launch_updated(prefetch.forward_window())
            await prefetch.after_update(order, fresh=fresh)
            await run_pass(prefetch, EVAL, order[::2])
        assert g.high_water <= budget, (
            f"rule: gathered plus in-flight bytes stay within the budget: {g.high_water} > {budget}"
        )
        assert prefetch.status().inflight_bytes + prefetch.status().gathered_bytes <= budget, (
            "rule: the status's bytes stay within the budget"
        )


async def test_the_read_ahead_names_the_layers_past_the_window_not_gathered_or_in_flight() -> None:
    sizes = dict.fromkeys("abcdef", 100)
    order = list(sizes)
    prefetch, g = scheduler(sizes, depth=2, read_ahead=1)
    await prefetch.begin_pass(EVAL, order)
    await prefetch.acquire(order, 0)
    prefetch.finish(order, 0)
    await prefetch.acquire(order, 1)
    asked = [c.layer for c in g.calls if c.op == "read_ahead"]
    # After a: the 2 + 1 layers b, c, d (asked before the window launches b and c).
    # After b: c, d, e, less c, in flight by then.
    assert asked == [("b", "c", "d"), ("d", "e")], (
        "rule: the read-ahead covers depth + read_ahead layers past the boundary, less those "
        "gathered or in flight"
    )


# ------------------------------------------------------------------ eviction


async def test_a_layer_needed_now_evicts_cached_then_persistent_then_in_flight_prefetches() -> None:
    # p persists (numel below the threshold); x needs everything but p's 10 bytes.
    sizes = {"p": 10, "a": 100, "b": 100, "c": 100, "x": 300}
    numels = {"p": 2, "a": 25, "b": 25, "c": 25, "x": 75}
    prefetch, g = scheduler(sizes, depth=2, budget=310, numels=numels, threshold=5)
    assert prefetch.persistent == {"p"}, "setup: p is the one persistent layer"
    predicted = ["p", "a", "b", "a", "c"]  # a is used twice: it stays gathered between
    await prefetch.begin_pass(EVAL, predicted)
    for i in range(3):
        await prefetch.acquire(predicted, i)
        prefetch.finish(predicted, i)
    assert g.gathered_layers() == ["p", "a"] and [f.layer for f in g.inflight()] == ["c"], (
        "setup: a stays gathered (used again soon), c is prefetched"
    )
    g.clear()
    # The pass leaves the prediction (module mode observes its order as it runs): x now.
    observed = ["p", "a", "b", "x"]
    await prefetch.acquire(observed, 3)
    assert g.trail() == [
        ("release", "a"),  # cached and not needed soon: first
        ("release", "p"),  # persistent: next
        ("complete", "c"),  # a prefetch in flight: awaited and released unused
        ("release", "c"),
        ("launch", "x"),
        ("gather", "x"),
        ("complete", "x"),
    ], "rule: a layer needed now evicts cached layers, then persistent ones, then prefetches"
    assert prefetch.metrics.cancelled == 1, "rule: an evicted prefetch counts as cancelled"
    assert g.high_water <= 310, "rule: evicting keeps the bytes within the budget"


async def test_a_layer_in_use_is_never_evicted_and_one_that_cannot_fit_beside_it_raises() -> None:
    prefetch, g = scheduler({"a": 100, "b": 300}, depth=0, budget=310)
    await prefetch.begin_pass(EVAL, ["a"])
    await prefetch.acquire(["a"], 0)  # held: module mode holds units around others
    with pytest.raises(MemoryBudgetError, match=r"'b' \(300 bytes\) does not fit"):
        await prefetch.acquire(["b"], 0)
    assert g.is_gathered("a") and not g.trail("release"), "rule: a layer in use is not evicted"


def test_construction_refuses_a_layer_larger_than_the_budget_beside_the_resident() -> None:
    with pytest.raises(MemoryBudgetError, match=r"layer 'b' needs 300 bytes.*at least 300"):
        scheduler({"a": 100, "b": 300}, budget=299)
    with pytest.raises(MemoryBudgetError, match=r"next to 'r' \(50 bytes\).*at least 350"):
        scheduler({"r": 50, "a": 100, "b": 300}, budget=349, resident="r")
    scheduler({"r": 50, "a": 100, "b": 300}, budget=350, resident="r")  # fits exactly


# ------------------------------------------------------------------ persistence


def test_persistent_layers_are_the_smallest_below_the_threshold_that_fit_beside_the_largest() -> (
    None
):
    sizes = {"p": 10, "q": 20, "r": 30, "big": 100}
    numels = {"p": 2, "q": 5, "r": 7, "big": 25}
    prefetch, _ = scheduler(sizes, budget=130, numels=numels, threshold=8)
    # p + q = 30 beside big (100) fits 130; adding r (60 + 100) does not.
    assert prefetch.persistent == {"p", "q"}, "rule: smallest first, while they and the largest fit"
    prefetch, _ = scheduler(sizes, budget=129, numels=numels, threshold=8)
    assert prefetch.persistent == {"p"}, "rule: the choice stops at the first that does not fit"
    prefetch, _ = scheduler(sizes, budget=130, numels=numels, threshold=5)
    assert prefetch.persistent == {"p"}, "rule: only layers with fewer elements than the threshold"


async def test_a_persistent_layer_stays_gathered_between_passes_and_is_gathered_once() -> None:
    sizes = {"p": 10, "a": 100, "b": 100}
    prefetch, g = scheduler(sizes, depth=1, numels={"p": 2, "a": 25, "b": 25}, threshold=5)
    for _ in range(3):
        await run_pass(prefetch, EVAL, ["p", "a", "b"])
    assert g.trail("launch").count(("launch", "p")) == 1, "rule: a persistent layer persists"
    assert g.gathered_layers() == ["p"], (
        "rule: only the persistent layer stays gathered after a pass"
    )
    await prefetch.release_all()
    assert g.gathered_layers() == ["p"], "rule: release_all keeps persistent layers by default"
    await prefetch.release_all(keep_persistent=False)
    assert g.gathered_layers() == [], "rule: release_all(keep_persistent=False) releases them"


async def test_suspend_stops_persistence_and_lowers_the_depth_and_resume_restores_them() -> None:
    sizes = {"p": 10, "a": 100, "b": 100, "c": 100}
    numels = {"p": 2, "a": 25, "b": 25, "c": 25}
    prefetch, g = scheduler(sizes, depth=2, numels=numels, threshold=5, keep_for_backward=True)
    prefetch.suspend(0)
    status = prefetch.status()
    assert (status.depth, status.max_depth, status.persistence_enabled) == (0, 2, False), (
        "rule: suspend lowers the depth and stops persistence; the configured depth stays"
    )
    order = ["p", "a", "b", "c"]
    await run_pass(prefetch, FWD, order)
    assert prefetch.kept == set(), "rule: memory pressure suspends keeping for the backward"
    assert g.trail("launch") == [("launch", n) for n in order], "rule: depth 0 while suspended"
    released = [layer for _, layer in g.trail("release")]
    assert "p" in released, "rule: a suspended persistent layer is released like the others"
    prefetch.resume()
    status = prefetch.status()
    assert (status.depth, status.persistence_enabled) == (2, True), (
        "rule: resume restores the configured depth and persistence"
    )
    prefetch.suspend(5)
    assert prefetch.depth == 2, "rule: the depth never exceeds the configured depth"


# ------------------------------------------------------------------ kept for backward


async def test_a_forward_keeps_the_planned_tail_and_its_backward_gathers_none_of_it_again() -> None:
    names = list("abcdef")
    prefetch, g = scheduler(dict.fromkeys(names, 100), depth=1, budget=500, keep_for_backward=True)
    await run_pass(prefetch, FWD, names)
    # f, e, d fit beside room for the 2 largest others (300 + 200 <= 500; c would need 600).
    assert prefetch.status().kept_layers == ("d", "e", "f"), (
        "rule: the plan keeps the longest tail that fits"
    )
    assert g.gathered_layers() == ["d", "e", "f"], (
        "rule: kept layers stay gathered after the forward"
    )
    g.clear()
    # d is beyond the backward's first window (f, e): only keeping holds it until its turn.
    await run_pass(prefetch, BWD, names[::-1])
    assert g.trail("launch") == [("launch", "c"), ("launch", "b"), ("launch", "a")], (
        "rule: the backward does not gather a kept layer again"
    )
    assert g.trail("gather", "release")[:6] == [
        ("gather", "f"),
        ("release", "f"),
        ("gather", "e"),
        ("release", "e"),
        ("gather", "d"),
        ("release", "d"),
    ], "rule: a kept layer is released right after its backward"
    assert all(c.keep_grads for c in g.calls if c.op == "release"), (
        "rule: a backward's releases leave the gradients for their reduce-scatter"
    )
    assert prefetch.metrics.gathered_bytes == 900, "rule: each gather's bytes are counted"


async def test_a_forward_not_followed_by_its_backward_keeps_nothing() -> None:
    names = list("abcde")
    prefetch, g = scheduler(dict.fromkeys(names, 100), depth=1, budget=450, keep_for_backward=True)
    await run_pass(prefetch, FWD, names)
    await run_pass(prefetch, FWD, names)
    assert not prefetch.backward_follows_forward(), (
        "rule: two training forwards in a row predict no backward"
    )
    assert prefetch.next_after_forward(names) == (), "rule: then no backward order is predicted"
    await run_pass(prefetch, FWD, names)
    assert prefetch.kept == set(), "rule: two training forwards in a row: nothing is kept"
    assert g.gathered_layers() == [], "rule: without a backward to follow, every layer is released"


async def test_an_evaluation_forward_keeps_nothing_and_drops_what_was_kept() -> None:
    names = list("abcde")
    prefetch, g = scheduler(dict.fromkeys(names, 100), depth=1, budget=450, keep_for_backward=True)
    await run_pass(prefetch, FWD, names)
    assert prefetch.kept == {"d", "e"}, "setup: the forward kept d and e"
    await run_pass(prefetch, EVAL, names)
    assert prefetch.kept == set() and g.gathered_layers() == [], (
        "rule: only a training forward keeps layers, and only for the backward right after it"
    )


# ------------------------------------------------------------------ changed orders


async def test_a_prefetch_for_another_order_is_awaited_and_released_unused_as_wasted() -> None:
    prefetch, g = scheduler(EQUAL, depth=2)
    await run_pass(prefetch, FWD, ABCD)
    # The last layer launched the predicted backward's window: d stays, c is in flight.
    assert g.gathered_layers() == ["d"] and [f.layer for f in g.inflight()] == ["c"], (
        "setup: the forward's end left d gathered and c in flight"
    )
    g.clear()
    await prefetch.begin_pass(EVAL, ["a", "b"])  # an evaluation instead of the backward
    assert g.trail() == [("complete", "c"), ("release", "c"), ("release", "d")], (
        "rule: prefetches made for another start are awaited and released when a pass starts"
    )
    assert prefetch.metrics.wasted == 1, "rule: a prefetch released unused counts as wasted"


async def test_an_order_that_differs_from_the_trace_is_learnt_and_counted() -> None:
    prefetch, _ = scheduler(EQUAL)
    await run_pass(prefetch, EVAL, ABCD)
    await run_pass(prefetch, EVAL, ABCD)
    assert prefetch.metrics.trace_rebuilds == 0, "rule: an unchanged order rebuilds nothing"
    await run_pass(prefetch, EVAL, ["a", "c"])
    assert prefetch.metrics.trace_rebuilds == 1, "rule: a pass whose order changed is counted"
    assert prefetch.predicted(EVAL) == ("a", "c"), "rule: the trace is rebuilt from the new order"
    assert prefetch.predicted(FWD) == (), "rule: each pass kind has its own trace"


async def test_the_last_layer_of_a_training_forward_launches_the_backward_window() -> None:
    prefetch, g = scheduler(EQUAL, depth=2)
    await run_pass(prefetch, FWD, ABCD)
    # The backward (d, c, b, a) starts with d, gathered, and c; b, a come at its boundaries.
    assert g.trail()[-3:] == [("gather", "d"), ("complete", "d"), ("launch", "c")], (
        "rule: the last layer's finish launches the next pass's window"
    )
    assert g.gathered_layers() == ["d"], (
        "rule: the last layer stays gathered when the next pass starts with it"
    )


# ------------------------------------------------------------------ around an update


async def test_updated_layers_are_released_and_gathered_fresh_for_the_next_forward() -> None:
    sizes = {"p": 10, "a": 100, "b": 100, "c": 100}
    numels = {"p": 2, "a": 25, "b": 25, "c": 25}
    order = list(sizes)
    prefetch, g = scheduler(sizes, depth=2, numels=numels, threshold=5)
    await run_pass(prefetch, FWD, order)
    await run_pass(prefetch, BWD, order[::-1])
    assert g.gathered_layers() == ["p"] and not g.inflight(), (
        "setup: after the backward only p is gathered"
    )
    g.clear()
    await prefetch.drain()
    window = prefetch.forward_window()
    assert window == ("p", "a"), "rule: the forward window is the trace's first `depth` layers"
    fresh = prefetch.launch_updated(window)  # ready(first): those layers hold new values
    assert fresh == ["p", "a"], "rule: launch_updated returns the gathers it launched"
    assert g.trail() == [("release", "p"), ("launch", "p"), ("launch", "a")], (
        "rule: a copy gathered before the update is stale: released, then gathered again"
    )
    assert {c.phase for c in g.calls} == {STEP}, (
        "rule: gathers and releases around an update are labelled step"
    )
    g.clear()
    await prefetch.after_update(order, fresh=fresh)
    assert g.trail() == [], "rule: gathers launched after their update stay; nothing else held"
    assert [f.layer for f in g.inflight()] == ["p", "a"], (
        "rule: the fresh gathers stay in flight for the forward"
    )


async def test_after_an_update_gathers_launched_before_it_are_discarded() -> None:
    order = ABCD
    prefetch, g = scheduler(EQUAL, depth=2)
    await run_pass(prefetch, FWD, order)
    assert g.gathered_layers() == ["d"] and [f.layer for f in g.inflight()] == ["c"], (
        "setup: the forward's end left d gathered and c in flight"
    )
    g.clear()
    await prefetch.after_update(order)  # no drain first: this gather read the old shard
    assert g.trail() == [
        ("complete", "c"),
        ("release", "c"),
        ("release", "d"),  # gathered before the update: stale
        ("launch", "a"),  # the next forward's window, from the trace
        ("launch", "b"),
    ], "rule: gathers of the old values are dropped, then the next forward is prefetched"
    assert prefetch.metrics.cancelled == 1, (
        "rule: a gather launched before the update counts as cancelled"
    )


async def test_drain_awaits_and_releases_every_gather_in_flight() -> None:
    prefetch, g = scheduler(EQUAL, depth=3)
    await prefetch.begin_pass(EVAL, ABCD)
    await prefetch.acquire(ABCD, 0)
    g.clear()
    await prefetch.drain()
    assert g.trail() == [
        ("complete", "b"),
        ("release", "b"),
        ("complete", "c"),
        ("release", "c"),
        ("complete", "d"),
        ("release", "d"),
    ], "rule: drain awaits every gather in flight and releases it"
    assert prefetch.metrics.cancelled == 3 and g.gathered_layers() == ["a"], (
        "rule: drained gathers count as cancelled; the layer in use stays gathered"
    )


# ------------------------------------------------------------------ counters and depth


async def test_uses_are_counted_as_hits_partial_hits_or_misses() -> None:
    prefetch, g = scheduler(dict.fromkeys("abc", 100), depth=1)
    order = ["a", "b", "c"]
    await prefetch.begin_pass(EVAL, order)
    await prefetch.acquire(order, 0)  # miss: b launched
    prefetch.finish(order, 0)
    g.settle()  # b's collective finished before it is needed
    await prefetch.acquire(order, 1)  # hit: c launched
    prefetch.finish(order, 1)
    await prefetch.acquire(order, 2)  # partial hit: c still in flight
    m = prefetch.metrics
    assert (m.misses, m.hits, m.partial_hits) == (1, 1, 1), (
        "rule: a use is a miss (not launched), a hit (completed) or a partial hit (in flight)"
    )
    assert m.hit_rate() == pytest.approx(2 / 3), (
        "rule: the hit rate is (hits + partial hits) / uses"
    )


@pytest.mark.parametrize(
    ("gather_s", "compute_s", "max_depth", "depth"),
    [
        (0.3, 0.1, 4, 3),  # ceil(3.0): 3 gathers hide behind 3 layers
        (0.31, 0.1, 4, 4),  # ceil(3.1) = 4
        (0.5, 0.1, 4, 4),  # clamped to the configured depth
        (0.01, 0.1, 4, 1),  # at least 1
        (0.5, 0.1, 0, 0),  # prefetch off stays off
        (0.5, 0.0, 4, 4),  # no compute time: unchanged
    ],
)
def test_adapt_sets_the_depth_to_gather_over_compute_clamped(
    gather_s: float, compute_s: float, max_depth: int, depth: int
) -> None:
    prefetch, _ = scheduler(EQUAL, depth=max_depth)
    assert prefetch.adapt_prefetch_strategy(gather_s, compute_s) == depth, (
        "rule: depth = clamp(ceil(gather / compute), 1, prefetch_buffer_size), 0 stays 0"
    )
    assert prefetch.status().depth == depth, "rule: the status reports the depth set"


# ------------------------------------------------------------------ determinism


async def workload(*, settle: bool) -> tuple[list[Call], dict[str, int]]:
    """Two training steps, an evaluation and a changed order on one scheduler; with
    ``settle`` every gather finishes its collective early (another timing)."""
    sizes = {"p": 10, "a": 120, "b": 80, "c": 100, "d": 60}
    numels = {"p": 2, "a": 30, "b": 20, "c": 25, "d": 15}
    order = list(sizes)
    prefetch, g = scheduler(
        sizes, depth=2, budget=330, numels=numels, threshold=5, keep_for_backward=True
    )
    early = g if settle else None
    for step in range(2):
        await run_pass(prefetch, FWD, order, settle=early)
        await run_pass(prefetch, BWD, order[::-1], settle=early)
        await prefetch.drain()
        fresh = prefetch.launch_updated(prefetch.forward_window())
        await prefetch.after_update(order, fresh=fresh)
        await run_pass(prefetch, EVAL, order[step:], settle=early)
    metrics = prefetch.metrics.as_dict()
    return g.calls, {k: v for k, v in metrics.items() if k not in ("hits", "partial_hits")}


async def test_the_same_calls_give_the_same_gathers_whatever_their_timing() -> None:
    first, counts = await workload(settle=False)
    again, counts_again = await workload(settle=False)
    assert first == again, "rule: the same calls give the same launches and releases"
    settled, counts_settled = await workload(settle=True)
    assert first == settled, (
        "rule: no prefetch decision depends on timing (which gathers finished first)"
    )
    assert counts == counts_again == counts_settled, (
        "rule: the counters do not depend on timing either (hits and partial hits aside)"
    )
