"""The WAN scheduler's decisions on table-driven inputs."""

from __future__ import annotations

import pytest

from coordinator.scheduler import SchedulePolicy, SiteView, plan_round

pytestmark = pytest.mark.timeout(30)

NUMEL = 1_000_000  # 4 MB in fp32


def policy(**over: object) -> SchedulePolicy:
    base: dict[str, object] = {"num_inner_steps": 100, "model_numel": NUMEL}
    base.update(over)
    return SchedulePolicy(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("view", "codec"),
    [
        # 100 steps x 0.1 s = 10 s of compute; with margin 0.5 a sync may take 5 s.
        (SiteView("lan", 0.1, 0.001, 10e9), "fp32"),  # 64 Mbit at 10 Gbit/s: 0.01 s
        (SiteView("eu", 0.1, 0.04, 200e6), "fp32"),  # 64 Mbit at 200 Mbit/s + RTT: 0.36 s
        (SiteView("slow", 0.1, 0.3, 10e6), "fp16"),  # fp32 6.7 s, fp16 3.5 s
        (SiteView("thin", 0.1, 0.3, 3e6), "int4"),  # fp16 11 s, int8 5.7 s, int4 3.1 s
    ],
)
def test_least_compression_that_fits(view: SiteView, codec: str) -> None:
    plan, reason = plan_round(0.0, [view], policy(margin=0.5, sync_fraction=0.5))
    assert plan.uplink[view.site_id] == codec, reason
    assert view.site_id in reason


def test_unmeasured_site_gets_the_safe_default() -> None:
    plan, reason = plan_round(0.0, [SiteView("new")], policy())
    assert plan.uplink["new"] == "int8"
    assert "not measured" in reason


def test_configured_codec_wins() -> None:
    plan, reason = plan_round(
        0.0, [SiteView("eu", 0.1, 0.04, 200e6)], policy(fixed_uplink={"eu": "int4"})
    )
    assert plan.uplink["eu"] == "int4" and "configured" in reason


def test_downlink_follows_the_slowest_site() -> None:
    views = [SiteView("eu", 0.1, 0.04, 200e6), SiteView("thin", 0.1, 0.3, 3e6)]
    plan, _ = plan_round(0.0, views, policy(margin=0.5))
    assert plan.downlink == plan.uplink["thin"] != plan.uplink["eu"]


def test_overlap_prefers_a_fresh_merge_to_a_light_codec() -> None:
    # 100 steps x 0.1 s = 10 s of compute; at 10 Mbit/s and 0.3 s RTT fp32 takes 6.7 s, fp16
    # 3.5 s, int8 1.8 s, int4 1.15 s. All fit the 0.8 margin; a quarter of the slot takes int8.
    view = SiteView("slow", 0.1, 0.3, 10e6)
    plan, reason = plan_round(0.0, [view], policy())
    assert plan.uplink["slow"] == "int8" and plan.num_inner_steps == 100, reason
    # Nothing fits a tenth: the most compressed codec, and the slot stays as it is.
    plan, reason = plan_round(0.0, [view], policy(sync_fraction=0.1))
    assert plan.uplink["slow"] == "int4" and plan.num_inner_steps == 100, reason
    assert "slot" not in reason
    # Blocking rounds size the codec by the utilization target alone: 10 s x 5 / 95 = 0.53 s.
    plan, reason = plan_round(0.0, [view], policy(overlap=False))
    assert plan.uplink["slow"] == "int4" and plan.num_inner_steps > 100, reason


def test_slot_is_lengthened_when_nothing_fits() -> None:
    # 1 Mbit/s: even int4 (2 x 0.53 MB = 8.5 Mbit) takes 8.5 s > 0.8 x 10 s.
    plan, reason = plan_round(0.0, [SiteView("dial", 0.1, 0.5, 1e6)], policy())
    assert plan.uplink["dial"] == "int4"
    assert plan.num_inner_steps > 100 and "slot" in reason


def test_fragments_shrink_the_payload_and_the_slot() -> None:
    plan, _ = plan_round(0.0, [SiteView("eu", 0.1, 0.04, 200e6)], policy(num_fragments=4))
    assert plan.num_inner_steps == 25 and plan.num_fragments == 4


def test_blocking_mode_budget_follows_target_utilization() -> None:
    # Without overlap a 0.95 target leaves 10 s x 0.05/0.95 = 0.53 s for the sync.
    view = SiteView("eu", 0.1, 0.04, 200e6)
    plan, reason = plan_round(0.0, [view], policy(overlap=False))
    assert plan.uplink["eu"] == "fp32", reason  # 0.36 s fits
    plan, reason = plan_round(0.0, [SiteView("us", 0.1, 0.16, 50e6)], policy(overlap=False))
    assert plan.uplink["us"] in ("int8", "int4"), reason


@pytest.mark.parametrize(
    ("view", "over", "extra"),
    [
        # 0.8 x 2.0 s / 0.1 s per step = 16 extra steps.
        (SiteView("eu", 0.1, 0.04, 200e6, early_s=2.0), {}, 16),
        (SiteView("eu", 0.1, 0.04, 200e6, early_s=0.1), {}, 0),  # under one step
        (SiteView("eu", 0.1, 0.04, 200e6, early_s=60.0), {}, 100),  # at most a second slot
        (SiteView("eu", 0.1, 0.04, 200e6, early_s=60.0), {"max_inner_steps": 130}, 30),
        (SiteView("eu", 0.1, 0.04, 200e6, early_s=2.0), {"align_arrivals": False}, 0),
        (SiteView("eu", 0.1, 0.04, 200e6, early_s=2.0), {"align_fraction": 0.5}, 10),
        (SiteView("new", early_s=2.0), {}, 0),  # step time not measured yet
    ],
)
def test_a_site_that_landed_early_trains_extra_steps(
    view: SiteView, over: dict[str, object], extra: int
) -> None:
    last = SiteView("last", 0.1, 0.04, 200e6)  # the site whose update closed the round
    plan, reason = plan_round(0.0, [view, last], policy(**over))
    assert plan.num_inner_steps == 100 and plan.site_steps("last") == 100
    assert plan.extra_steps.get(view.site_id, 0) == extra
    assert plan.site_steps(view.site_id) == 100 + extra
    assert (f"+{extra} steps" in reason) == (extra > 0), reason


