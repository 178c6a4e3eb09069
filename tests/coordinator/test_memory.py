"""The bytes a coordinator keeps per parameter, from its configuration (coordinator.memory)."""

from __future__ import annotations

import pytest

from comm.security.masking import SecAggConfig
from comm.security.rolekits import SecurityConfig
from coordinator.config import CoordinatorConfig, sections
from coordinator.memory import StateBudget, state_budget, state_bytes_per_param

INSECURE = SecurityConfig(insecure=True)


@pytest.mark.timeout(30)
def test_the_default_job_keeps_16_bytes_per_parameter_and_a_sum_per_open_round() -> None:
    one_round = sections(CoordinatorConfig(security=INSECURE, overlap=False))
    assert state_budget(one_round) == StateBudget(params=4, momentum=4, residual=4, sums=4)
    assert state_bytes_per_param(one_round) == 16
    overlapping = sections(CoordinatorConfig(security=INSECURE, overlap=True))
    assert state_bytes_per_param(overlapping) == 20


@pytest.mark.timeout(30)
def test_the_sparse_broadcast_keeps_the_params_only() -> None:
    cfg = CoordinatorConfig(
        security=INSECURE, outer_strategy="sparseloco", broadcast="sparse", overlap=False
    )
    assert state_budget(sections(cfg)) == StateBudget(params=4, momentum=0, residual=0, sums=0)
    dense = CoordinatorConfig(security=INSECURE, outer_strategy="sparseloco", overlap=False)
    assert state_bytes_per_param(sections(dense)) == 12  # no momentum; residual and sum


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("word_bits", "sums"), [(64, 8), (32, 4)])
def test_secure_aggregation_keeps_its_masked_sum_in_words_of_its_own(
    word_bits: int, sums: int
) -> None:
    masked = SecAggConfig(clip_bound=1.0, frac_bits=16, word_bits=word_bits)
    cfg = CoordinatorConfig(security=INSECURE, overlap=False, secure_aggregation=masked)
    assert state_budget(sections(cfg)) == StateBudget(params=4, momentum=4, residual=4, sums=sums)
