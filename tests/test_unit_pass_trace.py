"""Unit tests of ``PassTrace``: what it remembers of each pass kind and what it predicts."""

from __future__ import annotations

from zero3_offload.prefetch.trace import PassTrace
from zero3_offload.stats.phase import Phase

ORDER = ("embed", "block0", "block1", "head")


def ran(trace: PassTrace, phase: Phase, order: tuple[str, ...] = ORDER) -> tuple[str, ...] | None:
    """One pass of ``phase`` over ``order``, as the scheduler reports it."""
    trace.begin(phase)
    return trace.end(phase, order)


def test_a_pass_kind_has_no_order_before_its_first_pass() -> None:
    trace = PassTrace()
    for phase in Phase:
        assert trace.order(phase) == (), f"rule: no order is known for {phase} before its pass"
    assert ran(trace, Phase.FORWARD) is None, "rule: end returns None when nothing was known"


def test_end_remembers_the_order_and_returns_the_one_known_before() -> None:
    trace = PassTrace()
    ran(trace, Phase.FORWARD)
    assert trace.order(Phase.FORWARD) == ORDER, "rule: a pass's order is remembered"
    assert ran(trace, Phase.FORWARD, ORDER[:2]) == ORDER, (
        "rule: end returns the order known before, so a change can be told"
    )
    assert trace.order(Phase.FORWARD) == ORDER[:2], "rule: the last order replaces the one before"


def test_each_pass_kind_has_its_own_order() -> None:
    trace = PassTrace()
    ran(trace, Phase.FORWARD)
    ran(trace, Phase.BACKWARD, ORDER[::-1])
    ran(trace, Phase.INFERENCE, ORDER[:3])
    ran(trace, Phase.GENERATE, ORDER[1:])
    assert trace.order(Phase.FORWARD) == ORDER, (
        "rule: evaluation and generation do not disturb the training forward's order"
    )
    assert trace.order(Phase.BACKWARD) == ORDER[::-1], "rule: the backward's order is its own"
    assert trace.order(Phase.INFERENCE) == ORDER[:3], (
        "rule: the inference forward's order is its own"
    )
    assert trace.order(Phase.GENERATE) == ORDER[1:], "rule: generation's order is its own"


def test_the_order_is_kept_as_a_tuple_not_the_callers_list() -> None:
    trace = PassTrace()
    order = list(ORDER)
    trace.begin(Phase.FORWARD)
    trace.end(Phase.FORWARD, order)
    order.append("extra")
    assert trace.order(Phase.FORWARD) == ORDER, "rule: the trace keeps its own copy"


def test_a_backward_is_predicted_after_a_forward_until_two_forwards_run_in_a_row() -> None:
    trace = PassTrace()
    assert trace.backward_follows_forward(), "rule: before any call, a backward is expected"
    assert trace.next_after_forward(ORDER) == ORDER[::-1], (
        "rule: a forward's backward runs its layers in reverse"
    )
    ran(trace, Phase.FORWARD)
    assert trace.backward_follows_forward(), (
        "rule: one training forward still predicts its backward"
    )
    ran(trace, Phase.FORWARD)
    assert not trace.backward_follows_forward(), (
        "rule: two training forwards in a row mean no backward follows each"
    )
    assert trace.next_after_forward(ORDER) == (), "rule: then no backward is predicted"
    ran(trace, Phase.BACKWARD, ORDER[::-1])
    assert trace.backward_follows_forward(), "rule: a backward restores the prediction"
    assert trace.next_after_forward(ORDER) == ORDER[::-1], (
        "rule: after a backward, a forward's backward is its reverse again"
    )


def test_an_evaluation_between_steps_does_not_change_the_prediction() -> None:
    trace = PassTrace()
    for _ in range(2):
        ran(trace, Phase.FORWARD)
        ran(trace, Phase.BACKWARD, ORDER[::-1])
        ran(trace, Phase.INFERENCE)
        ran(trace, Phase.INFERENCE)  # evaluation forwards in a row
    assert trace.backward_follows_forward(), (
        "rule: inference forwards in a row say nothing about the training forward's backward"
    )
    ran(trace, Phase.FORWARD)
    assert trace.backward_follows_forward(), (
        "rule: a training forward after an evaluation is not a second forward in a row"
    )
