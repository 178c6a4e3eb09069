"""DiLoCo's outer step (Douillard et al., 2023): the token-weighted mean of the sites'
pseudo-gradients, then SGD with Nesterov momentum, written to match
``torch.optim.SGD(nesterov=True)`` with a zero-initialised buffer."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from coordinator.strategies import register
from coordinator.strategies.base import (
    NesterovTensors,
    OuterResult,
    OuterSettings,
    OuterStrategy,
    tensorwise_outer_step,
)


@register
@dataclass(frozen=True)
class DiLoCo(OuterStrategy):
    """Token-weighted mean of pseudo-gradients, then outer SGD with Nesterov momentum.

    Outer warm-up: a step whose model has at most ``warmup_steps`` inner steps behind it is the
    plain mean (lr 1, no momentum; the buffer restarts from that mean). Early in training the
    sites' models are far apart on a curved loss, and Nesterov's amplification of the mean (lr
    (1 + μ) on the first step, up to lr / (1 − μ) later) overshoots; plain averaging does not.
    A ``final`` step is the plain mean too: the look-ahead of momentum helps the round that
    starts from it, not a model that is kept.
    """

    name: ClassVar[str] = "diloco"
    summary: ClassVar[str] = "Nesterov outer step"
    why_not_other_broadcasts: ClassVar[str] = "a momentum step is dense"

    lr: float = 0.7
    momentum: float = 0.9
    warmup_steps: int = 0

    @classmethod
    def from_settings(cls, settings: OuterSettings) -> DiLoCo:
        return cls(lr=settings.lr, momentum=settings.momentum, warmup_steps=settings.warmup_steps)

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"outer warmup_steps must be >= 0, got {self.warmup_steps}")

    def in_warmup(self, inner_steps: int | None) -> bool:
        """Whether the step producing a model with ``inner_steps`` behind it is a plain mean."""
        return inner_steps is not None and inner_steps <= self.warmup_steps

    def tensor_step(self, *, inner_steps: int | None, final: bool) -> NesterovTensors:
        if self.in_warmup(inner_steps):
            rule = f"mean (outer warm-up: {inner_steps} <= {self.warmup_steps} inner steps)"
            return NesterovTensors(1.0, 0.0, rule)
        if final:
            return NesterovTensors(1.0, 0.0, "mean (final round)")
        rule = f"nesterov lr={self.lr:g} momentum={self.momentum:g}"
        return NesterovTensors(self.lr, self.momentum, rule)

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
        steps = self.tensor_step(inner_steps=inner_steps, final=final)
        return tensorwise_outer_step(
            steps, params, momentum, [(w, t) for _, w, t in ordered], averaged
        )
