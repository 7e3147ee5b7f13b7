"""What a rank tells the others when one of its calls failed (see [Note: failure channel]).

[Note: failure channel]
A rank whose public call fails for its own reasons (a model exception, a bad
input, a hook raising, ``MemoryError``, the application's own code reported
with ``abandon_step``) publishes a :class:`FailureReport` (its rank, the call
with the arguments that agree on every rank, the error's class and first
line) under the heartbeat's keys of the current *epoch* in the rendezvous
store: the first report of an epoch wins (a compare-and-set), later ones read
it back. Every rank's beat thread looks for it every ``_FAILURE_POLL_S``
(0.1 s) between its beats, so a rank waiting for a collective of that call
finds it at its next look at the heartbeat (every 0.2 s: [Note: one wait]) and
raises the report's error class naming the failing rank and its error, not a
timeout; a rank between calls raises it as its next call starts.

Every rank then abandons the call (``engine.call_recovery``): nothing of it
stays gathered or in flight, the ranks meet in the store with what each has
launched and where its training state stands, collectives launched on every
rank are completed, and when some rank launched collectives the others never
will, or its launcher is stuck in one, the group is rebuilt over the same
ranks (a fresh gloo or NCCL group, divergence check and shared-memory region;
the abandoned collectives stay with the old group). The epoch then advances,
so the next failure is a new report. Failures of the group itself (a silent
rank, a timeout, a divergence) are not published: they end the run as before.
"""

from __future__ import annotations

import json

import attrs

from zero3_offload import errors
from zero3_offload.errors import Zero3Error

__all__ = ["FailureReport", "first_line"]


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@attrs.frozen
class FailureReport:
    """One rank's failed call, as published for the others."""

    rank: int
    call: str  # the call and the arguments that agree on every rank, the step
    error: str  # the error's class name
    line: str  # the first line of its message

    def encode(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> FailureReport:
        fields = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return cls(
            rank=int(fields["rank"]),
            call=str(fields["call"]),
            error=str(fields["error"]),
            line=str(fields["line"]),
        )

    def error_class(self) -> type[Zero3Error]:
        """The library error class the failing rank raised (``Zero3Error`` for any other)."""
        found = getattr(errors, self.error, None)
        if isinstance(found, type) and issubclass(found, Zero3Error):
            return found
        return Zero3Error

    def describe(self) -> str:
        """The failure in words: rank, call, error."""
        return f"rank {self.rank} failed in {self.call}: {self.error}: {self.line}"

    def peer_error(self, rank: int, doing: str) -> Zero3Error:
        """The error rank ``rank`` raises, while ``doing``, for this report."""
        return self.error_class()(
            f"{self.describe()}; this rank ({rank}) abandoned {doing}, as every rank does: "
            "nothing of the call is kept"
        )
