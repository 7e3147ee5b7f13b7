"""Where training stands between the manager's calls: the pending forward and early updates.

The other parts of where a run stands have owners of their own: the step counts
(``stats.step_counter.StepCounter``: closed steps, updates, the open window's
calls) and the window's start (``stats.pass_clock.PassClock``).
"""

from __future__ import annotations

import attrs

from zero3_offload.execution.pass_result import PassResult

__all__ = ["StepState"]


@attrs.define
class StepState:
    """The manager's state between calls; :meth:`reset` forgets all of it at once."""

    forward: PassResult | None = None
    """The last training forward, which its backward goes through (None: no backward may
    run). Either mode: the chain's saved steps, or module mode's units and saved bytes."""
    early_lr: float | None = None
    """Learning rate of the updates the last backward started (None: none started)."""
    forwards: int = 0
    """Training forwards made pending so far (which one is pending, in the words every
    rank compares after a failed call: see [Note: abandoned calls])."""

    def pend(self, result: PassResult | None) -> None:
        """Make ``result`` the pending forward (None: an evaluation forward, none pends)."""
        self.forward = result
        if result is not None:
            self.forwards += 1

    def drop_forward(self) -> None:
        """Forget the pending forward (no backward may run until the next forward)."""
        self.forward = None

    def reset(self) -> None:
        """Forget the pending forward and any early update."""
        self.forward = None
        self.early_lr = None
