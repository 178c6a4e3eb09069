"""The pipeline simulator: torch's executed orders, their timing, and what they reject."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossdc.bench.pipeline_sim import (
    Action,
    executed_order,
    simulate,
    single_stage_order,
    validate_order,
)

pytestmark = pytest.mark.timeout(60)


def uniform(order: dict[int, list[Action]], f: float, b: float) -> dict[tuple[int, str], float]:
    stages = {a.stage for actions in order.values() for a in actions}
    return {(s, k): v for s in stages for k, v in (("F", f), ("B", b), ("I", b / 2), ("W", b / 2))}


def test_single_stage_orders_are_torchs() -> None:
    assert [str(a) for a in single_stage_order("gpipe", 2, 2)[1]] == ["1F0", "1F1", "1B0", "1B1"]
    # 1F1B as torch 2.13 runs it: stage s warms up with min(m, p - s) forwards, then 1B1F.
    assert [str(a) for a in single_stage_order("1f1b", 2, 4)[0]] == [
        "0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3",
    ]  # fmt: skip
    assert [str(a) for a in single_stage_order("1f1b", 2, 4)[1]] == [
        "1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3",
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_uniform_costs_give_the_textbook_bubble(name: str, p: int, m: int) -> None:
    order = single_stage_order(name, p, m)
    result = simulate(order, uniform(order, 1.0, 2.0))
    assert result.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.busy_s == pytest.approx((3.0 * m,) * p)


def test_golden_timeline_with_a_transfer() -> None:
    order = single_stage_order("1f1b", 2, 2)
    result = simulate(order, uniform(order, 1.0, 2.0), transfer_s=0.5)
    spans = [[(str(t.action), t.start_s, t.end_s) for t in ts] for ts in result.timeline]
    assert spans == [
        [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 5.0, 7.0), ("0B1", 8.0, 10.0)],
        [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1F1", 4.5, 5.5), ("1B1", 5.5, 7.5)],
    ]


def test_torch_pipeline_order_strings_are_read() -> None:
    # Two ranks, four stages (interleaved), one micro-batch; idle slots and reductions dropped.
    written = {
        0: ["0F0", "", "2F0", "", "", "", "2B0", "", "0B0", "0REDUCE_GRAD"],
        1: ["", "1F0", "", "3F0", "3B0", "", "", "1B0", ""],
    }
    order = executed_order("interleaved_1f1b", 2, 1, written)
    assert [str(a) for a in order[0]] == ["0F0", "2F0", "2B0", "0B0"]
    result = simulate(order, uniform(order, 1.0, 2.0), transfer_s=0.25)
    assert result.step_time_s == pytest.approx(4 * 1.0 + 4 * 2.0 + 6 * 0.25)
    with pytest.raises(ValueError, match="needs torch's pipeline_order"):
        executed_order("zbv", 2, 1)


def test_zero_bubble_split_backward_and_same_rank_hand_off() -> None:
    # V shape: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (1 -> 2 stays on rank 1).
    order = {
        0: [Action(0, "F", 0), Action(3, "F", 0), Action(3, "I", 0), Action(0, "I", 0),
            Action(3, "W", 0), Action(0, "W", 0)],
        1: [Action(1, "F", 0), Action(2, "F", 0), Action(2, "I", 0), Action(1, "I", 0),
            Action(2, "W", 0), Action(1, "W", 0)],
    }  # fmt: skip
    result = simulate(order, uniform(order, 1.0, 2.0), transfer_s=0.0)
    ends = {str(t.action): t.end_s for ts in result.timeline for t in ts}
    assert ends["1F0"] == 2.0 and ends["2F0"] == 3.0  # same rank: no hand-off delay
    assert ends["0I0"] == ends["1I0"] + 1.0  # input gradient only waits for the neighbour's I
    assert math.isclose(result.step_time_s, max(ends.values()))


@pytest.mark.parametrize(
    ("order", "match"),
    [
        ({0: [Action(0, "B", 0), Action(0, "F", 0)]}, "before its F"),
        ({0: [Action(0, "F", 0), Action(0, "F", 0), Action(0, "B", 0)]}, "twice"),
        ({0: [Action(0, "F", 0)], 1: [Action(0, "B", 0)]}, "runs on ranks 0 and 1"),
        ({0: [Action(1, "F", 0), Action(1, "B", 0)]}, "stages must be 0..0"),
        ({0: [Action(0, "F", 0), Action(0, "I", 0)]}, "exactly once"),
        ({0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "B", 1)]}, "before its F"),
        ({}, "no ranks"),
    ],
)
def test_invalid_orders_are_refused(order: dict[int, list[Action]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_order(order)


def test_deadlock_and_bad_durations_are_refused() -> None:
    f, b = (lambda s, i: Action(s, "F", i)), (lambda s, i: Action(s, "B", i))
    order = {0: [f(0, 0), b(0, 0), f(0, 1), b(0, 1)], 1: [f(1, 1), f(1, 0), b(1, 0), b(1, 1)]}
    with pytest.raises(ValueError, match="rank 0 at 0B0 waits for 1B0/1I0; rank 1 at 1F1 waits"):
        simulate(order, uniform(order, 1.0, 1.0))
    good = single_stage_order("gpipe", 2, 2)
    with pytest.raises(ValueError, match="the duration of 1B0 must be finite"):
        simulate(good, {(0, "F"): 1.0, (0, "B"): 1.0, (1, "F"): 1.0, (1, "B"): -1.0})
    with pytest.raises(ValueError, match="transfer_s"):
        simulate(good, uniform(good, 1.0, 1.0), transfer_s=math.nan)
    with pytest.raises(ValueError, match="kind"):
        Action(0, "X", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a single-stage schedule"):
        single_stage_order("zbv", 2, 2)


def test_each_action_may_have_its_own_duration() -> None:
    order = single_stage_order("gpipe", 2, 2)
    kinds = uniform(order, 1.0, 2.0)
    own = {a: kinds[(a.stage, a.kind)] for actions in order.values() for a in actions}
    assert simulate(order, own) == simulate(order, kinds)
    # Stage 1's last forward, on the critical path, two seconds slower: the step too.
    slower = simulate(order, {**own, Action(1, "F", 1): 3.0})
    assert slower.step_time_s == simulate(order, kinds).step_time_s + 2.0
    # An action's own duration wins over its kind's; one missing both is refused.
    assert simulate(order, {**kinds, Action(1, "F", 1): 3.0}) == slower
    with pytest.raises(ValueError, match="the duration of 1B1 must be finite"):
        simulate(order, {a: d for a, d in own.items() if a != Action(1, "B", 1)})


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b"]),
    p=st.integers(1, 5),
    m=st.integers(1, 8),
    costs=st.lists(st.floats(0.01, 5.0), min_size=10, max_size=10),
    transfer=st.floats(0.0, 2.0),
)
def test_simulated_times_respect_every_dependency(
    name: str, p: int, m: int, costs: list[float], transfer: float
) -> None:
    order = single_stage_order(name, p, m)
    durations = {(s, k): costs[(2 * s + (k == "B")) % 10] for s in range(p) for k in "FB"}
    result = simulate(order, durations, transfer)
    ended = {t.action: t.end_s for ts in result.timeline for t in ts}
    for ts in result.timeline:
        for before, after in zip(ts, ts[1:], strict=False):
            assert after.start_s >= before.end_s - 1e-9  # one action at a time
        for t in ts:
            a = t.action
            assert t.end_s - t.start_s == pytest.approx(durations[(a.stage, a.kind)])
            if a.kind == "F" and a.stage > 0:
                assert t.start_s >= ended[Action(a.stage - 1, "F", a.microbatch)] + transfer - 1e-9
            if a.kind == "B" and a.stage < p - 1:
                assert t.start_s >= ended[Action(a.stage + 1, "B", a.microbatch)] + transfer - 1e-9
    assert 0.0 <= result.bubble_fraction < 1.0