def test_the_site_with_the_fewest_extra_steps_trains_the_plain_slot() -> None:
    views = [
        SiteView("eu", 0.1, 0.04, 200e6, early_s=2.0),  # 16
        SiteView("us", 0.1, 0.04, 200e6, early_s=1.0),  # 8
        SiteView("ap", 0.1, 0.04, 200e6, early_s=0.5),  # 4
    ]
    plan, reason = plan_round(0.0, views, policy())
    assert plan.extra_steps == {"eu": 12, "us": 4} and plan.site_steps("ap") == 100, reason
    assert "less 4" in reason


COSTS = {"fp32": 0.0, "fp16": 0.0, "int8": 0.0009, "int4": 0.0031}


@pytest.mark.parametrize(
    ("view", "budget", "codec", "slot"),
    [
        # Bytes first: on any link, the fewest bytes whose loss cost is within the budget.
        (SiteView("lan", 0.1, 0.001, 10e9), 0.005, "int4", 100),
        (SiteView("new", 0.0, 0.0, 0.0), 0.005, "int4", 100),  # not measured: bytes are known
        (SiteView("lan", 0.1, 0.001, 10e9), 0.001, "int8", 100),  # int4 costs 0.31% > 0.1%
        (SiteView("lan", 0.1, 0.001, 10e9), 0.0, "fp16", 100),  # fp16 as good as fp32, half
        # int4 of 1M values is about 4.25 Mbit each way: 8.53 s at 1 Mbit/s with the RTT, over
        # 0.8 x 5 s of 50 steps x 0.1 s, so the slot grows to ceil(8.53 / (0.1 x 0.8)) = 107.
        (SiteView("thin", 0.1, 0.03, 1e6), 0.005, "int4", 107),
    ],
)
def test_bytes_first_takes_the_fewest_bytes_within_the_loss_budget(
    view: SiteView, budget: float, codec: str, slot: int
) -> None:
    steps = 100 if slot == 100 else 50
    plan, reason = plan_round(
        0.0, [view], policy(num_inner_steps=steps, loss_costs=COSTS, loss_budget=budget)
    )
    assert plan.uplink[view.site_id] == codec and plan.downlink == codec, reason
    assert plan.num_inner_steps == slot, reason
    assert "fewest bytes within loss" in reason


LADDER = ("fp32", "fp16", "int8", "int4", "int3")
PAIR_COSTS = {"fp32": 0.0, "int8": 0.001, "int4": 0.003, "int3": 0.008, "int3/int4": 0.004}


@pytest.mark.parametrize(
    ("over", "uplink", "downlink"),
    [
        # int3 both ways costs too much, int3 up with int4 down does not: fewer bytes than int4.
        ({}, "int3", "int4"),
        ({"loss_budget": 0.0035}, "int4", "int4"),  # the pair's +0.4% is over the budget
        ({"loss_budget": 0.01}, "int3", "int3"),  # int3 both ways is within: fewest bytes
        # A configured downlink: the best pair measured with it, else the best pair's uplink.
        ({"fixed_downlink": "int4"}, "int3", "int4"),
        ({"fixed_downlink": "fp16"}, "int3", "fp16"),
        # A configured uplink: the best pair measured with it.
        ({"default_uplink": "int8"}, "int8", "int8"),
        # As many bytes either way round: the lower cost, then the coarser uplink.
        ({"loss_costs": {**PAIR_COSTS, "int4/int3": 0.0041}}, "int3", "int4"),
        ({"loss_costs": {**PAIR_COSTS, "int4/int3": 0.0035}}, "int4", "int3"),
        ({"loss_costs": {**PAIR_COSTS, "int4/int3": 0.004}}, "int3", "int4"),
        # A pair of codecs off the ladder is never taken.
        ({"ladder": ("fp32", "fp16", "int8", "int4")}, "int4", "int4"),
    ],
)
def test_bytes_first_takes_the_fewest_bytes_pair_of_directions(
    over: dict[str, object], uplink: str, downlink: str
) -> None:
    view = SiteView("eu", 0.1, 0.04, 200e6)
    settings: dict[str, object] = {"ladder": LADDER, "loss_costs": PAIR_COSTS}
    settings.update(over)
    plan, reason = plan_round(0.0, [view], policy(**settings))
    assert (plan.uplink["eu"], plan.downlink) == (uplink, downlink), reason


def test_bytes_first_never_takes_a_codec_it_has_no_measurement_for() -> None:
    view = SiteView("eu", 0.1, 0.04, 200e6)
    costs = {"fp32": 0.0, "int8": 0.0009}  # int4 not measured
    plan, _ = plan_round(0.0, [view], policy(loss_costs=costs))
    assert plan.uplink["eu"] == "int8"
    # Nothing measured within the budget: the least compressed codec whose sync fits, as before.
    plan, reason = plan_round(0.0, [view], policy(loss_costs={"int4": 0.5}, margin=0.5))
    assert plan.uplink["eu"] == "fp32" and "fewest bytes" not in reason
