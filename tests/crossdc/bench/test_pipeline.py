"""``crossdc bench pipeline``: its analysis reads a known timeline back, and a small real run of
every torch schedule executes the order the simulator assumes."""

from __future__ import annotations

import pytest

from crossdc.bench import pipeline as bench
from crossdc.bench.pipeline_sim import SimResult, simulate, single_stage_order


def _record_of(sim: SimResult, schedule: str, m: int) -> dict[str, object]:
    """What the ranks would write had they run exactly as simulated (time origin 100 s)."""
    ranks = [
        {
            "start": 100.0,
            "end": 100.0 + sim.step_time_s,
            "events": [
                (t.action.stage, t.action.kind, t.action.microbatch, 100 + t.start_s, 100 + t.end_s)
                for t in timeline
            ],
        }
        for timeline in sim.timeline
    ]
    return {
        "job": "bytegpt",
        "schedule": schedule,
        "microbatches": m,
        "ranks": len(ranks),
        "traces": [ranks, ranks],
        "pipeline_order": None,
        "units": [],
        "boundaries": [],
        "bottleneck_predicted": 0.0,
        "lower_bound": 0.0,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_analysis_reads_a_simulated_timeline_back(schedule: str) -> None:
    order = single_stage_order(schedule, 3, 5)
    durations = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}
    durations |= {(2, "F"): 0.5, (2, "B"): 1.0}
    sim = simulate(order, durations, transfer_s=0.25)
    figures = bench.analyze(_record_of(sim, schedule, 5))
    assert figures["order_matches"] is True
    assert figures["bubble_measured"] == pytest.approx(sim.bubble_fraction)
    assert figures["bubble_simulated"] == pytest.approx(sim.bubble_fraction)
    # Every action of a kind took the same time: its mean cost is its own.
    assert figures["bubble_from_mean_costs"]["simulated"] == pytest.approx(sim.bubble_fraction)
    assert figures["transfer_s"] == pytest.approx(0.25)
    assert figures["bottleneck_measured"] == pytest.approx(4.0)


@pytest.mark.timeout(600)
def test_every_schedule_runs_the_order_the_simulator_assumes() -> None:
    report = bench.run(
        jobs=("bytegpt",),
        schedules=bench.SCHEDULES,
        ranks=2,
        microbatches=(2,),
        microbatch_size=2,
        warmup_steps=1,
        measure_steps=1,
        profile_steps=1,
    )
    runs = report["runs"]
    assert [r["schedule"] for r in runs] == list(bench.SCHEDULES)
    for r in runs:
        assert r["order_matches"], r["schedule"]
        assert r["stages"] == (2 if r["schedule"] in ("gpipe", "1f1b") else 4)
        assert 0.0 <= r["bubble_measured"] < 1.0 and 0.0 <= r["bubble_simulated"] < 1.0


def test_bad_arguments_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="unknown schedule or job"):
        bench.run(schedules=("pipedream",))
    with pytest.raises(ValueError, match="microbatches"):
        bench.run(microbatches=(0,))
