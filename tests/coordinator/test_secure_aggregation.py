"""Secure aggregation on the coordinator: the masked sum it folds each update into as it lands."""

from __future__ import annotations

import numpy as np
import pytest

from comm.security.masking import SecAggConfig
from comm.security.secagg import unmask_mean
from coordinator.secure_aggregation import MaskedFold, MaskedSum
from tests.support.secagg import CFG, CFG32, make_plan, make_sessions, mask_all, random_updates


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", [CFG, CFG32])
def test_the_coordinators_running_masked_sum_is_the_unmasked_mean_bit_for_bit(
    cfg: SecAggConfig,
) -> None:
    """The coordinator folds each masked update into one modular sum as it lands (memory
    O(model) whatever the number of sites) and unmasks only that sum: the same result, in any
    arrival order, as unmasking all the kept vectors; anything but the masking set is refused."""
    rng = np.random.default_rng(11)
    sites = ["eu", "us", "ap", "sa", "af"]
    updates = random_updates(rng, sites, [(4, 8), (3,)], 0.5 * cfg.clip_bound)
    weights = {s: float(rng.uniform(0.1, 1.0)) for s in sites}
    sessions = make_sessions(sites, cfg)
    plan = make_plan(sessions)
    masked = mask_all(sessions, plan, updates, weights)
    want, want_total = unmask_mean(masked, plan, cfg)
    fold = MaskedFold(cfg, plan)
    sizes = []
    for site in reversed(sites):
        fold.sum.add(site, masked[site])
        sizes.append(fold.nbytes)
    assert len(set(sizes)) == 1  # one sum, however many sites sent
    got, total = fold.sum.mean(plan.participants)
    assert total == want_total and got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    with pytest.raises(ValueError, match="already sent"):
        fold.sum.add("eu", masked["eu"])
    partial = MaskedSum(cfg)
    partial.add("eu", masked["eu"])
    with pytest.raises(ValueError, match="do not match the masking set"):
        partial.mean(plan.participants)
