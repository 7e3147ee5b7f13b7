"""The non-finite guard: where a skipped step's inf/nan came from, and the limit on skips.

[Note: non-finite guard]
With ``skip_nonfinite_steps`` the step runner decides, before any update of a step is
applied, whether the step's global gradient holds an inf or a nan on any rank (which is
when its global L2 norm is not finite). With clipping on, that is the norm clipping
computes anyway. Without it, each rank checks its shards in the pass that scales them
for the window (torch's ``GradScaler`` kernel, which multiplies and checks at once; a
sum per shard when nothing is scaled, see ``GradientStore.has_nonfinite``), in a worker
thread (the ``inf-check`` interval of the timeline), and one one-element all-reduce
tells every rank. Under fp16 the loss scaler's own inf/nan check decides.

A step found so is skipped on every rank by the path every skip takes (an fp16
overflow, a window without valid tokens): speculative updates are restored bitwise
from their copies, no other layer was updated, the gradients are dropped, and the
step is closed with ``stepped`` false. Parameters, optimizer state and the optimizer's
own step counts are bitwise those of the same run without that step's update; the
manager's ``steps_completed`` counts the skipped step (so a learning-rate schedule
driven by the step index moves on, as under fp16 loss scaling).

Only on a skipped step does the guard look for the origin, with one more collective:
each rank marks the layers whose shard holds an inf/nan, and itself when a loss of the
window was not finite (module mode: ``backward(loss)``; chain mode: the ``grad_output``
of ``backward_pass``, the loss's gradient), kept at each backward as its sum, a
one-element tensor (no device sync; an inf or nan anywhere makes it one); one all-reduce
of ``layers + world`` floats gives every rank the same answer. The ``step_skipped``
warning names the first layer in backward order (the model's order reversed: a
non-finite value enters the backward at one layer and reaches every layer before it) and
the ranks of the non-finite losses. After ``max_consecutive_nonfinite`` skips in a row
(under fp16, skips of windows with a non-finite loss: overflows alone are the scaler's
business) ``optimizer_step`` raises :class:`~zero3_offload.errors.NonFiniteError` on
every rank, once its step is closed. The count of skips is ``get_performance_stats()
.nonfinite_skips``; neither count is saved in checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from zero3_offload.comm.collectives import Collectives
from zero3_offload.errors import NonFiniteError
from zero3_offload.gradient.store import GradientStore

__all__ = ["NonFiniteGuard", "NonFiniteReport"]


@attrs.frozen
class NonFiniteReport:
    """Where a skipped step's inf/nan was, agreed by every rank."""

    layers: tuple[str, ...]  # layers whose gradient held an inf/nan on some rank, backward order
    loss_ranks: tuple[int, ...]  # ranks with a non-finite loss in the window

    @property
    def first_layer(self) -> str | None:
        """The first layer in backward order whose gradient held an inf/nan."""
        return self.layers[0] if self.layers else None

    def describe(self) -> str:
        layer = self.first_layer
        where = f"first in backward order in {layer!r}" if layer else "in no layer's shard"
        losses = (
            f"the loss was not finite on rank(s) {', '.join(map(str, self.loss_ranks))}"
            if self.loss_ranks
            else "every rank's loss was finite"
        )
        return f"inf/nan gradient {where} ({len(self.layers)} layer(s)); {losses}"


class NonFiniteGuard:
    """Locates the inf/nan of a skipped step and counts skips in a row (see [Note:
    non-finite guard]).

    Args:
        layers: the layers (units) in the model's order.
        comm: the group's collectives.
        limit: skips in a row after which :meth:`check` raises.
    """

    def __init__(self, *, layers: Sequence[str], comm: Collectives, limit: int) -> None:
        self._order = list(reversed(layers))  # backward order
        self._comm = comm
        self._limit = limit
        self._losses: list[torch.Tensor] = []  # this window's losses (their sums), lazily
        self.skips = 0  # steps this process skipped for an inf/nan
        self.consecutive = 0  # of them, in a row up to the last closed step
        self.last: NonFiniteReport | None = None  # the last skipped step's report

    def note_loss(self, value: torch.Tensor, tokens: int | None) -> None:
        """Keep a backward's loss (or output gradient) for the report, as its sum: one pass
        without a sync or a mask, inf or nan when any element is.

        A token-weighted backward of 0 valid tokens is left out: its loss is not used
        (see [Note: token-weighted gradients]).
        """
        if tokens != 0:
            self._losses.append(value.detach().sum())

    async def locate(self, grads: GradientStore) -> NonFiniteReport:
        """Every rank's non-finite layers and losses of the window (a collective)."""
        rank, world, n = self._comm.rank, self._comm.world_size, len(self._order)
        flags = torch.zeros(n + world, dtype=torch.float32)
        for i, name in enumerate(self._order):
            shard = grads.get(name)
            if shard is not None and grads.has_nonfinite([name]):
                flags[i] = 1.0
        if not all(bool(torch.isfinite(total)) for total in self._losses):
            flags[n + rank] = 1.0
        agreed = flags.to(self._comm.device)
        await self._comm.all_reduce_sum(agreed, what="where the inf/nan gradient came from")
        marked = agreed.cpu() > 0
        return NonFiniteReport(
            layers=tuple(name for i, name in enumerate(self._order) if marked[i]),
            loss_ranks=tuple(r for r in range(world) if marked[n + r]),
        )

    def close_step(self, report: NonFiniteReport | None, *, updated: bool, counts: bool) -> None:
        """The window's step closed: ``report`` when it was skipped for an inf/nan
        (``counts``: towards the limit), ``updated`` when the parameters changed."""
        self._losses.clear()
        if report is not None:
            self.skips += 1
            self.last = report
            self.consecutive += counts
        elif updated:
            self.consecutive = 0

    def check(self) -> None:
        """Raise once ``limit`` steps in a row were skipped.

        Raises:
            NonFiniteError: naming the last skipped step's layer and ranks.
        """
        if self.consecutive < self._limit:
            return
        assert self.last is not None
        raise NonFiniteError(
            f"{self.consecutive} optimizer steps in a row were skipped for an inf/nan gradient "
            f"(max_consecutive_nonfinite={self._limit}); the last: {self.last.describe()}. "
            "Parameters and optimizer state are those of the last good step: look at the "
            "data of those steps, lower the learning rate, or resume from a checkpoint"
        )

    def reset(self) -> None:
        """Forget the window's losses and the skips in a row."""
        self._losses.clear()
        self.consecutive = 0
