"""Which example sits at each global position, and which positions a micro-batch takes.

[Note: example order]
The training examples are seen in epochs; epoch ``e`` is a permutation of all of
them drawn from ``(seed, e)`` alone. Global position ``p`` (examples consumed since
the start of the run) is example ``perm_e[p % n]`` of epoch ``e = p // n``. A step
takes the next ``G = batch_size * accumulation * world_size`` positions (its
global batch), dealt by one rule: slot ``j`` of the step goes to micro-step
``j // (world_size * batch_size)``, rank ``(j // batch_size) % world_size``, row
``j % batch_size``. So what a step sees depends only on (seed, the position at its
start), and the checkpoint holds that position: a resumed run sees exactly the
examples of the uninterrupted one, and a run at another world size with the same
``world_size * batch_size`` (so the same global batch and micro-step split) sees
the same examples in every micro-step.
"""

from __future__ import annotations

import torch

__all__ = ["ExampleOrder"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby seeds apart


class ExampleOrder:
    """The example order of ``count`` examples under ``seed`` (see [Note: example order]).

    Args:
        count: examples in the training set (>= 1).
        seed: the run's seed.
    """

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed
        self._epoch = -1
        self._perm = torch.arange(0)

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order: a permutation of ``range(count)``."""
        if epoch != self._epoch:
            g = torch.Generator().manual_seed((self.seed * _MIX + epoch * 0x2545F491) % 2**63)
            self._perm, self._epoch = torch.randperm(self.count, generator=g), epoch
        return self._perm

    def example(self, position: int) -> int:
        """The example index at global ``position``."""
        epoch, offset = divmod(position, self.count)
        return int(self.permutation(epoch)[offset])

    @staticmethod
    def micro_batch(
        start: int, *, micro: int, rank: int, world_size: int, batch_size: int
    ) -> range:
        """The global positions of ``rank``'s micro-batch ``micro`` of the step that starts
        at position ``start`` (see the note's dealing rule)."""
        first = start + micro * world_size * batch_size + rank * batch_size
        return range(first, first + batch_size)
