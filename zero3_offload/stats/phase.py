"""The phase of a pass, and of each interval of work recorded in the timeline."""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(str, enum.Enum):
    """What a pass is, or what an interval of work belongs to.

    The value is the word logged with each event (``phase`` in the JSON logs). The
    three kinds of forward are told apart by the prefetch trace, so that evaluation
    does not disturb the prediction of a training forward's backward; their work is
    logged as ``"forward"`` (:attr:`work`).
    """

    FORWARD = "forward"  # a training forward: autograd on, what backward needs is saved
    INFERENCE = "inference"  # a forward under torch.no_grad() (evaluation): nothing saved
    GENERATE = "generate"  # model.generate's forwards: units stay gathered between calls
    BACKWARD = "backward"  # a backward pass: gradients computed and reduce-scattered
    STEP = "step"  # optimizer_step: updates, compute-copy refreshes, checkpoints
    ROLLBACK = "rollback"  # speculative updates undone (see [Note: speculative update])

    @property
    def work(self) -> Phase:
        """The phase this pass's intervals of work are logged under."""
        return Phase.FORWARD if self in (Phase.INFERENCE, Phase.GENERATE) else self

    @property
    def trains(self) -> bool:
        """Whether this is a training forward (it opens the accumulation window)."""
        return self is Phase.FORWARD

    def __str__(self) -> str:
        return self.value
