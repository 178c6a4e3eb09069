"""SparseLoCo's outer step (Sarfi et al., 2025): the sites' decayed error-feedback
accumulators are the only memory, and the outer step is plain SGD on the mean of their sparse
updates (``comm.codecs.broadcast.sparse_step``, the same function the sites apply to the sparse
broadcast)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from coordinator.strategies import register
from coordinator.strategies.base import (
    OuterResult,
    OuterSettings,
    OuterStrategy,
    Revealed,
    SparseBroadcastStep,
    TensorStep,
)


@register
@dataclass(frozen=True)
class SparseLoCo(SparseBroadcastStep, OuterStrategy):
    """Outer SGD without momentum: θ ← θ − lr · (token-weighted mean of the sparse updates).

    The momentum of DiLoCo is replaced by each site's decayed error-feedback accumulator
    (e ← βe + Δ, send the chunk top-k of e, keep the rest), so the coordinator keeps no buffer:
    ``momentum`` passes through unchanged. The step is ``comm.codecs.broadcast.sparse_step``,
    which the sites also run on the broadcast (the sites' sparse updates forwarded), so they land
    on the coordinator's exact parameters: its ``ordered_step`` is
    :class:`SparseBroadcastStep`'s. Statistics tensors take the plain mean.
    """

    name: ClassVar[str] = "sparseloco"
    summary: ClassVar[str] = "outer SGD, the sites' decayed error feedback as the only memory"
    broadcasts: ClassVar[frozenset[str]] = frozenset({"dense", "sparse"})
    keeps_momentum: ClassVar[bool] = False
    needs: ClassVar[Revealed] = Revealed.EACH_UPDATE
    why_each_update: ClassVar[str] = (
        "its sites send the chunk top-k of their error feedback, which must arrive sparse"
    )

    lr: float = 1.0

    @classmethod
    def from_settings(cls, settings: OuterSettings) -> SparseLoCo:
        return cls(lr=settings.lr)

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
        weighted = [(w, t) for _, w, t in ordered]
        return self.ordered_step(params, momentum, weighted, averaged=averaged)

    def tensor_step(self, *, inner_steps: int | None, final: bool) -> TensorStep:
        return self.ordered_tensor_step()
