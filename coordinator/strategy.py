"""The strategy: aggregation math and the outer optimizer, as free functions over arrays.

DiLoCo (Douillard et al., 2023): the outer gradient is the token-weighted mean of the sites'
pseudo-gradients Δ_s = θ_t − θ_s; the outer optimizer is SGD with Nesterov momentum, written to
match ``torch.optim.SGD(nesterov=True)`` with a zero-initialised buffer. SparseLoCo (Sarfi et
al., 2025): the sites' decayed error-feedback accumulators are the only memory, and the outer
step is plain SGD on the mean of their sparse updates (``comm.codecs.broadcast.sparse_step``,
the same function the sites apply to the sparse broadcast). Everything is float32 and iterates
sites in a fixed order, so the same inputs give bit-identical outputs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from comm.codecs.broadcast import sparse_step

Arrays = dict[str, npt.NDArray[np.float32]]

OUTER_STRATEGIES = ("diloco", "sparseloco")
"""Values of ``coordinator.outer_strategy``."""


def weighted_mean(updates: Sequence[tuple[float, Mapping[str, np.ndarray]]]) -> Arrays:
    """Σ w_i x_i / Σ w_i per tensor, accumulated in float32 in the given order."""
    if not updates:
        raise ValueError("weighted_mean of no updates")
    total = float(sum(w for w, _ in updates))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    names = list(updates[0][1])
    out: Arrays = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][1][name]), dtype=np.float32)
        for weight, tensors in updates:
            acc += np.float32(weight / total) * np.asarray(tensors[name], dtype=np.float32)
        out[name] = acc
    return out


def nesterov_step(
    params: Mapping[str, np.ndarray],
    grad: Mapping[str, np.ndarray],
    momentum_buf: Mapping[str, np.ndarray],
    *,
    lr: float,
    momentum: float,
) -> tuple[Arrays, Arrays]:
    """One SGD-Nesterov step: b ← μb + g; θ ← θ − lr (g + μb). Returns (θ', b')."""
    lr32, mu32 = np.float32(lr), np.float32(momentum)
    new_params: Arrays = {}
    new_buf: Arrays = {}
    for name, p in params.items():
        g = np.asarray(grad[name], dtype=np.float32)
        b = (mu32 * np.asarray(momentum_buf[name], dtype=np.float32) + g).astype(np.float32)
        new_buf[name] = b
        step = (lr32 * (g + mu32 * b)).astype(np.float32)
        new_params[name] = np.asarray(p, dtype=np.float32) - step
    return new_params, new_buf


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(t.ravel(), t.ravel())) for t in tensors.values())))


@dataclass(frozen=True)
class OuterResult:
    params: Arrays
    momentum: Arrays
    outer_grad_norm: float
    rule: str = ""
    """How the step was taken, for logs and round history."""


class Strategy(Protocol):
    """Turns accepted updates into the next exact global parameters."""

    def outer_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
        *,
        inner_steps: int | None = None,
        final: bool = False,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        """``inner_steps``: inner steps behind the model this step produces (None: unknown);
        ``final``: no round will start from this model (the run's last step of these tensors);
        ``averaged``: tensors that are statistics, not weights (BatchNorm's running mean and
        variance): always the plain mean, never extrapolated by momentum (a variance could
        turn negative)."""
        ...


@dataclass(frozen=True)
class DiLoCo:
    """Token-weighted mean of pseudo-gradients, then outer SGD with Nesterov momentum.

    Outer warm-up: a step whose model has at most ``warmup_steps`` inner steps behind it is the
    plain mean (lr 1, no momentum; the buffer restarts from that mean). Early in training the
    sites' models are far apart on a curved loss, and Nesterov's amplification of the mean (lr
    (1 + μ) on the first step, up to lr / (1 − μ) later) overshoots; plain averaging does not.
    A ``final`` step is the plain mean too: the look-ahead of momentum helps the round that
    starts from it, not a model that is kept.
    """

    lr: float = 0.7
    momentum: float = 0.9
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"outer warmup_steps must be >= 0, got {self.warmup_steps}")

    def in_warmup(self, inner_steps: int | None) -> bool:
        """Whether the step producing a model with ``inner_steps`` behind it is a plain mean."""
        return inner_steps is not None and inner_steps <= self.warmup_steps

    def outer_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
        *,
        inner_steps: int | None = None,
        final: bool = False,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        ordered = sorted(updates, key=lambda u: u[0])  # site order fixes float summation order
        grad = weighted_mean([(w, t) for _, w, t in ordered])
        if self.in_warmup(inner_steps):
            lr, mu = 1.0, 0.0
            rule = f"mean (outer warm-up: {inner_steps} <= {self.warmup_steps} inner steps)"
        elif final:
            lr, mu = 1.0, 0.0
            rule = "mean (final round)"
        else:
            lr, mu = self.lr, self.momentum
            rule = f"nesterov lr={lr:g} momentum={mu:g}"
        stats = [k for k in params if k in averaged]
        weights = [k for k in params if k not in averaged]
        new_params, new_buf = nesterov_step(
            {k: params[k] for k in weights},
            {k: grad[k] for k in weights},
            {k: momentum[k] for k in weights},
            lr=lr,
            momentum=mu,
        )
        if stats:
            mean_params, mean_buf = nesterov_step(
                {k: params[k] for k in stats},
                {k: grad[k] for k in stats},
                {k: momentum[k] for k in stats},
                lr=1.0,
                momentum=0.0,
            )
            new_params = {k: {**new_params, **mean_params}[k] for k in params}
            new_buf = {k: {**new_buf, **mean_buf}[k] for k in params}
            rule += f"; {len(stats)} statistics tensors: mean"
        return OuterResult(new_params, new_buf, global_norm(grad), rule)


@dataclass(frozen=True)
class SparseLoCo:
    """Outer SGD without momentum: θ ← θ − lr · (token-weighted mean of the sparse updates).

    The momentum of DiLoCo is replaced by each site's decayed error-feedback accumulator
    (e ← βe + Δ, send the chunk top-k of e, keep the rest), so the coordinator keeps no buffer:
    ``momentum`` passes through unchanged. The step is :func:`sparse_step`, which the sites also
    run on the broadcast (the sites' sparse updates forwarded), so they land on the coordinator's
    exact parameters. Statistics tensors take the plain mean.
    """

    lr: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")

    def outer_step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        updates: Sequence[tuple[str, float, Mapping[str, np.ndarray]]],
        *,
        inner_steps: int | None = None,
        final: bool = False,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        ordered = sorted(updates, key=lambda u: u[0])  # site order fixes float summation order
        return self.step(params, momentum, [(w, t) for _, w, t in ordered], averaged=averaged)

    def step(
        self,
        params: Mapping[str, np.ndarray],
        momentum: Mapping[str, np.ndarray],
        weighted: Sequence[tuple[float, Mapping[str, np.ndarray]]],
        *,
        averaged: Collection[str] = (),
    ) -> OuterResult:
        """The step over ``weighted`` (weight, update) in the order given: the arithmetic a site
        runs on a sparse broadcast, whose order is the broadcast's."""
        new_params = sparse_step(params, weighted, lr=self.lr, averaged=averaged)
        grad = weighted_mean(weighted)
        rule = f"sparse sgd lr={self.lr:g} (no momentum)"
        if any(k in averaged for k in params):
            rule += "; statistics tensors: mean"
        buf: Arrays = {k: np.asarray(v, dtype=np.float32) for k, v in momentum.items()}
        return OuterResult(new_params, buf, global_norm(grad), rule)
