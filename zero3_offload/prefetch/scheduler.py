"""Look-ahead gathers under a hard device-memory budget.

[Note: deterministic prefetch]
Every rank must launch the same collectives in the same order, so no prefetch
decision may depend on timing (which gather finished first, how long a layer
took). Decisions use only what every rank shares: the layer order of the
pass, the trace of earlier passes, layer sizes, the budget, the depth and the
persistence set. A gather is launched synchronously at a layer boundary (in
:meth:`PrefetchScheduler.acquire`), never from a background task; only the
waiting is asynchronous. Depth changes from ``adapt`` or memory pressure come
from values all-reduced across ranks first. *Depth* is the one word for the
look-ahead: the config's ``prefetch_buffer_size`` is the configured depth
(``max_depth``), which memory pressure may lower and ``adapt`` sets (``depth``).

Budget: the bytes of gathered plus in-flight parameter buffers never exceed
``gpu_param_memory_budget``. A prefetch that would not fit is not launched
(it is counted as queued and retried at the next boundary); a layer needed now
evicts cached layers, then persistent ones, then unused in-flight prefetches.
Construction guarantees any single layer fits.

[Note: kept for backward]
A training forward followed by its backward would gather every layer twice.
With ``keep_gathered_for_backward`` the scheduler keeps the tail of the
forward gathered until the backward has run it (the backward starts there):
at the start of a training forward it plans the longest prefix of the
predicted backward order whose bytes, next to room for the forward's own
working set (the ``prefetch_buffer_size + 1`` largest other layers and the
resident unit), fit ``gpu_param_memory_budget``. On the CPU device the kept
bytes are also at most what the gather pool may hold (``(prefetch_buffer_size
+ 2)`` largest layers): there the gathered buffers are process memory, and
within that limit the kept layers take the place of pooled buffers instead of
adding to the step's peak (and to page faults of fresh buffers every step).
``keep_gathered_bytes`` replaces that limit on any device when set (a peak
memory goal below what keeping the pool's bytes costs).
The plan uses only the order, the sizes, the depth, the budget and the limit,
so every rank keeps the same layers. A kept layer is released right after its
backward; one the budget needs back (a larger working set than planned) is
evicted like any cached layer and gathered again, with the same results. Each
gather's bytes are counted (``gathered_bytes`` in the prefetch metrics).

Trace: the layer order of each pass kind (forward, backward) is remembered;
the next pass's first layers are prefetched from it (the backward of the
forward just run, the forward after an optimizer step). A pass whose order
differs from the trace is logged (``prefetch_order_changed``) when it ends, the
trace is rebuilt, and prefetches made for another order are awaited and released
unused (counted as wasted) when a pass starts. Results are the same either way:
a layer is always gathered before it runs.

A pass is one :meth:`PrefetchScheduler.begin_pass` (its kind and the order
expected: the whole order in chain mode, the trace's prediction in module mode),
then for each use of a layer :meth:`~PrefetchScheduler.acquire` and
:meth:`~PrefetchScheduler.finish`, then :meth:`~PrefetchScheduler.end_pass` with
the order that ran. The pass's :class:`Phase` labels the gathers and releases it
makes in the timeline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from zero3_offload.errors import MemoryBudgetError, Zero3Error
from zero3_offload.logging import get_logger
from zero3_offload.parameter.gatherer import ParameterGatherer
from zero3_offload.prefetch.status import PrefetchMetrics, PrefetchQueueStatus
from zero3_offload.prefetch.trace import PassTrace
from zero3_offload.stats.phase import Phase

__all__ = ["PrefetchScheduler", "choose_kept", "choose_persistent"]

log = get_logger(__name__)


def choose_persistent(
    sizes: Mapping[str, int], numels: Mapping[str, int], threshold: int, budget: int
) -> set[str]:
    """Layers below ``threshold`` elements that may stay gathered, smallest first,
    while they and the largest other layer still fit in ``budget`` bytes."""
    chosen: set[str] = set()
    held = 0
    for name in sorted((n for n in sizes if 0 < numels[n] < threshold), key=sizes.__getitem__):
        largest_other = max((sizes[n] for n in sizes if n not in chosen | {name}), default=0)
        if held + sizes[name] + largest_other > budget:
            break
        chosen.add(name)
        held += sizes[name]
    return chosen


def choose_kept(
    backward: Sequence[str],
    forward: Sequence[str],
    sizes: Mapping[str, int],
    *,
    budget: int,
    depth: int,
    resident: str | None,
    limit: int | None = None,
) -> set[str]:
    """The layers a forward keeps gathered for its backward. See [Note: kept for backward].

    The longest prefix of the ``backward`` order, among the ``forward``'s layers
    (never ``resident``), whose bytes fit ``budget`` next to the ``depth + 1``
    largest other layers of the forward and ``resident``, and total at most
    ``limit`` bytes (None: no limit but the budget).
    """
    candidates = [n for n in dict.fromkeys(backward) if n in set(forward) and n != resident]
    held = sizes[resident] if resident is not None and resident in sizes else 0
    kept: set[str] = set()
    kept_bytes = 0
    for name in candidates:
        others = sorted((sizes[n] for n in forward if n not in kept | {name}), reverse=True)
        room = sum(others[: depth + 1])
        over_limit = limit is not None and kept_bytes + sizes[name] > limit
        if over_limit or held + sizes[name] + room > budget:
            break
        kept.add(name)
        held += sizes[name]
        kept_bytes += sizes[name]
    return kept


class PrefetchScheduler:
    """Gathers layers before they are needed, within a byte budget.

    See [Note: deterministic prefetch].

    Args:
        gatherer: launches and completes gathers.
        layers: the layer names.
        numels: elements of each layer.
        budget: ``gpu_param_memory_budget`` in bytes.
        depth: layers gathered ahead (``prefetch_buffer_size``; 0 turns prefetch off).
        bucket: most bytes in flight ahead of use (``prefetch_bucket_size``; 0: no cap).
        persistence_threshold: layers with fewer elements stay gathered.
        rank: this rank (for logs).
        resident: a layer held during every pass next to the others (module
            mode's root unit), or None.
        keep_for_backward: keep a training forward's tail gathered for its
            backward (see [Note: kept for backward]).
        keep_limit: most bytes kept for a backward (None: the budget decides).
        read_ahead: layers beyond the gather window whose compute copies are read
            from disk ahead (see [Note: compute copies on disk]; 0 when the copies
            are in memory).

    Raises:
        MemoryBudgetError: when a single layer (next to ``resident``) is larger
            than the budget.
    """

    def __init__(
        self,
        *,
        gatherer: ParameterGatherer,
        layers: Sequence[str],
        numels: Mapping[str, int],
        budget: int,
        depth: int,
        bucket: int,
        persistence_threshold: int,
        rank: int,
        resident: str | None = None,
        keep_for_backward: bool = False,
        keep_limit: int | None = None,
        read_ahead: int = 0,
    ) -> None:
        self.rank = rank
        self.resident = resident
        self.keep_for_backward = keep_for_backward
        self.keep_limit = keep_limit
        # Layers the current training forward keeps gathered for its backward.
        self.kept: set[str] = set()
        self._gatherer = gatherer
        self._sizes = {name: gatherer.nbytes(name) for name in layers}
        others = {n: b for n, b in self._sizes.items() if n != resident}
        largest = max(others, key=others.__getitem__, default=None)
        held = self._sizes[resident] if resident is not None else 0
        if largest is not None and held + others[largest] > budget:
            beside = f" next to {resident!r} ({held} bytes)" if resident is not None else ""
            raise MemoryBudgetError(
                f"layer {largest!r} needs {others[largest]} bytes gathered{beside}, more "
                f"than gpu_param_memory_budget={budget}: raise the budget to at least "
                f"{held + others[largest]} or split the layer"
            )
        self.budget = budget
        self.max_depth = depth
        self.depth = depth
        self.bucket = bucket
        self.persistent = choose_persistent(self._sizes, numels, persistence_threshold, budget)
        # False while memory pressure suspends persistence and keeping (see suspend()).
        self.persistence_enabled = True
        self.metrics = PrefetchMetrics()
        self._trace = PassTrace()
        self._queued = 0
        self._read_ahead = read_ahead
        # The phase of the pass in progress: labels its gathers and releases.
        self._phase = Phase.FORWARD
        # Layers acquired and not finished yet (module mode holds several at
        # once, e.g. the root unit around a decoder layer): never evicted.
        self._in_use: set[str] = set()

    # ------------------------------------------------------------ helpers

    def _fits(self, name: str) -> bool:
        return self._gatherer.reserved_bytes() + self._sizes[name] <= self.budget

    def _keeps(self, name: str) -> bool:
        return self.persistence_enabled and name in self.persistent

    def _launch(self, name: str) -> None:
        self._gatherer.launch(name, self._phase)
        self.metrics.gathered_bytes += self._sizes[name]

    def _launch_window(self, order: Sequence[str], start: int) -> None:
        if self._read_ahead:
            ahead = order[start : start + self.depth + self._read_ahead]
            gatherer = self._gatherer
            gatherer.read_ahead(
                (n for n in ahead if not (gatherer.is_gathered(n) or gatherer.is_inflight(n))),
                self._phase,
            )
        self._queued = 0
        window = order[start : start + self.depth]
        for k, name in enumerate(window):
            if self._gatherer.is_gathered(name) or self._gatherer.is_inflight(name):
                continue
            over_bucket = (
                self.bucket > 0
                and self._gatherer.inflight_bytes() + self._sizes[name] > self.bucket
            )
            if over_bucket or not self._fits(name):
                self._queued = len(window) - k  # waits for budget; retried at the next boundary
                return
            self._launch(name)
            self.metrics.requests += 1

    async def _discard(self, names: Iterable[str], *, counter: str) -> None:
        for name in list(names):
            if self._gatherer.is_inflight(name):
                await self._gatherer.complete(name, self._phase)
                setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)
            self._release(name)

    async def _make_room(self, name: str, order: Sequence[str], i: int) -> None:
        # Evict, in this order, until ``name`` fits: cached layers not needed
        # soon, persistent ones not needed soon, prefetches in flight, anything.
        soon = set(order[i + 1 : i + 1 + self.depth]) | self._in_use
        gathered = self._gatherer.gathered_layers()
        cached = [n for n in gathered if n not in soon and not self._keeps(n)]
        persistent = [n for n in gathered if n not in soon and self._keeps(n)]
        for candidate in [*cached, *persistent]:
            if self._fits(name):
                return
            self._release(candidate)
        for handle in self._gatherer.inflight():
            if self._fits(name):
                return
            await self._discard([handle.layer], counter="cancelled")
        for candidate in self._gatherer.gathered_layers():
            if self._fits(name):
                return
            if candidate not in self._in_use:
                self._release(candidate)
        if not self._fits(name):
            raise MemoryBudgetError(
                f"layer {name!r} ({self._sizes[name]} bytes) does not fit "
                f"gpu_param_memory_budget={self.budget} next to the layers in use "
                f"{sorted(self._in_use - {name})}: raise the budget"
            )

    def _release(self, name: str, *, keep_grads: bool = False, pool: bool = True) -> None:
        self._gatherer.release(name, self._phase, keep_grads=keep_grads, pool=pool)

    # ------------------------------------------------------------ passes

    async def _drop_stale(self, order: Sequence[str], *, also: set[str] | None = None) -> None:
        soon = set(order[: 1 + self.depth]) | (also or set())
        stale = [h.layer for h in self._gatherer.inflight() if h.layer not in soon]
        await self._discard(stale, counter="wasted")
        for name in self._gatherer.gathered_layers():
            if name not in soon and not self._keeps(name):
                self._release(name)

    async def begin_pass(self, phase: Phase, order: Sequence[str]) -> None:
        """Start a pass of kind ``phase`` expected to run over ``order``.

        Prefetches made for another start are dropped. A training forward plans
        which of its layers stay gathered for the backward (see [Note: kept for
        backward]); a backward keeps them until each has run.

        Args:
            phase: the kind of pass; it labels the pass's gathers and releases.
            order: the order expected (chain mode: the order; module mode: the
                trace's prediction, :meth:`predicted`, possibly empty).
        """
        self._trace.begin(phase)
        self._phase = phase.work
        order = tuple(order)
        kept = self.kept if phase is Phase.BACKWARD else set()
        await self._drop_stale(order, also=kept)
        self.kept = set()
        backward = self.next_after_forward(order)
        # Memory pressure suspends keeping with persistence (see [Note: memory pressure]).
        keeping = self.keep_for_backward and self.persistence_enabled
        if phase is Phase.FORWARD and keeping and backward:
            # Module mode's backward runs in autograd's order, which the trace knows.
            traced = self._trace.order(Phase.BACKWARD)
            self.kept = choose_kept(
                traced if set(traced) == set(order) else backward,
                order,
                self._sizes,
                budget=self.budget,
                depth=self.depth,
                resident=self.resident,
                limit=self.keep_limit,
            )

    def end_pass(self, phase: Phase, order: Sequence[str]) -> None:
        """The pass of kind ``phase`` ran over ``order``: the trace learns it (a change is
        logged and counted)."""
        order = tuple(order)
        known = self._trace.end(phase, order)
        if known is not None and known != order:
            self.metrics.trace_rebuilds += 1
            log.info(
                "prefetch_order_changed",
                rank=self.rank,
                phase=phase.value,
                old=list(known),
                new=list(order),
            )

    def predicted(self, phase: Phase) -> tuple[str, ...]:
        """The order the last pass of kind ``phase`` ran in (empty before the first)."""
        return self._trace.order(phase)

    def backward_follows_forward(self) -> bool:
        """Whether the calls so far predict a backward after each training forward."""
        return self._trace.backward_follows_forward()

    def is_in_use(self, name: str) -> bool:
        """Whether ``name`` was acquired and not finished yet."""
        return name in self._in_use

    async def acquire(self, order: Sequence[str], i: int) -> nn.Module:
        """Make ``order[i]`` gathered (waiting if needed) and prefetch what follows it."""
        name = order[i]
        self._in_use.add(name)
        if self._gatherer.is_gathered(name):
            self.metrics.hits += 1
        elif self._gatherer.is_inflight(name):
            completed = next(h for h in self._gatherer.inflight() if h.layer == name).is_completed()
            if completed:
                self.metrics.hits += 1
            else:
                self.metrics.partial_hits += 1
        else:
            self.metrics.misses += 1
            await self._make_room(name, order, i)
            self._launch(name)
        self._launch_window(order, i + 1)
        return await self._gatherer.gather(name, self._phase)

    async def regather(self, name: str) -> nn.Module:
        """Gather ``name`` again, in use already, when its buffer was released meanwhile
        (module mode: a unit whose saved weights backward unpacks after its values were
        freed)."""
        return await self._gatherer.gather(name, self._phase)

    def finish(
        self,
        order: Sequence[str],
        i: int,
        *,
        next_order: Sequence[str] = (),
        keep_grads: bool = False,
        pool: bool = True,
    ) -> None:
        """After the use of ``order[i]`` ended: release it unless it persists, is kept for
        the backward, or is needed again soon.

        A layer used outside the pass's order (module mode's root unit, held around
        the others) finishes as a pass of its own: ``order=(root,)``, ``i=0``, and
        ``next_order=(root,)`` when the next pass starts with it.

        Args:
            order: this pass's order.
            i: position of the layer whose use ended.
            next_order: the predicted next pass's order, used at the last layer: its
                first layers stay and its window is launched.
            keep_grads: leave the parameters' ``.grad`` (gradients still being
                accumulated, or their reduce-scatter not launched yet).
            pool: keep the released buffer for the next gather of its size (see
                :meth:`ParameterGatherer.release`).
        """
        name = order[i]
        self._in_use.discard(name)
        upcoming = list(order[i + 1 : i + 1 + self.depth])
        last = i == len(order) - 1
        if last and next_order:
            upcoming = list(next_order[: 1 + self.depth])
        if not (self._keeps(name) or name in upcoming or name in self.kept):
            self._release(name, keep_grads=keep_grads, pool=pool)
        if last and next_order:
            self._launch_window(next_order, 0)

    def next_after_forward(self, order: Sequence[str]) -> tuple[str, ...]:
        """The order predicted to follow a forward over ``order`` (its backward, or none)."""
        return self._trace.next_after_forward(order)

    def forward_window(self) -> tuple[str, ...]:
        """The layers the next forward starts with, as far as the depth looks ahead."""
        return self._trace.order(Phase.FORWARD)[: self.depth]

    def launch_updated(self, names: Iterable[str]) -> list[str]:
        """Gather ``names``, just updated, ahead of the next forward; the launched ones.

        A copy gathered before the update is stale and released first. Called
        at the same point of ``optimizer_step`` on every rank.
        """
        self._phase = Phase.STEP
        launched = []
        for name in names:
            self._release(name)
            if not self._gatherer.is_inflight(name) and self._fits(name):
                self._launch(name)
                self.metrics.requests += 1
                launched.append(name)
        return launched

    async def after_update(self, updated: Iterable[str], *, fresh: Iterable[str] = ()) -> None:
        """Drop gathered copies of ``updated`` layers (stale now); prefetch the next forward.

        ``fresh`` names gathers launched after their layer's update
        (:meth:`launch_updated`): they are current and stay.
        """
        self._phase = Phase.STEP
        fresh = set(fresh)
        stale = [h.layer for h in self._gatherer.inflight() if h.layer not in fresh]
        await self._discard(stale, counter="cancelled")
        for name in updated:
            if name not in fresh:
                self._release(name)
        forward = self._trace.order(Phase.FORWARD)
        if forward:
            self._launch_window(forward, 0)

    async def drain(self) -> None:
        """Await every gather in flight and release it (counted as cancelled)."""
        await self._discard([h.layer for h in self._gatherer.inflight()], counter="cancelled")

    async def release_all(self, *, keep_persistent: bool = True) -> None:
        """Drain, then release every gathered layer (persistent ones too unless kept)."""
        await self.drain()
        self._in_use.clear()
        self.kept = set()
        for name in self._gatherer.gathered_layers():
            if not (keep_persistent and self._keeps(name)):
                self._release(name)

    async def abandon(self) -> None:
        """After a failed call (on any rank: see [Note: failure channel]): drop every
        gather in flight (once a failure is known their waits end at once; a buffer
        whose gather did not complete is dropped, not pooled), release every layer,
        persistent ones too, and forget the trace, so every rank's next decisions
        start from the same state whatever each had done of the call."""
        for handle in self._gatherer.inflight():
            with contextlib.suppress(Zero3Error):
                await self._gatherer.complete(handle.layer, self._phase)
        await self.release_all(keep_persistent=False)
        self._trace = PassTrace()
        self._queued = 0

    # ------------------------------------------------------------ adaptation

    def _set_depth(self, depth: int) -> None:
        self.depth = max(0, min(depth, self.max_depth))

    def suspend(self, depth: int) -> None:
        """Under memory pressure: stop persistence and keeping layers for the backward, and
        lower the depth to ``depth`` (see [Note: memory pressure])."""
        self.persistence_enabled = False
        self._set_depth(depth)

    def resume(self) -> None:
        """Pressure is gone: persistence, keeping and the configured depth again."""
        self.persistence_enabled = True
        self._set_depth(self.max_depth)

    def adapt_prefetch_strategy(self, gather_seconds: float, compute_seconds: float) -> int:
        """Set the depth from per-layer gather and compute times (agreed across ranks).

        Rule: to hide a gather of ``g`` seconds behind layers computing ``c``
        seconds each, about ``ceil(g / c)`` gathers must be in flight, so the
        depth becomes ``clamp(ceil(g / c), 1, prefetch_buffer_size)``; it stays
        0 when prefetch is off. The budget still caps what is actually launched.

        Returns:
            The new depth.
        """
        if self.max_depth == 0 or compute_seconds <= 0:
            return self.depth
        self._set_depth(max(1, math.ceil(gather_seconds / compute_seconds)))
        return self.depth

    def status(self) -> PrefetchQueueStatus:
        return PrefetchQueueStatus(
            queued_requests=self._queued,
            active_operations=len(self._gatherer.inflight()),
            depth=self.depth,
            max_depth=self.max_depth,
            inflight_bytes=self._gatherer.inflight_bytes(),
            gathered_bytes=self._gatherer.gathered_bytes(),
            budget_bytes=self.budget,
            persistent_layers=tuple(sorted(self.persistent)),
            persistence_enabled=self.persistence_enabled,
            kept_layers=tuple(sorted(self.kept)),
        )
