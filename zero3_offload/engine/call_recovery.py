"""After a public call failed on some rank: every rank abandons it, and the run goes on.

See [Note: failure channel] in ``comm.failure_report`` for how the ranks learn of
a failure and how the group is made usable again; this module orders the parts
of the manager that hold a call's state.

[Note: abandoned calls]
When a call fails on one rank for its own reasons, every rank abandons that
call (the others' calls raise the failing rank's error class, naming it): the
failing rank publishes its report, every rank drops what the call left
(gathers in flight, gathered layers, the prefetch trace, a half-done backward's
gradients: the runners drop these as for any failed pass), the ranks meet
(``Collectives.recover``) and compare where their training states stand: the
closed steps, updates, the window's calls and backwards, its token count, the
layers updated early, and whether an updating ``optimizer_step`` failed after
it began. Equal states on every rank: the next call runs as if the failed one had never
been made, which is exact because a forward commits nothing and a backward
commits its gradients only once every collective of it completed on every
rank. The pending forward stays where every rank has the same one (a call
refused alike on every rank changes nothing) and is dropped on every rank
where some rank's forward completed and another's did not.

Different states (one rank's backward committed while another's failed after
its last collective; an optimizer step that failed halfway; early updates of a
failed backward) cannot be undone: the manager then refuses every later call
at once with a ``StateError`` that says so and how to resume from the last
checkpoint. So does a recovery that failed (a rank silent or gone meanwhile).
"""

from __future__ import annotations

import anyio.to_thread
import attrs

from zero3_offload.comm.collectives import Collectives
from zero3_offload.comm.failure_report import FailureReport, first_line
from zero3_offload.engine.engine import Engine
from zero3_offload.engine.step_state import StepState
from zero3_offload.errors import CommunicationError, RaisedTogether, StateError, Zero3Error
from zero3_offload.gradient.store import GradientStore
from zero3_offload.logging import get_logger
from zero3_offload.optimizer_state.step_runner import StepRunner
from zero3_offload.prefetch.scheduler import PrefetchScheduler
from zero3_offload.sequence.sequence_group import SequenceGroup
from zero3_offload.stats.step_counter import StepCounter

__all__ = ["CallRecovery", "CallStart"]

log = get_logger(__name__)

_RESUME = (
    "restart the ranks and resume from the last checkpoint (load_checkpoint, or "
    "`zero3-offload train --resume`)"
)


@attrs.frozen
class CallStart:
    """Where the run stood as a call began (to tell a step that failed halfway)."""

    name: str
    steps: int
    window_calls: int
    updating: bool  # an optimizer_step that closes the window
    early: int  # layers updated early in the window so far


