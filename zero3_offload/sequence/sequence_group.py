"""The collectives of one sequence group, waited for by the library's rules.

[Note: sequence group failures]
The all-to-alls and all-reduces of sequence parallelism run on the model's thread
(and autograd's, in backward), on a process group of the S ranks of a sequence.
Each one is launched asynchronously and waited for as every collective of the
library is ([Note: one wait] in ``comm.wait``): when another rank's call failed
(a model exception, a bad input on that rank only), its failure report ends the
wait at the next look at the heartbeat (every 0.2 s), and this rank raises that
rank's error class naming it, not a timeout; a silent rank is named as usual.

The ranks of a group then stand at different places in the group's sequence of
collectives: the rank that failed launched fewer than its peers, which abandoned
the ones they were waiting for. Every rank logs what it launched (kind, element
count, dtype). When the failed call is abandoned (``engine.call_recovery``), the
ranks meet through the store and a rank that launched fewer than the furthest of
its group launches the same ones on scratch tensors, so that every collective of
the group completes on every rank and the next call's exchanges match again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zero3_offload.comm.catch_up import OutOfReach, catch_up
from zero3_offload.comm.heartbeat import Heartbeat
from zero3_offload.comm.wait import CollectiveWait
from zero3_offload.errors import CommunicationError

__all__ = ["SequenceGroup"]

# Collectives remembered for a recovery: more than a forward and backward of any model
# launch between two calls (two all-to-alls per attention layer each way, a few
# all-reduces), small tuples.
_LOG = 1 << 16


class SequenceGroup:
    """The process group of this rank's sequence (see [Note: sequence group failures]).

    Args:
        group: the S ranks of this rank's sequence (``sequence_group``).
        wait: how a collective is waited for (timeout, heartbeat, failure reports), or
            None for a plain blocking wait (no heartbeat: every wait ends by the
            group's own timeout).
        members: the group's ranks in the world, in group order.
        device: where the scratch tensors of a recovery are made (the group's device).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        wait: CollectiveWait | None,
        members: list[int],
        device: torch.device,
    ) -> None:
        self.group = group
        self.members = members
        self.device = device
        self._wait = wait
        self.launched = 0
        self._log: collections.deque[tuple[str, int, str]] = collections.deque(maxlen=_LOG)

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``all_to_all_single(out, x)`` with equal splits over the group."""
        group = self.group
        self._run(
            "all_to_all", x, lambda: dist.all_to_all_single(out, x, group=group, async_op=True)
        )

    def all_reduce(self, x: torch.Tensor) -> None:
        """A sum of ``x`` over the group, in place."""
        self._run("all_reduce", x, lambda: dist.all_reduce(x, group=self.group, async_op=True))

    def _run(self, kind: str, x: torch.Tensor, launch: Callable[[], Any]) -> None:
        work = launch()
        self.launched += 1
        self._log.append((kind, x.numel(), str(x.dtype).removeprefix("torch.")))
        if self._wait is None:
            work.wait()
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def settle(future: torch.futures.Future) -> None:
            try:
                future.value()
            except Exception as exc:  # handed to the waiting rank below
                done.set_exception(exc)
            else:
                done.set_result(None)

        work.get_future().add_done_callback(settle)
        self._wait.until_done_blocking(done, f"the sequence group's {kind.replace('_', '-')}")

    def complete_abandoned(self, heartbeat: Heartbeat, timeout_s: float) -> int:
        """After a failed call: every rank of the world meets; this rank launches, on
        scratch tensors, the collectives the furthest rank of its group launched and it
        did not. Returns how many it launched.

        Raises:
            CommunicationError: when a rank is silent or does not come, or this rank is
                further behind than the log reaches (the group cannot be completed).
        """
        mine = json.dumps({"launched": self.launched, "log": list(self._log)})
        doing = "complete the sequence groups' collectives"
        met = heartbeat.meet(mine, timeout_s=timeout_s, doing=doing, topic="sequence")
        records = [json.loads(r) for r in met]
        try:
            missing = catch_up([records[r] for r in self.members], self.launched)
        except OutOfReach as gap:
            raise CommunicationError(
                f"this rank is {gap.behind} collectives of its sequence group behind another "
                "after the failed call, more than it can complete; the run cannot continue: "
                "restart the ranks and resume from the last checkpoint"
            ) from None
        for kind, numel, dtype in missing:
            scratch = torch.zeros(int(numel), dtype=getattr(torch, dtype), device=self.device)
            if kind == "all_to_all":
                self.all_to_all(torch.empty_like(scratch), scratch)
            else:
                self.all_reduce(scratch)
        return len(missing)
