"""Stage partition: exact against brute force, golden numbers, bounds, input errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from site_agent.pipeline.partition import (
    PartitionPlan,
    TransferModel,
    partition_at,
    partition_layers,
)

GOLDEN_COSTS = [4.0, 2.0, 7.0, 1.0, 3.0, 5.0, 2.0, 6.0]


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[float], list[int], int, TransferModel]:
    n = draw(st.integers(min_value=1, max_value=9))
    num_stages = draw(st.integers(min_value=1, max_value=n))
    # Integer-valued costs make exact ties common, which is where tie-breaking bugs hide.
    cost = st.one_of(
        st.integers(min_value=0, max_value=10).map(float),
        st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    )
    costs = draw(st.lists(cost, min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(min_value=0, max_value=10_000_000), min_size=n, max_size=n))
    transfer = draw(
        st.one_of(
            st.just(TransferModel()),
            st.builds(
                TransferModel,
                latency_s=st.floats(min_value=0.0, max_value=2.0, allow_nan=False),
                bandwidth_bytes_per_s=st.floats(min_value=1e5, max_value=1e8, allow_nan=False),
            ),
        )
    )
    return costs, sizes, num_stages, transfer


def _brute_force_bottleneck(
    costs: list[float], sizes: list[int], num_stages: int, transfer: TransferModel
) -> float:
    """The smallest bottleneck over every cut set (exponential): the oracle for the DP."""
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        times = [
            math.fsum(costs[a:b]) + (transfer.seconds(sizes[b - 1]) if b < n else 0.0)
            for a, b in itertools.pairwise(bounds)
        ]
        best = min(best, max(times))
    return best


def _check_well_formed(plan: PartitionPlan, n: int, num_stages: int) -> None:
    assert plan.num_stages == num_stages
    assert plan.boundaries[0] == 0
    assert list(plan.boundaries) == sorted(set(plan.boundaries))
    assert [i for stage in plan.stages for i in stage] == list(range(n))
    assert [stage[0] for stage in plan.stages] == list(plan.boundaries)
    assert plan.bottleneck == max(plan.stage_times)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_dp_matches_brute_force(
    instance: tuple[list[float], list[int], int, TransferModel],
) -> None:
    costs, sizes, num_stages, transfer = instance
    plan = partition_layers(costs, sizes, num_stages, transfer)
    exact = _brute_force_bottleneck(costs, sizes, num_stages, transfer)
    _check_well_formed(plan, len(costs), num_stages)
    assert plan.bottleneck == pytest.approx(exact, rel=1e-12, abs=1e-12)
    # The reported bound holds (to float rounding of total / num_stages).
    assert plan.lower_bound <= plan.bottleneck * (1 + 1e-12) + 1e-12
    assert plan.lower_bound == max(max(costs), math.fsum(costs) / num_stages)


def test_golden_chain_zero_transfer() -> None:
    plan = partition_layers(GOLDEN_COSTS, [0] * 8, 3)
    assert plan.bottleneck == 13.0
    assert [list(stage) for stage in plan.stages] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert plan.boundaries == (0, 2, 5)
    assert plan.stage_times == (6.0, 11.0, 13.0)
    assert plan.lower_bound == 10.0  # max(7, 30 / 3)


def test_golden_chain_transfer_moves_the_cut() -> None:
    # Every send costs 1 s of latency; layer 4's output adds 400 / 100 = 4 s more, so the golden
    # middle stage [7, 1, 3] now takes 16 s. The best is 14: [4, 2, 7] + 1 | [1, 3] + 5 | [5, 2, 6]
    # (cuts after layer 5 or 6 tie at 14; the earliest last cut wins).
    sizes = [0, 0, 0, 100, 400, 100, 0, 0]
    transfer = TransferModel(latency_s=1.0, bandwidth_bytes_per_s=100.0)
    plan = partition_layers(GOLDEN_COSTS, sizes, 3, transfer)
    assert plan.bottleneck == _brute_force_bottleneck(GOLDEN_COSTS, sizes, 3, transfer)
    assert plan.boundaries == (0, 3, 5)
    assert plan.stage_times == (14.0, 9.0, 13.0)
    assert plan.bottleneck == 14.0


def test_one_stage_and_one_layer_per_stage() -> None:
    one = partition_layers(GOLDEN_COSTS, [10**9] * 8, 1, TransferModel(latency_s=5.0))
    assert one.stages == (tuple(range(8)),)
    assert one.stage_times == (30.0,)  # the last stage sends nothing
    each = partition_layers(GOLDEN_COSTS, [0] * 8, 8)
    assert each.stages == tuple((i,) for i in range(8))
    assert each.bottleneck == 7.0 == each.lower_bound


def test_zero_costs_are_allowed() -> None:
    plan = partition_layers([0.0, 0.0, 0.0], [0, 0, 0], 2)
    assert plan.bottleneck == 0.0
    assert plan.boundaries == (0, 1)


@pytest.mark.parametrize(
    ("costs", "sizes", "num_stages", "match"),
    [
        ([], [], 1, "layer_costs_s is empty"),
        ([1.0, -0.5], [0, 0], 1, r"layer_costs_s\[1\]"),
        ([1.0, math.nan], [0, 0], 1, r"layer_costs_s\[1\]"),
        ([1.0, 2.0], [0, -1], 1, r"activation_bytes\[1\]"),
        ([1.0, 2.0], [0], 1, "activation_bytes has 1 entries"),
        ([1.0, 2.0], [0, 0], 0, "num_stages must be >= 1"),
        ([1.0, 2.0], [0, 0], 3, "num_stages=3 exceeds the number of layers"),
    ],
)
def test_bad_inputs_raise(
    costs: list[float], sizes: list[int], num_stages: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        partition_layers(costs, sizes, num_stages)


def test_transfer_model_validation() -> None:
    assert TransferModel().seconds(10**12) == 0.0
    assert TransferModel(latency_s=0.5, bandwidth_bytes_per_s=4.0).seconds(2) == 1.0
    with pytest.raises(ValueError, match="latency_s"):
        TransferModel(latency_s=-1.0)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        TransferModel(bandwidth_bytes_per_s=0.0)


def test_partitioner_does_not_import_torch() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, site_agent.pipeline; assert 'torch' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


@given(instances())
@settings(max_examples=200, deadline=None)
def test_the_plan_of_a_given_cut_is_the_partitions_own(
    instance: tuple[list[float], list[int], int, TransferModel],
) -> None:
    costs, sizes, num_stages, transfer = instance
    plan = partition_layers(costs, sizes, num_stages, transfer)
    assert partition_at(costs, sizes, plan.boundaries, transfer) == plan


@pytest.mark.parametrize(
    ("boundaries", "said"),
    [([1, 3], "start at 0"), ([0, 3, 3], "increase"), ([0, 8], "no layer")],
)
def test_a_given_cut_that_is_no_cut_is_refused(boundaries: list[int], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        partition_at(GOLDEN_COSTS, [0] * 8, boundaries)
