"""The trace: the layer order of each kind of pass, remembered to predict the next pass."""

from __future__ import annotations

from collections.abc import Sequence

from zero3_offload.stats.phase import Phase

__all__ = ["PassTrace"]


class PassTrace:
    """The last layer order of each pass kind, and whether a backward follows a forward.

    Pass kinds are the :class:`Phase` of a pass: a training forward, an inference
    forward (under ``torch.no_grad()``, kept apart so that evaluation does not
    disturb the training prediction), generation and backward. Every rank observes
    the same calls, so every rank predicts the same next pass (see
    [Note: deterministic prefetch]).

    A pass is observed in two parts: :meth:`begin` when it starts (the sequence of
    pass kinds predicts whether a backward follows each training forward) and
    :meth:`end` when it ran (its order, which in module mode is only known then).
    """

    def __init__(self) -> None:
        self._orders: dict[Phase, tuple[str, ...]] = {}
        # Predicted from the call history: two training forwards in a row mean the
        # caller does not run backward after each forward.
        self._backward_follows_forward = True
        self._last: Phase | None = None

    def begin(self, phase: Phase) -> None:
        """A pass of kind ``phase`` starts."""
        if phase is Phase.FORWARD and self._last is Phase.FORWARD:
            self._backward_follows_forward = False
        elif phase is Phase.BACKWARD:
            self._backward_follows_forward = True
        self._last = phase

    def end(self, phase: Phase, order: Sequence[str]) -> tuple[str, ...] | None:
        """A pass of kind ``phase`` ran over ``order``; returns the order known before."""
        known = self._orders.get(phase)
        self._orders[phase] = tuple(order)
        return known

    def order(self, phase: Phase) -> tuple[str, ...]:
        """The last order of a pass of kind ``phase`` (empty before the first)."""
        return self._orders.get(phase, ())

    def backward_follows_forward(self) -> bool:
        """Whether the calls so far predict a backward after each training forward."""
        return self._backward_follows_forward

    def next_after_forward(self, order: Sequence[str]) -> tuple[str, ...]:
        """The order predicted to follow a forward over ``order``: its backward, or none."""
        return tuple(reversed(order)) if self._backward_follows_forward else ()
