"""Schedules as data and the step simulator: golden bubbles and memory, validation, deadlock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from site_agent.pipeline.schedule import (
    SCHEDULES,
    Op,
    gpipe,
    make_schedule,
    one_f_one_b,
    validate_schedule,
)
from site_agent.pipeline.simulate import SimResult, simulate


def F(i: int) -> Op:
    return Op("F", i)


def B(i: int) -> Op:
    return Op("B", i)


# --- schedules ---------------------------------------------------------------------------------


def test_gpipe_ops() -> None:
    assert gpipe(2, 3) == [[F(0), F(1), F(2), B(2), B(1), B(0)]] * 2


def test_one_f_one_b_ops() -> None:
    assert one_f_one_b(3, 4) == [
        [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)],
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)],
    ]
    # Fewer microbatches than warm-up slots: stage 0 does all its forwards first.
    assert one_f_one_b(4, 2)[0] == [F(0), F(1), B(0), B(1)]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    num_stages=st.integers(min_value=1, max_value=8),
    num_microbatches=st.integers(min_value=1, max_value=12),
)
def test_generated_schedules_are_valid(name: str, num_stages: int, num_microbatches: int) -> None:
    schedule = make_schedule(name, num_stages, num_microbatches)
    validate_schedule(schedule, num_stages, num_microbatches)


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ([[F(0), B(0), F(1), B(1)]], "1 stages, expected num_stages=2"),
        ([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(1)]], "stage 1 never runs B0"),
        ([[F(0), B(0), F(1), B(1)], [B(0), F(0), F(1), B(1)]], "B0 comes before F0"),
        ([[F(0), B(0), F(1), B(1)], [F(0), F(0), B(0), F(1), B(1)]], "F0 appears twice"),
        ([[F(0), B(0), F(1), B(1)], [F(0), B(0), F(2), B(2)]], "F2 is outside"),
        ([[F(0), B(0), F(1), B(1)], [F(0), B(0), "F1", B(1)]], "expected an Op"),
    ],
)
def test_validate_schedule_rejects_broken(schedule: list[list[Op]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_schedule(schedule, 2, 2)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kind"):
        Op("X", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="microbatch"):
        Op("F", -1)
    with pytest.raises(ValueError, match="num_stages"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        make_schedule("zb", 2, 2)


# --- simulator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("num_microbatches", [4, 8])
def test_uniform_costs_bubble_and_step_time(
    name: str, num_stages: int, num_microbatches: int
) -> None:
    p, m = num_stages, num_microbatches
    result = simulate(make_schedule(name, p, m), forward_s=1.0, backward_s=2.0, transfer_s=0.0)
    assert result.step_time_s == (m + p - 1) * (1.0 + 2.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.busy_s == (m * 3.0,) * p


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("num_microbatches", [4, 8])
def test_peak_activations(num_stages: int, num_microbatches: int) -> None:
    p, m = num_stages, num_microbatches
    assert simulate(gpipe(p, m), 1.0, 2.0).peak_in_flight == (m,) * p
    assert simulate(one_f_one_b(p, m), 1.0, 2.0).peak_in_flight == tuple(p - s for s in range(p))


def test_golden_timeline_two_stages() -> None:
    result = simulate(
        one_f_one_b(2, 2), forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], transfer_s=0.5
    )
    spans = [[(str(t.op), t.start_s, t.end_s) for t in ops] for ops in result.timeline]
    assert spans == [
        [("F0", 0.0, 1.0), ("F1", 1.0, 2.0), ("B0", 5.0, 7.0), ("B1", 8.0, 10.0)],
        [("F0", 1.5, 2.5), ("B0", 2.5, 4.5), ("F1", 4.5, 5.5), ("B1", 5.5, 7.5)],
    ]
    assert result.step_time_s == 10.0


def test_deadlock_raises() -> None:
    # Each stage's list is valid on its own, but stage 1 waits for F1 before F0, while stage 0 only
    # sends F1 after B0, which needs stage 1 to have run F0.
    schedule = [[F(0), B(0), F(1), B(1)], [F(1), F(0), B(0), B(1)]]
    validate_schedule(schedule, 2, 2)
    with pytest.raises(ValueError, match="deadlock.*stage 0 at B0.*stage 1 at F1"):
        simulate(schedule, 1.0, 2.0)


def test_simulate_rejects_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="never runs B1"):
        simulate([[F(0), B(0), F(1)]], 1.0, 1.0)
    with pytest.raises(ValueError, match="forward_s has 1 entries"):
        simulate(gpipe(2, 2), [1.0], 1.0)
    with pytest.raises(ValueError, match=r"backward_s\[1\]"):
        simulate(gpipe(2, 2), 1.0, [1.0, -1.0])
    with pytest.raises(ValueError, match="transfer_s"):
        simulate(gpipe(2, 2), 1.0, 1.0, transfer_s=-0.1)
    with pytest.raises(ValueError, match="no stages"):
        simulate([], 1.0, 1.0)


def _check_timeline(
    result: SimResult, forward: list[float], backward: list[float], c: float
) -> None:
    """Every dependency and the one-op-at-a-time rule hold in the simulated times."""
    eps = 1e-9
    end = {(t.stage, t.op): t.end_s for ops in result.timeline for t in ops}
    p = len(result.timeline)
    for s, ops in enumerate(result.timeline):
        prev_end = 0.0
        for t in ops:
            assert t.start_s >= prev_end - eps
            prev_end = t.end_s
            duration = forward[s] if t.op.kind == "F" else backward[s]
            assert t.end_s - t.start_s == pytest.approx(duration)
            if t.op.kind == "F" and s > 0:
                assert t.start_s >= end[(s - 1, t.op)] + c - eps
            if t.op.kind == "B" and s < p - 1:
                assert t.start_s >= end[(s + 1, t.op)] + c - eps


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    data=st.data(),
    num_stages=st.integers(min_value=1, max_value=6),
    num_microbatches=st.integers(min_value=1, max_value=10),
    transfer_s=st.floats(min_value=0.0, max_value=3.0, allow_nan=False),
)
def test_simulation_properties(
    name: str, data: st.DataObject, num_stages: int, num_microbatches: int, transfer_s: float
) -> None:
    p, m = num_stages, num_microbatches
    cost = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)
    forward = data.draw(st.lists(cost, min_size=p, max_size=p))
    backward = data.draw(st.lists(cost, min_size=p, max_size=p))
    result = simulate(make_schedule(name, p, m), forward, backward, transfer_s)
    _check_timeline(result, forward, backward, transfer_s)
    # Microbatch 0 must cross every stage forward and back.
    critical = sum(forward) + sum(backward) + 2 * (p - 1) * transfer_s
    assert result.step_time_s >= critical * (1 - 1e-12) - 1e-12
    assert result.step_time_s >= max(result.busy_s) * (1 - 1e-12)
    assert -1e-9 <= result.bubble_fraction <= 1.0
    expected_peak = (m,) * p if name == "gpipe" else tuple(min(p - s, m) for s in range(p))
    assert result.peak_in_flight == expected_peak
