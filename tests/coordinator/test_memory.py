"""The bytes a coordinator holds per parameter, from its configuration (coordinator.memory)."""

from __future__ import annotations

import pytest

from comm.security.masking import SecAggConfig
from comm.security.rolekits import SecurityConfig
from coordinator.config import CoordinatorConfig, sections
from coordinator.memory import (
    StateBudget,
    encoded_bytes_per_value,
    state_budget,
    state_bytes_per_param,
)

pytestmark = pytest.mark.timeout(30)

INSECURE = SecurityConfig(insecure=True)
INT4 = 0.5 + 2 / 64  # half a byte a value, a float16 scale per block of 64


def test_the_default_job_keeps_12_bytes_per_parameter_and_holds_its_updates_compressed() -> None:
    cfg = CoordinatorConfig(
        security=INSECURE, overlap=False, uplink_codec="int4", downlink_codec="int4"
    )
    budget = state_budget(sections(cfg), 3)
    assert encoded_bytes_per_value("int4") == INT4
    assert budget == StateBudget(
        params=4, momentum=4, residual=4, open_sums=0, held_updates=3 * INT4, broadcast=INT4
    )
    assert budget.kept == state_bytes_per_param(sections(cfg)) == 12
    assert budget.total == 12 + 4 * INT4
    # Sync overlapping compute: two rounds open hold two updates per site, and no sum.
    overlapping = CoordinatorConfig(
        security=INSECURE, overlap=True, uplink_codec="int4", downlink_codec="int4"
    )
    assert state_budget(sections(overlapping), 3).held_updates == 6 * INT4
    assert state_bytes_per_param(sections(overlapping)) == 12


def test_codecs_the_scheduler_chooses_count_at_their_largest() -> None:
    auto = state_budget(sections(CoordinatorConfig(security=INSECURE, overlap=False)), 2)
    assert (auto.held_updates, auto.broadcast) == (2 * 4.0, 4.0)  # fp32 is on the ladder
    thin = CoordinatorConfig(
        security=INSECURE,
        overlap=False,
        uplink_codec="int4",
        downlink_codec="int8",
        site_uplink_codecs={"ap": "fp16"},
    )
    budget = state_budget(sections(thin), 2)
    assert budget.held_updates == 2 * 2.0 and budget.broadcast == encoded_bytes_per_value("int8")


def test_the_sparse_broadcast_keeps_the_params_and_the_updates_it_forwards() -> None:
    cfg = CoordinatorConfig(
        security=INSECURE,
        outer_strategy="sparseloco",
        broadcast="sparse",
        overlap=False,
        uplink_codec="int4",
    )
    assert state_budget(sections(cfg), 4) == StateBudget(
        params=4, momentum=0, residual=0, open_sums=0, held_updates=4 * INT4, broadcast=0.0
    )
    dense = CoordinatorConfig(security=INSECURE, outer_strategy="sparseloco", overlap=False)
    assert state_bytes_per_param(sections(dense)) == 8  # no momentum; the residual


@pytest.mark.parametrize(("word_bits", "sums"), [(64, 8), (32, 4)])
def test_secure_aggregation_keeps_its_masked_sum_in_words_of_its_own(
    word_bits: int, sums: int
) -> None:
    masked = SecAggConfig(clip_bound=1.0, frac_bits=16, word_bits=word_bits)
    cfg = CoordinatorConfig(
        security=INSECURE, overlap=False, secure_aggregation=masked, downlink_codec="int4"
    )
    assert state_budget(sections(cfg), 3) == StateBudget(
        params=4, momentum=4, residual=4, open_sums=sums, held_updates=0.0, broadcast=INT4
    )
