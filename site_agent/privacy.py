"""Differential privacy of a site's pseudo-gradients: clip, add Gaussian noise, account.

Each round a site clips its whole pseudo-gradient (all tensors together) to L2 norm ``clip_norm``
= C and adds independent N(0, (z C)^2) noise to every coordinate, z = ``noise_multiplier``. This
is the Gaussian mechanism with L2 sensitivity C for the site's contribution (add/remove of the
site's whole data set, as in DP-FedAvg, McMahan et al. 2018): the guarantee covers all of the
site's data at once, so every single record in it is covered too.

Accounting uses Rényi DP (Mironov 2017). One round of the Gaussian mechanism is
(alpha, alpha / (2 z^2))-RDP for every order alpha > 1; T rounds compose additively to
T alpha / (2 z^2); and (alpha, r)-RDP implies (r + log(1/delta) / (alpha - 1), delta)-DP. The
minimum over alpha > 1 is reached at alpha* = 1 + sqrt(2 z^2 log(1/delta) / T), giving

    epsilon(T) = T / (2 z^2) + sqrt(2 T log(1/delta)) / z.

This conversion is a valid upper bound, slightly looser than the optimal conversions (Balle et
al. 2020); it ignores the extra privacy that secure aggregation's summed noise and any
subsampling would add, so the reported epsilon is conservative. Noise comes from numpy's PCG64
seeded from ``os.urandom`` unless a seed is given (tests); floating-point noise samplers are not
hardened against the attacks of Mironov (CCS 2012), see docs/security.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArrays = dict[str, npt.NDArray[np.float32]]


@dataclass(frozen=True, kw_only=True)
class DPConfig:
    """Per-site differential privacy of pseudo-gradients (``[site.privacy]``)."""

    clip_norm: float
    """C: the L2 norm, over all tensors together, each round's pseudo-gradient is clipped to."""
    noise_multiplier: float
    """z: per-coordinate Gaussian noise std is z * C. 0 clips without privacy (epsilon = inf)."""
    delta: float = 1e-5
    """The delta of the (epsilon, delta) guarantee reported; well below 1 / (records per site)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"privacy.clip_norm must be a positive number, got {self.clip_norm}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"privacy.noise_multiplier must be a number >= 0, got {self.noise_multiplier}"
            )
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta}")

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.clip_norm


def global_l2_norm(arrays: Mapping[str, npt.ArrayLike]) -> float:
    """The L2 norm of all tensors taken as one vector (accumulated in float64)."""
    total = 0.0
    for x in arrays.values():
        a = np.asarray(x, dtype=np.float64).ravel()
        total += float(np.dot(a, a))
    return math.sqrt(total)


def clip_update(arrays: Mapping[str, npt.ArrayLike], clip_norm: float) -> tuple[FloatArrays, float]:
    """Scale all tensors by ``min(1, clip_norm / norm)``; returns (clipped copies, norm before).

    Non-finite input is a ValueError: it would poison both the norm and the sum.
    """
    norm = global_l2_norm(arrays)
    if not math.isfinite(norm):
        raise ValueError("privacy: the update holds NaN or Inf; refusing to clip it")
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    # Scaling in float64 then rounding to float32 can overshoot C by float32 rounding; the
    # factor (1 - 2^-20) keeps the clipped norm <= C in float32 too.
    if scale < 1.0:
        scale *= 1.0 - 2.0**-20
    clipped = {
        name: (np.asarray(x, dtype=np.float64) * scale).astype(np.float32)
        for name, x in arrays.items()
    }
    return clipped, norm


def new_noise_generator(seed: int | None = None) -> np.random.Generator:
    """A generator for privacy noise: seeded from ``os.urandom`` unless ``seed`` is given."""
    if seed is None:
        seed = int.from_bytes(os.urandom(16), "little")
    return np.random.Generator(np.random.PCG64(seed))


def add_noise(
    arrays: Mapping[str, npt.ArrayLike], std: float, rng: np.random.Generator
) -> FloatArrays:
    """Each coordinate plus independent N(0, std^2) noise (sampled in float64)."""
    return {
        name: (np.asarray(x, dtype=np.float64) + rng.normal(0.0, std, size=np.shape(x))).astype(
            np.float32
        )
        for name, x in arrays.items()
    }


def privatize(
    arrays: Mapping[str, npt.ArrayLike], config: DPConfig, rng: np.random.Generator
) -> tuple[FloatArrays, float]:
    """Clip to ``clip_norm`` and add N(0, (z C)^2) per coordinate; returns (noisy, norm before)."""
    clipped, norm = clip_update(arrays, config.clip_norm)
    if config.noise_multiplier == 0:
        return clipped, norm
    return add_noise(clipped, config.noise_std, rng), norm


def gaussian_rdp(noise_multiplier: float, alpha: float, rounds: int = 1) -> float:
    """Rényi DP of order ``alpha`` of ``rounds`` Gaussian mechanisms: rounds * alpha / (2 z^2)."""
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1, got {alpha}")
    if noise_multiplier == 0:
        return math.inf
    return rounds * alpha / (2.0 * noise_multiplier**2)


def rdp_to_epsilon(rdp: float, alpha: float, delta: float) -> float:
    """(alpha, rdp)-RDP implies (rdp + log(1/delta) / (alpha - 1), delta)-DP."""
    return rdp + math.log(1.0 / delta) / (alpha - 1.0)


def optimal_alpha(noise_multiplier: float, rounds: int, delta: float) -> float:
    """The order minimizing :func:`rdp_to_epsilon` of :func:`gaussian_rdp`:
    1 + sqrt(2 z^2 log(1/delta) / T) (zero derivative of T a / (2 z^2) + log(1/delta)/(a-1))."""
    return 1.0 + math.sqrt(2.0 * noise_multiplier**2 * math.log(1.0 / delta) / rounds)


def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """epsilon after ``rounds`` rounds at ``delta``: min over alpha > 1 of RDP + conversion,
    = T / (2 z^2) + sqrt(2 T log(1/delta)) / z; 0 for no rounds, inf without noise."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    alpha = optimal_alpha(noise_multiplier, rounds, delta)
    return rdp_to_epsilon(gaussian_rdp(noise_multiplier, alpha, rounds), alpha, delta)


class PrivacyAccountant:
    """Counts the rounds a site has released under ``config`` and reports (epsilon, delta).

    Rounds that used a different noise multiplier cannot be mixed in; make a new accountant or
    keep the config fixed for the run (the config is frozen for that reason).
    """

    def __init__(self, config: DPConfig, *, rounds: int = 0) -> None:
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        self.config = config
        self.rounds = rounds

    def step(self, rounds: int = 1) -> None:
        """Record ``rounds`` more released updates (call after each send)."""
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        self.rounds += rounds

    def epsilon(self, delta: float | None = None) -> float:
        return gaussian_epsilon(
            self.config.noise_multiplier,
            self.rounds,
            self.config.delta if delta is None else delta,
        )

    def rounds_within(self, epsilon_budget: float) -> int:
        """How many rounds in total keep epsilon <= ``epsilon_budget`` (epsilon grows with T)."""
        if gaussian_epsilon(self.config.noise_multiplier, 1, self.config.delta) > epsilon_budget:
            return 0
        lo, hi = 1, 2
        while (
            gaussian_epsilon(self.config.noise_multiplier, hi, self.config.delta) <= epsilon_budget
        ):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (
                gaussian_epsilon(self.config.noise_multiplier, mid, self.config.delta)
                <= epsilon_budget
            ):
                lo = mid
            else:
                hi = mid
        return lo
