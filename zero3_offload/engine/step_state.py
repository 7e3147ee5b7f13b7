"""Where training stands between the manager's calls: the pending forward and the window."""

from __future__ import annotations

import attrs

from zero3_offload.execution.forward_record import ForwardRecord
from zero3_offload.execution.module_runner import UnitPass

__all__ = ["StepState"]


@attrs.define
class StepState:
    """The manager's state between calls; :meth:`reset` forgets all of it at once."""

    record: ForwardRecord | None = None
    """What the last training forward keeps for its backward (None: no backward may run)."""
    unit_forward: UnitPass | None = None
    """Module mode: the last training forward's pass, which its backward goes through."""
    calls_since_update: int = 0
    """``optimizer_step`` calls since the last update (micro-steps of the open window)."""
    early_lr: float | None = None
    """Learning rate of the updates the last backward started (None: none started)."""
    window_started: float | None = None
    """``time.perf_counter()`` at the first forward of the open accumulation window."""

    def reset(self) -> None:
        """Forget the pending forward, the window's progress and any early update."""
        self.record = None
        self.unit_forward = None
        self.calls_since_update = 0
        self.early_lr = None
        self.window_started = None
