"""Schedules as op lists and the step simulator: validation, a golden timeline, deadlock."""

from __future__ import annotations

import pytest

from site_agent.pipeline.schedule import Op, validate_schedule
from site_agent.pipeline.simulate import simulate


def F(i: int) -> Op:
    return Op("F", i)


def B(i: int) -> Op:
    return Op("B", i)


# The two schedules as op lists, for two stages and two microbatches.
GPIPE_2x2 = [[F(0), F(1), B(1), B(0)]] * 2
ONE_F_ONE_B_2x2 = [[F(0), F(1), B(0), B(1)], [F(0), B(0), F(1), B(1)]]


# --- schedules ---------------------------------------------------------------------------------


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
        validate_schedule([], 0, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        validate_schedule([[]] * 2, 2, 0)


# --- simulator ---------------------------------------------------------------------------------


def test_golden_timeline_two_stages() -> None:
    result = simulate(ONE_F_ONE_B_2x2, forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], transfer_s=0.5)
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
        simulate(GPIPE_2x2, [1.0], 1.0)
    with pytest.raises(ValueError, match=r"backward_s\[1\]"):
        simulate(GPIPE_2x2, 1.0, [1.0, -1.0])
    with pytest.raises(ValueError, match="transfer_s"):
        simulate(GPIPE_2x2, 1.0, 1.0, transfer_s=-0.1)
    with pytest.raises(ValueError, match="no stages"):
        simulate([], 1.0, 1.0)
