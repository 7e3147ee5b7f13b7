"""Verifying, before each call's collectives, that every rank is about to run the same ones.

[Note: divergence check]
ZeRO-3 issues a collective per layer, so ranks whose calls differ (rank 0
runs layers ``[a, b, c]``, rank 1 ``[b, c]``; one rank evaluates while the
other trains; one skips a micro-step) pair up collectives that do not belong
together: gloo aborts the process when their sizes differ, NCCL hangs, and
equal sizes silently mix two layers' data. A :class:`DivergenceCheck`
prevents it. Every public call of the manager starts a *segment* and names
it: the call, its arguments that must agree (layer names, learning rate,
paths, keyword names; not tensors, whose values and shapes are each rank's
own), grad mode, step and micro-step. Before the launcher thread starts the
first collective of a segment, it all-gathers a fixed-size record on a gloo
group of its own (on the CPU, whatever the training backend, so it never
waits behind a large collective or a GPU stream): a sequence number, a
16-byte digest of the text and the text's first bytes. The text is that
collective's description (op, bytes, the layer it serves, the call) with the
count and a digest of every collective launched since the previous check.
Equal digests let it start; any difference raises
:class:`~zero3_offload.errors.RankDivergenceError` on every rank, naming the
ranks and what each was about to run, before anything of the segment is
launched. The launcher then refuses every later collective of the group
(the ranks' sequences no longer correspond).

So a call that differs is caught before its first collective, and a
difference inside a call whose arguments agree (a model whose own control
flow differs between ranks in module mode) at the next call's check, unless
a collective of different size failed first. One exchange per call, not per
collective: checking every collective cost about 5 % of a step on the peers
model, this costs about one small round trip per call, on the launcher
thread (docs/robustness.md has the measured cost).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zero3_offload.errors import RankDivergenceError

__all__ = ["DivergenceCheck"]

_RECORD = 512  # bytes per rank: digest, sequence number, text length, text
_HEADER = struct.Struct("<16sQH")
_TEXT = _RECORD - _HEADER.size


class DivergenceCheck:
    """Exchanges a record of each collective before it starts (see [Note: divergence check]).

    Construction is a collective over ``group`` (it creates a gloo group of
    the same ranks). :meth:`verify` runs on the group's launcher thread only.

    Args:
        group: the training group.
        all_gather: the tensor all-gather function (see ``Collectives``).
        timeout_s: timeout of the side group's collectives.
    """

    def __init__(
        self, group: dist.ProcessGroup, *, all_gather: Callable[..., Any], timeout_s: float
    ) -> None:
        self.rank = group.rank()
        self.world_size = group.size()
        self._all_gather = all_gather
        self._side: dist.ProcessGroup | None = _side_group(group, timeout_s)
        self._mine = torch.zeros(_RECORD, dtype=torch.uint8)
        self._all = torch.zeros(_RECORD * self.world_size, dtype=torch.uint8)
        self.checked = 0  # records exchanged so far

    def verify(self, description: str) -> None:
        """Raise :class:`RankDivergenceError` unless every rank passed the same description."""
        if self._side is None:
            raise RankDivergenceError("the divergence check was closed; no collective may start")
        self.checked += 1
        raw = description.encode("utf-8")
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        text = raw[:_TEXT]
        record = _HEADER.pack(digest, self.checked, len(text)) + text
        self._mine.zero_()
        self._mine[: len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        self._all_gather(self._all, self._mine, group=self._side)
        records = self._all.view(self.world_size, _RECORD)
        first = bytes(records[0, : _HEADER.size].tolist())
        if all(
            bytes(records[r, : _HEADER.size].tolist()) == first for r in range(1, self.world_size)
        ):
            return
        raise RankDivergenceError(self._message(records))

    def _message(self, records: torch.Tensor) -> str:
        groups: dict[bytes, tuple[list[int], str, int]] = {}
        for r in range(self.world_size):
            row = bytes(records[r].tolist())
            digest, seq, length = _HEADER.unpack_from(row)
            text = row[_HEADER.size : _HEADER.size + length].decode("utf-8", errors="replace")
            ranks, _, _ = groups.setdefault(digest + struct.pack("<Q", seq), ([], text, seq))
            ranks.append(r)
        parts = []
        for ranks, text, seq in groups.values():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            parts.append(f"{who} (check #{seq}): {text}")
        return (
            "ranks diverged: they were about to run different collectives; "
            + "; ".join(parts)
            + ". Every rank must make the same calls with the same layers, in the same order; "
            "nothing was launched, and this group accepts no further collectives"
        )

    def close(self) -> None:
        """Stop checking (the side group stays, for the next check over these ranks)."""
        self._side = None


# One side group per set of ranks, for the life of the default group: torch names
# a group created with local synchronization after its ranks, so a second one over
# the same ranks would find the first one's addresses in the store.
_SIDE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _side_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    ranks = tuple(dist.get_process_group_ranks(group))
    side = _SIDE_GROUPS.get(ranks)
    if side is not None:
        try:
            dist.get_process_group_ranks(side)
        except (ValueError, RuntimeError, KeyError):  # destroyed with the default group
            side = None
    if side is None:
        side = dist.new_group(
            list(ranks),
            backend="gloo",
            timeout=_dt.timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
        _SIDE_GROUPS[ranks] = side
    return side