class CallRecovery:
    """Abandons a failed call on every rank (see [Note: abandoned calls]).

    Args:
        comm: the group's collectives (the failure channel, the meeting, the rebuild).
        prefetch: drops the call's gathers and forgets the trace.
        state: the pending forward and early updates.
        counter: the step counts.
        grads: the window's accumulated gradients.
        steps: the early updates of the window.
        accumulation: ``gradient_accumulation_steps``.
        sequence: the sequence group, whose abandoned collectives are completed too
            (see [Note: sequence group failures] in ``sequence.sequence_group``), or None.
    """

    def __init__(
        self,
        *,
        comm: Collectives,
        prefetch: PrefetchScheduler,
        state: StepState,
        counter: StepCounter,
        grads: GradientStore,
        steps: StepRunner,
        accumulation: int,
        sequence: SequenceGroup | None = None,
    ) -> None:
        self._comm = comm
        self._sequence = sequence
        self._prefetch = prefetch
        self._state = state
        self._counter = counter
        self._grads = grads
        self._steps = steps
        self._accumulation = accumulation
        self.refused: StateError | None = None  # set when the run cannot go on
        self.recovered = 0  # failed calls abandoned by every rank so far

    @classmethod
    def of(cls, engine: Engine, state: StepState) -> CallRecovery:
        """The recovery of ``engine``'s calls, with the manager's ``state``."""
        return cls(
            comm=engine.comm,
            prefetch=engine.prefetch,
            state=state,
            counter=engine.counter,
            grads=engine.grads,
            steps=engine.steps,
            accumulation=engine.config.gradient_accumulation_steps,
            sequence=engine.sequence.group if engine.sequence is not None else None,
        )

    def note(self, name: str) -> CallStart:
        """Where the run stands as call ``name`` begins."""
        counter = self._counter
        return CallStart(
            name=name,
            steps=counter.steps,
            window_calls=counter.window_calls,
            updating=name == "optimizer_step" and counter.window_calls + 1 >= self._accumulation,
            early=len(self._steps.stepped),
        )

    def start(self) -> None:
        """Check that calls may run, and raise a failure another rank published meanwhile
        (the call starting is abandoned with it)."""
        if self.refused is not None:
            raise self.refused
        report = self._comm.known_failure()
        if report is not None:
            raise report.peer_error(self._comm.rank, "its next call as it started")

    async def after_failure(self, exc: Exception, call: str, start: CallStart) -> None:
        """Abandon the failed call on every rank; the caller raises ``exc`` after it.

        A failure of the group itself (a silent rank, a timeout, a divergence) is no
        call's failure: the group stays broken, as before. Nor is a ``RaisedTogether``
        error (e.g. ``NonFiniteError``, after the step it skipped): every rank raises
        it together, with nothing left unmatched, so there is nothing to abandon.
        """
        comm = self._comm
        if comm.heartbeat is None or self.refused is not None:
            return
        report = comm.known_failure()
        if report is None:
            if isinstance(exc, (CommunicationError, RaisedTogether)):
                return
            mine = FailureReport(
                rank=comm.rank, call=call, error=type(exc).__name__, line=first_line(exc)
            )
            report = comm.publish_failure(mine)
        log.warning("call_failed", rank=comm.rank, failure=report.describe(), call=call)
        await self._prefetch.abandon()
        state = self._state_record(start)
        try:
            states = await anyio.to_thread.run_sync(comm.recover, state)
            if self._sequence is not None:
                await anyio.to_thread.run_sync(
                    self._sequence.complete_abandoned, comm.heartbeat, comm.timeout_s
                )
        except Zero3Error as error:
            self.refused = StateError(
                f"after {report.describe()}, the ranks could not abandon the call together "
                f"({error}); no further call can run: {_RESUME}"
            )
            return
        # The pending forward may be one some ranks made and others did not: then none.
        cores = [s.rsplit("; ", 1)[0] for s in states]
        if len(set(states)) != 1:
            self._state.drop_forward()
        if len(set(cores)) != 1:
            parts = "; ".join(f"rank {r}: {s}" for r, s in enumerate(cores))
            self.refused = StateError(
                f"after {report.describe()}, the ranks' training states differ ({parts}): the "
                f"call had changed some of them and cannot be undone; no further call can "
                f"run: {_RESUME}"
            )
            log.error("call_unrecoverable", rank=comm.rank, states=states)
            return
        if "halfway" in cores[0] or "by the failed call" in cores[0]:
            self.refused = StateError(
                f"after {report.describe()}, the parameters may be half updated ({cores[0]}); "
                f"no further call can run: {_RESUME}"
            )
            return
        self.recovered += 1
        log.info("call_abandoned", rank=comm.rank, failure=report.describe(), filled=comm.filled)

    def _state_record(self, start: CallStart) -> str:
        """Where this rank's training state stands, in words every rank compares."""
        counter, grads = self._counter, self._grads
        began = start.updating and (
            counter.window_calls != start.window_calls or counter.steps != start.steps
        )
        words = [
            f"steps {counter.steps}",
            f"updates {counter.updates}",
            f"window calls {counter.window_calls}",
            f"backwards {grads.micro_steps}",
            f"tokens {grads.tokens}",
        ]
        if self._steps.stepped or self._state.early_lr is not None:
            words.append(f"early learning rate {self._state.early_lr}")
        if began:
            words.append("an optimizer step failed halfway")
        if len(self._steps.stepped) != start.early:
            words.append(f"layers updated early by the failed call {sorted(self._steps.stepped)}")
        state = self._state
        pending = "none" if state.forward is None else f"forward {state.forwards}"
        return ", ".join(words) + f"; pending {pending}"
