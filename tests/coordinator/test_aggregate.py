"""Streaming aggregation: a running weighted sum equals the weighted mean of the updates it
folded in, whatever their order, and holds one model's worth of memory however many it took."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.aggregate import RunningSum
from coordinator.strategies.base import weighted_mean

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(min_value=0.01, max_value=1e4), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_running_mean_is_the_weighted_mean_in_any_order(weights: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    updates = [
        (w, {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5)})
        for w in weights
    ]
    forward, backward = RunningSum(), RunningSum()
    for w, x in updates:
        forward.add(w, x)
    for w, x in reversed(updates):
        backward.add(w, x)
    reference = weighted_mean(updates)
    # float64 sums, one float32 rounding at the end; the reference accumulates in float32, so
    # each of its n terms may be off by an ulp of the largest value.
    n, eps = len(updates), float(np.finfo(np.float32).eps)
    for name in ("a", "b"):
        scale = max(float(np.max(np.abs(x[name]))) for _, x in updates)
        for got in (forward.mean()[name], backward.mean()[name]):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, reference[name], rtol=0, atol=2 * (n + 1) * eps * scale)
    assert forward.weight == pytest.approx(sum(weights)) and forward.count == n


def test_memory_is_one_model_however_many_updates() -> None:
    model = {"w": np.ones((100, 100), np.float32)}
    total = RunningSum()
    total.add(1.0, model)
    one = total.nbytes
    for _ in range(63):
        total.add(2.0, model)
    assert total.nbytes == one and total.count == 64


def test_bad_updates_are_refused_and_change_nothing() -> None:
    total = RunningSum()
    total.add(1.0, {"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="weight"):
        total.add(float("nan"), {"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="other tensors"):
        total.add(1.0, {"v": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="no updates"):
        RunningSum().mean()
    assert total.count == 1 and total.weight == 1.0
    np.testing.assert_array_equal(total.mean()["w"], np.ones(3, np.float32))
