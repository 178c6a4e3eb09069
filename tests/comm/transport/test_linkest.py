"""Tests for comm.transport.linkest: EWMA golden numbers, guards, the minimum-RTT filter, goodput intervals."""

from __future__ import annotations

import dataclasses

import pytest

from comm.transport.linkest import LinkEstimate, LinkEstimator, LinkEstimatorConfig


@pytest.mark.timeout(10)
def test_priors_before_any_sample() -> None:
    est = LinkEstimator().snapshot()
    assert est == LinkEstimate(
        rtt_s=0.1, goodput_bps=10e6, samples=0, updated_at=None, min_rtt_s=0.1
    )
    assert est.bdp_bytes() == 125_000
    assert LinkEstimator().bdp_bytes() == 125_000


@pytest.mark.timeout(10)
def test_rtt_and_goodput_golden_numbers() -> None:
    link = LinkEstimator()
    assert link.on_rtt_sample(0.100, now=1.0) == 0.100
    link.on_rtt_sample(0.200, now=2.0)
    link.on_rtt_sample(0.050, now=3.0)
    # 0.1 -> 0.1 + 0.125 x 0.1 = 0.1125 -> 0.1125 + 0.125 x (0.05 - 0.1125) = 0.1046875
    assert link.snapshot().rtt_s == pytest.approx(0.1046875, abs=1e-15)
    assert link.snapshot().min_rtt_s == 0.050
    assert link.on_transfer(1_000_000, 0.1, now=4.0) == pytest.approx(80e6)
    assert link.on_transfer(1_000_000, 0.05, now=5.0) == pytest.approx(160e6)
    # 80e6 + 0.25 x (160e6 - 80e6)
    est = link.snapshot()
    assert est.goodput_bps == pytest.approx(100e6)
    assert (est.samples, est.updated_at) == (5, 5.0)
    # goodput x minimum RTT: 12.5 MB/s x 0.05 s
    assert est.bdp_bytes() == link.bdp_bytes() == 625_000


@pytest.mark.timeout(10)
def test_configurable_alpha() -> None:
    link = LinkEstimator(LinkEstimatorConfig(rtt_alpha=0.5, goodput_alpha=1.0))
    link.on_rtt_sample(0.1, now=0.0)
    link.on_rtt_sample(0.3, now=1.0)
    assert link.snapshot().rtt_s == pytest.approx(0.2)
    link.on_transfer(1_000_000, 1.0, now=2.0)
    link.on_transfer(3_000_000, 1.0, now=3.0)
    assert link.snapshot().goodput_bps == pytest.approx(24e6)  # alpha 1: the latest sample


@pytest.mark.timeout(10)
def test_bytes_acked_intervals_and_idle_gaps() -> None:
    link = LinkEstimator()
    # The first bytes open the interval: they were under way before it started.
    assert link.on_bytes_acked(1000, now=10.0) is None
    assert link.on_bytes_acked(500_000, now=10.0625) is None  # shorter than goodput_interval_s
    # 1_250_000 bytes over 0.125 s = 80 Mbit/s
    assert link.on_bytes_acked(750_000, now=10.125) == 80e6
    assert link.on_bytes_acked(1_250_000, now=10.375) == 40e6
    assert link.snapshot().goodput_bps == 70e6  # 80e6 + 0.25 x (40e6 - 80e6)
    assert link.snapshot().samples == 2
    # 2.5 s of silence: a new interval opens, the idle time is not averaged in.
    assert link.on_bytes_acked(1_000_000, now=12.875) is None
    assert link.on_bytes_acked(1_250_000, now=13.0) == 80e6
    assert link.snapshot().samples == 3


@pytest.mark.timeout(10)
def test_guards_clamp_samples() -> None:
    link = LinkEstimator()
    assert link.on_rtt_sample(100.0, now=0.0) == 30.0
    assert link.on_rtt_sample(0.0, now=1.0) == 1e-4
    assert link.snapshot().min_rtt_s == 1e-4
    assert link.on_transfer(10, 1.0, now=2.0) == 1e5
    assert link.on_transfer(10**15, 1.0, now=3.0) == 1e12
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rtt sample"):
            link.on_rtt_sample(bad, now=4.0)
    with pytest.raises(ValueError, match="nbytes"):
        link.on_bytes_acked(-1, now=4.0)
    with pytest.raises(ValueError, match="seconds"):
        link.on_transfer(10, 0.0, now=4.0)


@pytest.mark.timeout(10)
def test_min_rtt_expires_after_its_window() -> None:
    link = LinkEstimator(LinkEstimatorConfig(min_rtt_window_s=10.0))
    link.on_rtt_sample(0.05, now=0.0)
    link.on_rtt_sample(0.40, now=5.0)  # queueing behind our own window: not the path
    assert link.snapshot().min_rtt_s == 0.05
    link.on_rtt_sample(0.08, now=10.5)  # the old minimum is stale: the path changed
    assert link.snapshot().min_rtt_s == 0.08
    link.on_rtt_sample(0.09, now=11.0)
    assert link.snapshot().min_rtt_s == 0.08


@pytest.mark.timeout(10)
def test_estimate_is_frozen_and_without_min_uses_smoothed_rtt() -> None:
    est = LinkEstimate(rtt_s=0.2, goodput_bps=80e6, samples=3, updated_at=1.0)
    assert est.bdp_bytes() == 2_000_000
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.rtt_s = 1.0  # type: ignore[misc]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"rtt_alpha": 0.0}, "rtt_alpha"),
        ({"goodput_alpha": 1.5}, "goodput_alpha"),
        ({"initial_rtt_s": 0.0}, "initial_rtt_s"),
        ({"min_goodput_bps": float("nan")}, "min_goodput_bps"),
        ({"min_rtt_s": 1.0, "max_rtt_s": 0.5}, "max_rtt_s"),
        ({"min_goodput_bps": 1e9, "max_goodput_bps": 1e6}, "max_goodput_bps"),
        ({"goodput_interval_s": 5.0, "goodput_idle_s": 1.0}, "goodput_idle_s"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, float], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        LinkEstimatorConfig(**kwargs)
