"""Differential privacy of pseudo-gradients: clipping, noise scale, and the RDP accountant."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from site_agent.privacy import (
    DPConfig,
    PrivacyAccountant,
    clip_update,
    gaussian_epsilon,
    gaussian_rdp,
    global_l2_norm,
    new_noise_generator,
    optimal_alpha,
    privatize,
    rdp_to_epsilon,
)


@pytest.mark.timeout(30)
@settings(max_examples=40, deadline=None)
@given(
    scale=st.floats(min_value=1e-3, max_value=1e3),
    clip_norm=st.floats(min_value=1e-2, max_value=10.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_privacy_clipping_bounds_the_norm(scale: float, clip_norm: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    update = {
        "a": (rng.normal(size=(7, 5)) * scale).astype(np.float32),
        "b": (rng.normal(size=11) * scale).astype(np.float32),
    }
    clipped, norm = clip_update(update, clip_norm)
    assert norm == pytest.approx(global_l2_norm(update))
    assert global_l2_norm(clipped) <= clip_norm
    if norm <= clip_norm:  # already inside: unchanged
        for name in update:
            np.testing.assert_array_equal(clipped[name], update[name])
    else:  # scaled onto the sphere, direction kept
        assert global_l2_norm(clipped) == pytest.approx(clip_norm, rel=1e-5)
        ratio = clipped["a"].astype(np.float64) / update["a"]
        np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-5)


@pytest.mark.timeout(30)
def test_privacy_clipping_rejects_non_finite() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        clip_update({"a": np.array([1.0, np.nan])}, 1.0)
    clipped, norm = clip_update({"a": np.zeros(3)}, 1.0)
    assert norm == 0 and not clipped["a"].any()


@pytest.mark.timeout(30)
def test_privacy_noise_std_matches_z_times_c() -> None:
    cfg = DPConfig(clip_norm=0.5, noise_multiplier=1.3)
    std = 1.3 * 0.5  # z * C
    zeros = {"w": np.zeros((200, 500), np.float32), "b": np.zeros(1000, np.float32)}
    noisy, _ = privatize(zeros, cfg, new_noise_generator(seed=11))
    samples = np.concatenate([v.ravel() for v in noisy.values()]).astype(np.float64)
    n = samples.size
    # Sample std of n Gaussians has relative standard error ~ 1/sqrt(2n) (0.1% here); allow 2%.
    assert samples.std() == pytest.approx(std, rel=0.02)
    assert abs(samples.mean()) < 6 * std / math.sqrt(n)
    # Independent per coordinate, fresh per call, reproducible only with the same seed.
    again, _ = privatize(zeros, cfg, new_noise_generator(seed=11))
    np.testing.assert_array_equal(again["w"], noisy["w"])
    other, _ = privatize(zeros, cfg, new_noise_generator())
    assert not np.array_equal(other["w"], noisy["w"])
    # Noise is added after clipping: a huge update ends up at norm ~ sqrt(C^2 + n (zC)^2).
    big = {"w": np.full((200, 500), 1e6, np.float32), "b": np.zeros(1000, np.float32)}
    out, norm = privatize(big, cfg, new_noise_generator(seed=3))
    assert norm > 1e8
    expect = math.sqrt(0.5**2 + n * std**2)
    assert global_l2_norm(out) == pytest.approx(expect, rel=0.02)
    # z = 0 clips only.
    plain, _ = privatize(big, DPConfig(clip_norm=0.5, noise_multiplier=0.0), new_noise_generator())
    assert global_l2_norm(plain) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.timeout(30)
def test_privacy_epsilon_grows_with_rounds_and_shrinks_with_noise() -> None:
    eps_by_rounds = [gaussian_epsilon(1.0, t, 1e-5) for t in (1, 2, 10, 100, 1000)]
    assert all(a < b for a, b in zip(eps_by_rounds, eps_by_rounds[1:], strict=False))
    eps_by_noise = [gaussian_epsilon(z, 100, 1e-5) for z in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in zip(eps_by_noise, eps_by_noise[1:], strict=False))
    assert gaussian_epsilon(1.0, 100, 1e-3) < gaussian_epsilon(1.0, 100, 1e-6)
    assert gaussian_epsilon(1.0, 0, 1e-5) == 0.0
    assert gaussian_epsilon(0.0, 1, 1e-5) == math.inf
    accountant = PrivacyAccountant(DPConfig(clip_norm=1.0, noise_multiplier=1.0))
    seen = [accountant.epsilon()]
    for _ in range(5):
        accountant.step()
        seen.append(accountant.epsilon())
    assert seen[0] == 0 and all(a < b for a, b in zip(seen, seen[1:], strict=False))
    assert accountant.rounds == 5
    budget_rounds = accountant.rounds_within(10.0)
    assert gaussian_epsilon(1.0, budget_rounds, 1e-5) <= 10.0
    assert gaussian_epsilon(1.0, budget_rounds + 1, 1e-5) > 10.0


@pytest.mark.timeout(30)
def test_privacy_epsilon_known_reference_value() -> None:
    """z = 1.1, one round, delta = 1e-5, by hand:

    a = T / (2 z^2) = 1 / 2.42 = 0.413223; b = ln(1e5) = 11.512925;
    alpha* = 1 + sqrt(b / a) = 1 + sqrt(27.861280) = 6.278378;
    epsilon = a + 2 sqrt(a b) = 0.413223 + 2 * sqrt(4.757407) = 0.413223 + 4.362296 = 4.775519.
    """
    assert gaussian_epsilon(1.1, 1, 1e-5) == pytest.approx(4.775519, abs=1e-5)
    assert optimal_alpha(1.1, 1, 1e-5) == pytest.approx(6.278378, abs=1e-5)
    # 100 rounds at z = 1: 50 + sqrt(200 ln 1e5) = 50 + 47.9853.
    assert gaussian_epsilon(1.0, 100, 1e-5) == pytest.approx(97.985, abs=1e-2)
    # The closed form is the minimum over alpha: no order on a grid does better.
    grid = np.concatenate([np.linspace(1.01, 20, 4000), np.linspace(20, 500, 2000)])
    by_grid = min(rdp_to_epsilon(gaussian_rdp(1.1, a), a, 1e-5) for a in grid)
    assert gaussian_epsilon(1.1, 1, 1e-5) <= by_grid <= gaussian_epsilon(1.1, 1, 1e-5) + 1e-4


@pytest.mark.timeout(30)
def test_privacy_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="privacy.clip_norm"):
        DPConfig(clip_norm=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="privacy.noise_multiplier"):
        DPConfig(clip_norm=1.0, noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="privacy.noise_multiplier"):
        DPConfig(clip_norm=1.0, noise_multiplier=math.nan)
    with pytest.raises(ValueError, match="privacy.delta"):
        DPConfig(clip_norm=1.0, noise_multiplier=1.0, delta=1.0)
    with pytest.raises(ValueError, match="alpha"):
        gaussian_rdp(1.0, 1.0)
