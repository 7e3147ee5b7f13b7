"""The trace: the layer order of each kind of pass, remembered to predict the next pass."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PassTrace"]


class PassTrace:
    """The last layer order of each pass kind, and whether a backward follows a forward.

    Pass kinds are ``"forward"``, ``"backward"`` and ``"inference"`` (a forward
    under ``torch.no_grad()``, kept apart so that evaluation does not disturb
    the training prediction). Every rank observes the same calls, so every rank
    predicts the same next pass (see [Note: deterministic prefetch]).
    """

    def __init__(self) -> None:
        self._orders: dict[str, tuple[str, ...]] = {}
        # Predicted from the call history: two forwards in a row mean the caller
        # does not run backward after each forward.
        self._backward_follows_forward = True
        self._last_phase: str | None = None

    def observe(self, phase: str, order: Sequence[str]) -> tuple[str, ...] | None:
        """Record a pass of kind ``phase`` over ``order``; returns the order known before."""
        if phase == "forward" and self._last_phase == "forward":
            self._backward_follows_forward = False
        elif phase == "backward":
            self._backward_follows_forward = True
        self._last_phase = phase
        known = self._orders.get(phase)
        self._orders[phase] = tuple(order)
        return known

    def order(self, phase: str) -> tuple[str, ...]:
        """The last order of a pass of kind ``phase`` (empty before the first)."""
        return self._orders.get(phase, ())

    def backward_follows_forward(self) -> bool:
        """Whether the calls so far predict a backward after each training forward."""
        return self._backward_follows_forward

    def next_after_forward(self, order: Sequence[str]) -> tuple[str, ...]:
        """The order predicted to follow a forward over ``order``: its backward, or none."""
        return tuple(reversed(order)) if self._backward_follows_forward else ()
