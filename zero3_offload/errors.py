"""Library exceptions.

Every error the library raises derives from :class:`Zero3Error`, so callers can
catch one type. Messages say what was wrong and what to do next.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CollectiveTimeoutError",
    "CommunicationError",
    "ConfigError",
    "DiskTierError",
    "InputError",
    "LayerExecutionError",
    "LayerNotFoundError",
    "MemoryBudgetError",
    "NonFiniteError",
    "RaisedTogether",
    "RankDivergenceError",
    "StateError",
    "StepAbandonedError",
    "UsageError",
    "Zero3Error",
]


class Zero3Error(Exception):
    """Base class of every exception raised by ``zero3_offload``."""


class ConfigError(Zero3Error, ValueError):
    """A configuration field has an invalid value; the message names the field."""


class LayerNotFoundError(Zero3Error, KeyError):
    """A layer name passed to the manager is not one of the model's layers."""

    def __str__(self) -> str:
        # KeyError quotes its argument; show the message as written.
        return str(self.args[0]) if self.args else ""


class CommunicationError(Zero3Error, RuntimeError):
    """A collective failed or did not complete in time, or a rank stopped answering
    (the message names it and what this rank was waiting for)."""


class CollectiveTimeoutError(CommunicationError):
    """A collective (or the rendezvous) did not complete within its timeout while no rank
    was known to be silent or failed; the message names what this rank was waiting for."""


class RankDivergenceError(CommunicationError):
    """The ranks were about to run different collectives (different layers, passes or
    micro-steps); the message names the ranks and what each was about to run."""


class CheckpointError(Zero3Error, RuntimeError):
    """A checkpoint could not be written or read."""


class DiskTierError(Zero3Error, OSError):
    """The disk tier's directory or file could not be created, read or written; the
    message names the path (and, for a full disk, the bytes needed)."""


class MemoryBudgetError(Zero3Error, MemoryError):
    """A memory budget cannot hold what it is asked to hold."""


class StateError(Zero3Error, RuntimeError):
    """A call was made in the wrong order (e.g. backward before forward)."""


class InputError(Zero3Error, ValueError):
    """An argument has the wrong type, shape or content: a pass's input, or a model that
    cannot be partitioned."""


class LayerExecutionError(Zero3Error, RuntimeError):
    """A layer's own code raised during a pass; the cause is chained."""


class StepAbandonedError(Zero3Error):
    """A rank's own code failed between the manager's calls (the loss, a data loader) and
    the rank abandoned the step with ``abandon_step``; the cause is chained there, and the
    other ranks' message names the rank and its error."""


class RaisedTogether:
    """Marks an error that every rank raises together, decided by collectives every rank
    completed, so nothing of the call is left unmatched: a call that fails with one is
    not abandoned (see [Note: abandoned calls] in ``engine.call_recovery``)."""


class NonFiniteError(RaisedTogether, Zero3Error, ArithmeticError):
    """Too many optimizer steps in a row were skipped for an inf or nan gradient
    (``max_consecutive_nonfinite``); the message names the layer and the ranks of the
    last one."""


class UsageError(Zero3Error):
    """A mistake in a command line of ``zero3-offload``: reported in one line, exit status 2."""
