"""Where the run stands in optimizer steps: one owner, saved in and restored from checkpoints."""

from __future__ import annotations

from typing import Any

__all__ = ["StepCounter"]


class StepCounter:
    """The run's step counts. Only its own methods change them.

    Three counts, each with one meaning:

    - :attr:`steps`: steps closed, every updating ``optimizer_step`` (a step skipped
      for inf/nan, by fp16 loss scaling or ``skip_nonfinite_steps``, included).
      Every timeline interval and ``step`` event carries it as ``step``.
    - :attr:`updates`: the closed steps that updated the parameters.
    - :attr:`window_calls`: ``optimizer_step`` calls since the last closed step
      (micro-steps of the open accumulation window).

    :meth:`state_dict` and :meth:`load_state_dict` are what checkpoints save and
    restore; :attr:`calls` (every ``optimizer_step`` call of this process) is not
    saved.
    """

    def __init__(self) -> None:
        self._steps = 0
        self._updates = 0
        self._window_calls = 0
        self._calls = 0

    @property
    def steps(self) -> int:
        """Steps closed (updates and skipped steps)."""
        return self._steps

    @property
    def updates(self) -> int:
        """Closed steps that updated the parameters."""
        return self._updates

    @property
    def window_calls(self) -> int:
        """``optimizer_step`` calls since the last closed step."""
        return self._window_calls

    @property
    def calls(self) -> int:
        """``optimizer_step`` calls of this process."""
        return self._calls

    def count_call(self) -> int:
        """Count one ``optimizer_step`` call; returns the window's calls so far."""
        self._calls += 1
        self._window_calls += 1
        return self._window_calls

    def close_step(self, *, updated: bool) -> None:
        """The window's step is done (``updated``: the parameters changed)."""
        self._steps += 1
        self._updates += updated
        self._window_calls = 0

    def reset_window(self) -> None:
        """Forget the open window's calls (its gradients were dropped)."""
        self._window_calls = 0

    def state_dict(self) -> dict[str, int]:
        """The counts a checkpoint saves (its metadata keys)."""
        return {
            "optimizer_steps": self._updates,
            "timeline_step": self._steps,
            "calls_since_update": self._window_calls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counts a checkpoint saved."""
        self._updates = int(state["optimizer_steps"])
        self._steps = int(state["timeline_step"])
        self._window_calls = int(state["calls_since_update"])
