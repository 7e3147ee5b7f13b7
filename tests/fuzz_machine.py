"""The API fuzz: a hypothesis state machine that drives a manager on 2 real ranks.

Each example draws a model and a valid config (``fuzz_strategies.setups``), builds
the manager on every rank of a :class:`~fuzz_server.RankServer`, then runs a random
sequence of public calls (forward in training and under no_grad, backward,
optimizer_step, whole micro-steps, save, load, reset_state, adapt_performance,
force_memory_optimization, full_state_dict, close) with good and bad inputs
(NaN/inf, wrong dtype or device, empty batch, wrong gradient shape, unknown
layers, bad learning rates, calls out of order, missing checkpoints). The
invariants, checked on every call:

- no hang and no dead rank (the server's deadline and process checks);
- every failure is a ``Zero3Error`` with a message, the same on every rank;
- each call succeeds or is refused as the documented rules say
  (``fuzz_expect.ModelState``), and the step state afterwards is the predicted one;
- a refused call changes nothing: the rank's fingerprint of its training state
  (``fuzz_rank.fingerprint``) is equal before and after (a backward that failed
  while running may only drop the pending forward, as documented);
- calls change only what they own: a forward only the pending forward; a save,
  adapt, force and state_dict nothing; a backward without early updates and an
  optimizer_step that returned False no parameter or optimizer state; a load
  gives back exactly the state its save saw; reset_state the optimizer,
  gradient and window state of a new manager, with the parameters kept;

and at the end of the example: a fresh manager on the same ranks, built from the
same setup, replays only the calls that succeeded, and every call's result and
the final fingerprint are bitwise equal to the fuzzed run's. So whatever failed
in between, the successful calls still train to the numbers of a clean run.

``run_fuzz`` runs it with given hypothesis settings: the fast CI profile and the
long one (``-m fuzz_long``) of ``tests/test_fuzz.py`` share it.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import hypothesis
from fuzz_calls import MODELS, X_KINDS, Call, ModelSpec, Outcome, Setup
from fuzz_expect import (
    GRAD_KINDS,
    LAYERS_EMPTY,
    LAYERS_NONE,
    LAYERS_STR,
    LAYERS_UNKNOWN,
    Expect,
    ModelState,
    layer_names_arg,
)
from fuzz_server import RankFailure, RankServer
from fuzz_strategies import GOOD_LRS, learning_rates, setups
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

__all__ = ["ApiFuzz", "FuzzStats", "make_machine", "run_fuzz"]

# Calls whose results must be equal in the replay (adapt's depth and force's freed
# bytes depend on timings and on what happened to be gathered).
_DETERMINISTIC = frozenset({"forward", "backward", "step", "save", "load", "state_dict"})
# Calls that only read the training state, save it, or release gathered copies.
_READ_ONLY = frozenset({"adapt", "force", "state_dict", "save"})
# Errors of a backward that failed while running (it drops the pending forward).
_MIDPASS = frozenset({"LayerExecutionError", "CommunicationError"})
_SAME = "<same>"  # backward through the pending forward's layer names
_SPECIAL_LAYERS = (LAYERS_STR, LAYERS_NONE, LAYERS_EMPTY, LAYERS_UNKNOWN)


@attrs.define
class FuzzStats:
    """What a fuzz run did: counts of examples, steps, calls and refusals, and failures."""

    examples: int = 0
    steps: int = 0  # rules run (a whole micro-step counts once)
    rules: collections.Counter[str] = attrs.Factory(collections.Counter)  # steps by rule
    calls: collections.Counter[str] = attrs.Factory(collections.Counter)  # by op
    refusals: collections.Counter[str] = attrs.Factory(collections.Counter)  # "op: Error"
    reached: collections.Counter[str] = attrs.Factory(collections.Counter)  # deep states
    aborted: int = 0  # examples hypothesis ended early (no failure, no replay)
    replays: int = 0
    replayed_calls: int = 0
    rank_starts: int = 0
    failures: list[str] = attrs.Factory(list)  # first lines, in order (shrinking included)
    wall_s: float = 0.0

    def report(self) -> str:
        lines = [
            f"examples tried: {self.examples}",
            f"steps: {self.steps} "
            + ", ".join(f"{rule} {n}" for rule, n in sorted(self.rules.items())),
            f"calls: {sum(self.calls.values())} "
            + ", ".join(f"{op} {n}" for op, n in sorted(self.calls.items())),
            f"refusals: {sum(self.refusals.values())}",
            *(f"  {key}: {n}" for key, n in sorted(self.refusals.items())),
            "reached: " + ", ".join(f"{k} {n}" for k, n in sorted(self.reached.items())),
            f"replays: {self.replays} ({self.replayed_calls} calls replayed); "
            f"examples ended early by hypothesis: {self.aborted}",
            f"rank starts: {self.rank_starts}",
            f"wall time: {self.wall_s:.1f} s",
        ]
        distinct = len(set(self.failures))
        lines.append(f"failures: {len(self.failures)} ({distinct} distinct; shrinking included)")
        lines += [f"  {f}" for f in dict.fromkeys(self.failures)]
        return "\n".join(lines)


class ApiFuzz(RuleBasedStateMachine):
    """The state machine; bind a server and stats with :func:`make_machine`."""

    server: ClassVar[RankServer]
    stats: ClassVar[FuzzStats]
    collective_timeout_s: ClassVar[float] = 20.0

    def __init__(self) -> None:
        super().__init__()
        self.stats.examples += 1
        self.setup: Setup | None = None
        self.model: ModelState | None = None
        self.spec: ModelSpec | None = None
        self.log: list[Call] = []  # the calls that succeeded, in order
        self.results: list[list[Any]] = []  # their results, per rank
        self.last: list[Outcome] | None = None
        self.opened: list[dict[str, str]] = []  # each rank's fingerprint of the new manager
        self.saved: dict[int, list[dict[str, str]]] = {}  # each rank's fingerprint at a save
        self.broken = False  # a check failed: no replay at teardown
        self.seeds = 0
        self.directory = tempfile.mkdtemp(prefix="zero3-fuzz-")

    # ------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _guard(self, rule: str) -> Iterator[None]:
        self.stats.steps += 1
        self.stats.rules[rule] += 1
        try:
            yield
        except Exception as exc:
            self.broken = True
            first = (str(exc).splitlines() or [""])[0][:200]
            self.stats.failures.append(f"{type(exc).__name__}: {first}")
            raise
        except BaseException:  # hypothesis ending the example (e.g. out of data): no failure
            self.broken = True
            self.stats.aborted += 1
            raise

    def _request(self, kind: str, payload: Any, **kwargs: Any) -> list[Any]:
        starts = self.server.starts
        try:
            return self.server.request(kind, payload, **kwargs)
        finally:
            self.stats.rank_starts += self.server.starts - starts

    def _do(self, call: Call, expect: Expect) -> Outcome:
        """Send ``call`` to every rank and check the per-call invariants."""
        self.stats.calls[call.op] += 1
        outcomes: list[Outcome] = self._request("call", call)
        where = call.describe()
        for rank, o in enumerate(outcomes):
            if not o.ok:
                assert o.zero3, (
                    f"{where}: rank {rank} raised {o.error}, not a Zero3Error: {o.message}\n"
                    f"{o.detail}"
                )
                assert o.message.strip(), f"{where}: rank {rank} raised {o.error} without a message"
        kinds = [(o.ok, o.error) for o in outcomes]
        assert len(set(kinds)) == 1, f"{where}: the ranks disagree: {kinds}"
        first = outcomes[0]
        if expect.succeeds:
            assert first.ok, (
                f"{where} must succeed but raised {first.error}: {first.message}\n{first.detail}"
            )
        else:
            assert not first.ok, f"{where} must raise one of {sorted(expect.errors)}, but ran"
            assert first.error in expect.errors, (
                f"{where} must raise one of {sorted(expect.errors)}, but raised "
                f"{first.error}: {first.message}\n{first.detail}"
            )
        for rank, o in enumerate(outcomes):
            self._check_unchanged(call, o, rank)
        if first.ok:
            self.log.append(call)
            self.results.append([o.result for o in outcomes])
        else:
            self.stats.refusals[f"{call.op}: {first.error}"] += 1
        self.last = outcomes
        return first

    def _check_unchanged(self, call: Call, o: Outcome, rank: int) -> None:
        """What a call may change of the training state, by its outcome."""
        parameters = {k for k in o.after if k.endswith((".master", ".copy", ".optim"))}
        if not o.ok:
            allowed = {"pending"} if call.op == "backward" and o.error in _MIDPASS else set()
            what = f"a refused call ({o.error}: {o.message})"
        elif call.op in _READ_ONLY:
            allowed, what = set(), "a call that only reads, saves or releases"
        elif call.op == "forward":
            allowed, what = {"pending"}, "a forward"
        elif call.op == "backward" and o.after.get("early_lr") == "None":
            allowed, what = set(o.after) - parameters, "a backward without early updates"
        elif call.op == "step" and o.result is False:
            allowed, what = set(o.after) - parameters, "an optimizer_step that did not update"
        else:
            return
        changed = set(o.changed()) - allowed
        assert not changed, (
            f"{call.describe()}: rank {rank}: {what} changed the training state: {sorted(changed)}"
        )

    def _check_counters(self) -> None:
        """The ranks' step state is the one the model predicts."""
        assert self.model is not None and self.last is not None
        want = self.model.counters()
        for rank, o in enumerate(self.last):
            got = {k: o.after.get(k) for k in want}
            assert got == want, f"rank {rank}: step state {got}, expected {want}"
            pending = o.after.get("pending")
            if self.model.pending is None:
                assert pending == "None", f"rank {rank}: a forward is pending: {pending}"
            else:
                assert pending is not None and pending.startswith(f"({self.model.pending!r},"), (
                    f"rank {rank}: pending forward {pending}, expected {self.model.pending}"
                )

    def _layers(self, data: st.DataObject, label: str, *, same: bool = False) -> Any:
        """A layer_names argument: mostly a valid order, sometimes a bad one."""
        assert self.spec is not None
        good = st.sampled_from(self.spec.orders)
        if same:
            good = st.one_of(st.just(_SAME), good)
        every = (*self.spec.orders, *self.spec.bad_orders, *_SPECIAL_LAYERS)
        choice = data.draw(st.one_of(good, st.sampled_from(every)), label=label)
        if choice == _SAME:
            assert self.model is not None
            return self.model.pending or self.spec.orders[0]
        return layer_names_arg(choice, self.spec.layers, self.spec.orders[0])

    def _next_seed(self) -> int:
        self.seeds += 1
        return self.seeds

    # ---------------------------------------------------------------- the calls

    def _forward(self, x: str, layers: Any, training: bool) -> None:
        assert self.model is not None
        call = Call(
            "forward", {"x": x, "layers": layers, "training": training, "seed": self._next_seed()}
        )
        if self._do(call, self.model.forward(x, layers)).ok:
            self.model.did_forward(layers, training)
        self._check_counters()

    def _backward(self, grad: str, layers: Any, lr: Any) -> None:
        assert self.model is not None
        call = Call("backward", {"grad": grad, "layers": layers, "lr": lr})
        if self._do(call, self.model.backward(grad, layers, lr)).ok:
            self.model.did_backward(layers, lr)
            if self.model.early_lr is not None:
                self.stats.reached["early updates"] += 1
        self._check_counters()

    def _step(self, lr: Any) -> None:
        assert self.model is not None and self.setup is not None
        updates = self.model.step_updates()
        o = self._do(Call("step", {"lr": lr}), self.model.step(lr))
        if o.ok:
            assert self.last is not None
            stepped = [r.result for r in self.last]
            assert len(set(stepped)) == 1, f"optimizer_step: the ranks disagree: {stepped}"
            if not updates:
                assert o.result is False, "optimizer_step inside a window must return False"
            elif self.setup.config["compute_dtype"] != "float16":  # fp16 may skip on inf
                assert o.result is True, "optimizer_step closing a window must return True"
            if updates:
                self.stats.reached["updates" if o.result else "skipped updates"] += 1
            self.model.did_step()
        self._check_counters()

    def _plain(self, op: str) -> None:
        """A call without arguments: reset, adapt, force or state_dict."""
        assert self.model is not None
        if self._do(Call(op), self.model.plain()).ok and op == "reset":
            self.model.did_reset()
        self._check_counters()

    # -------------------------------------------------------------------- rules

    @initialize(setup=setups())
    def open(self, setup: Setup) -> None:
        with self._guard("open"):
            self.setup = attrs.evolve(
                setup,
                directory=self.directory,
                config={**setup.config, "collective_timeout_s": self.collective_timeout_s},
            )
            outcomes: list[Outcome] = self._request("open", self.setup)
            for rank, o in enumerate(outcomes):
                assert o.ok, (
                    f"rank {rank}: a valid setup was refused: {o.error}: {o.message}\n{o.detail}"
                )
            self.opened = [o.after for o in outcomes]
            self.model = ModelState.from_config(setup.model, setup.config)
            self.spec = MODELS[setup.model]

    # Hypothesis prefers rules that sort first (by number of arguments, then name):
    # every rule but load takes one argument, and this one's name sorts first, so
    # examples reach deep states (windows, updates, checkpoints of them) often.
    @rule(data=st.data())
    def a_micro_step(self, data: st.DataObject) -> None:
        """A whole valid micro-step: forward, backward (maybe with the lr), optimizer_step
        (or not: the window, and any update started early, stays open for what follows)."""
        with self._guard("a_micro_step"):
            assert self.spec is not None and self.model is not None
            order = data.draw(st.sampled_from(self.spec.orders), label="order")
            lr = data.draw(st.sampled_from(GOOD_LRS), label="lr")
            early = data.draw(st.booleans(), label="lr_in_backward")
            step = data.draw(st.booleans(), label="optimizer_step")
            self._forward("good", order, True)
            self._backward("good", order, lr if early else None)
            if step:
                self._step(lr)

    @rule(data=st.data())
    def forward(self, data: st.DataObject) -> None:
        with self._guard("forward"):
            x = data.draw(st.one_of(st.just("good"), st.sampled_from(X_KINDS)), label="x")
            layers = self._layers(data, "layers")
            training = data.draw(st.sampled_from([True, False]), label="training")
            self._forward(x, layers, training)

    @rule(data=st.data())
    def backward(self, data: st.DataObject) -> None:
        with self._guard("backward"):
            grad = data.draw(st.one_of(st.just("good"), st.sampled_from(GRAD_KINDS)), label="grad")
            layers = self._layers(data, "layers", same=True)
            lr = data.draw(st.one_of(st.none(), learning_rates()), label="lr")
            self._backward(grad, layers, lr)

    @rule(lr=learning_rates())
    def optimizer_step(self, lr: Any) -> None:
        with self._guard("optimizer_step"):
            self._step(lr)

    @rule(index=st.integers(0, 1))
    def save(self, index: int) -> None:
        with self._guard("save"):
            assert self.model is not None
            if self._do(Call("save", {"index": index}), self.model.save()).ok:
                assert self.last is not None
                self.model.did_save(index)
                self.saved[index] = [o.after for o in self.last]
            self._check_counters()

    # Two arguments: it sorts after save, so more loads find a checkpoint to load.
    @rule(missing=st.booleans(), data=st.data())
    def load(self, missing: bool, data: st.DataObject) -> None:
        with self._guard("load"):
            assert self.model is not None
            index = 2  # never saved
            if self.saved and not missing:
                index = data.draw(st.sampled_from(sorted(self.saved)), label="index")
            if self.model.early_lr is not None:
                self.stats.reached["loads after an early update"] += 1
            if self._do(Call("load", {"index": index}), self.model.load(index)).ok:
                self.model.did_load(index)
                self._check_restored(self.saved[index])
                self.stats.reached[
                    "loads" if self.model.micro == 0 else "loads inside a window"
                ] += 1
            self._check_counters()

    def _check_restored(self, saved: list[dict[str, str]]) -> None:
        """A load gives back the state its save saw (but no pending forward; the last
        update's gradient norm is not checkpoint content)."""
        assert self.last is not None
        for rank, (o, want) in enumerate(zip(self.last, saved, strict=True)):
            differ = sorted(
                k
                for k in want.keys() | o.after.keys()
                if k not in ("pending", "last_grad_norm") and want.get(k) != o.after.get(k)
            )
            assert not differ, f"rank {rank}: the loaded state differs from the saved in {differ}"

    def _check_reset(self) -> None:
        """reset_state drops optimizer state, gradients, the window and the loss scale (as
        in a new manager) and keeps the parameters and the step counts."""
        assert self.last is not None
        kept = ("steps_completed", "optimizer_steps")
        dropped = ("micro_steps", "calls_since_update", "early_lr", "stepped", "loss_scaler")
        for rank, (o, new) in enumerate(zip(self.last, self.opened, strict=True)):
            differ = [
                k
                for k in sorted(o.after)
                if ((k.endswith((".master", ".copy")) or k in kept) and o.after[k] != o.before[k])
                or ((k.endswith((".optim", ".grad")) or k in dropped) and o.after[k] != new[k])
            ]
            assert not differ, f"rank {rank}: reset_state left {differ} wrong"

    @rule(data=st.data())
    def other_call(self, data: st.DataObject) -> None:
        """full_state_dict, reset_state, adapt_performance, force_memory_optimization or
        (once 10 calls succeeded, so that examples do not end early) close."""
        with self._guard("other_call"):
            assert self.model is not None
            ops = ["state_dict", "reset", "adapt", "force"]
            op = data.draw(st.sampled_from([*ops, "close"] if len(self.log) >= 10 else ops))
            if op != "close":
                self._plain(op)
                if op == "reset" and self.last is not None and self.last[0].ok:
                    self._check_reset()
                return
            self._do(Call("close"), Expect())  # closing twice is allowed
            self.model.did_close()
            self._check_counters()

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        try:
            if self.setup is not None and not self.broken and self.server.alive:
                with self._guard("teardown"):
                    self._check_replay()
            elif self.server.alive:
                with contextlib.suppress(RankFailure):
                    self.server.request("end", None)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _check_replay(self) -> None:
        """A fresh manager replaying the successful calls ends in the same state, bitwise."""
        answers = self._request(
            "replay", list(self.log), timeout_s=self.server.timeout_s + 5.0 * len(self.log)
        )
        self.stats.replays += 1
        self.stats.replayed_calls += len(self.log)
        for rank, (fuzzed, outcomes, fresh) in enumerate(answers):
            if self.last is not None:
                assert fuzzed == self.last[rank].after, f"rank {rank}: state changed between calls"
            assert len(outcomes) == len(self.log), (
                f"rank {rank}: the fresh manager could not be built: {outcomes[0].message}"
            )
            for i, (call, o) in enumerate(zip(self.log, outcomes, strict=True)):
                where = f"replay of call {i} {call.describe()} on rank {rank}"
                assert o.ok, f"{where}: raised {o.error}: {o.message}\n{o.detail}"
                if call.op in _DETERMINISTIC:
                    assert o.result == self.results[i][rank], (
                        f"{where}: gave {o.result!r} in a fresh run, "
                        f"{self.results[i][rank]!r} in the fuzzed run"
                    )
            differ = sorted(
                k for k in fuzzed.keys() | fresh.keys() if fuzzed.get(k) != fresh.get(k)
            )
            assert not differ, (
                f"rank {rank}: after the same successful calls, a fresh run's state differs from "
                f"the fuzzed run's in {differ}"
            )


def make_machine(server: RankServer, stats: FuzzStats, **attributes: Any) -> type[ApiFuzz]:
    """:class:`ApiFuzz` bound to ``server`` and ``stats`` (and e.g. ``collective_timeout_s``)."""
    return type("ApiFuzz", (ApiFuzz,), {"server": server, "stats": stats, **attributes})


def run_fuzz(
    server: RankServer,
    settings: hypothesis.settings,
    stats: FuzzStats,
    *,
    seed: int | None = None,
) -> None:
    """Run the state machine under ``settings`` (and ``seed``); counts go to ``stats``.

    Raises:
        AssertionError: the minimal failing example's failure (hypothesis prints its steps).
    """
    machine = make_machine(server, stats)
    if seed is not None:
        machine = hypothesis.seed(seed)(machine)
    started = time.perf_counter()
    try:
        run_state_machine_as_test(machine, settings=settings)
    finally:
        stats.wall_s += time.perf_counter() - started
