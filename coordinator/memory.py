"""What a coordinator keeps per parameter of the model it owns, from its configuration.

The state a close works on is overwritten tensor by tensor in place
(:func:`coordinator.aggregate.outer_step`), so what a coordinator process holds is the state it
keeps plus buffers whose size does not grow with the model: a few float32 temporaries of the
largest tensor at a close, the compressed updates in reassembly, the broadcast being sent (its
compressed delta). ``docs/scaling.md`` ("Memory per parameter") writes the formula down;
:func:`state_bytes_per_param` computes it, and ``crossdc bench scale`` checks the peak it
measures against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator import strategies
from coordinator.config import Sections

FLOAT32 = 4


@dataclass(frozen=True)
class StateBudget:
    """Bytes kept per parameter, by what keeps them (float32 each)."""

    params: int
    """The global parameters θ (always)."""
    momentum: int
    """The outer momentum: with a strategy that writes it (DiLoCo), not SparseLoCo's."""
    residual: int
    """The downlink residual: with the dense broadcast (the delta goes down through a codec
    and the difference is carried into the next close; with a lossless ``fp32`` downlink it
    holds the float32 rounding of θ + δ, still written). None with the sparse broadcast."""
    sums: int
    """The running sums of the rounds open at once (one float32 sum per round, two when sync
    overlaps compute), with the weighted mean (a masked sum: the aggregation's own words,
    ``AggregationConfig.sum_word_bytes``); the sparse broadcast keeps the updates as they arrived
    (compressed, counted apart: their size is the uplink codec's)."""

    @property
    def total(self) -> int:
        return self.params + self.momentum + self.residual + self.sums


def state_budget(config: Sections) -> StateBudget:
    """What a coordinator configured as ``config`` keeps per parameter it owns, from its first
    close on. (A restarted coordinator reads momentum and residual back from its checkpoint, so
    they take their bytes whatever the strategy.)"""
    dense = config.aggregation.broadcast == "dense"
    keeps_momentum = strategies.get(config.outer.strategy).keeps_momentum
    word = config.aggregation.sum_word_bytes
    return StateBudget(
        params=FLOAT32,
        momentum=FLOAT32 if keeps_momentum else 0,
        residual=FLOAT32 if dense else 0,
        sums=word * config.rounds.max_open if dense else 0,
    )


def state_bytes_per_param(config: Sections) -> int:
    """The bytes kept per parameter (:class:`StateBudget`'s total): 16 for the default job
    (DiLoCo, the dense broadcast, one round open at a time)."""
    return state_budget(config).total
