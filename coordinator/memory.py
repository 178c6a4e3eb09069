"""What a coordinator holds per parameter of the model it owns, from its configuration.

The state a close works on is overwritten tensor by tensor in place
(:func:`coordinator.aggregate.outer_step`), and a round's updates are held as the compressed
bytes they came as until its close folds their mean tensor by tensor
(:class:`coordinator.aggregate.MeanFold`), so what a coordinator process holds per parameter is
the state it keeps, the updates its open rounds hold, compressed, and the broadcast being sent,
compressed; beside them, buffers whose size does not grow with the model (a few float32
temporaries of the largest tensor at a close, transfers in reassembly up to the channel's
receive budget). ``docs/scaling.md`` ("Memory per parameter") writes the formula down;
:func:`state_budget` computes its terms, and ``crossdc bench scale`` checks the peak it
measures against them.
"""

from __future__ import annotations

from dataclasses import dataclass

from comm.codecs.registry import get_codec
from coordinator import strategies
from coordinator.config import Sections

FLOAT32 = 4

_PER_VALUE = 1 << 20
"""The values a codec's size per value is taken over (a multiple of every block size)."""


def encoded_bytes_per_value(spec: str) -> float:
    """What ``spec`` encodes a value into, on average over a large tensor (``encoded_size``:
    the bound where a codec's size depends on the values)."""
    return get_codec(spec).encoded_size(_PER_VALUE) / _PER_VALUE


@dataclass(frozen=True)
class StateBudget:
    """Bytes held per parameter, by what holds them."""

    params: int
    """The global parameters θ, float32 (always)."""
    momentum: int
    """The outer momentum, float32: with a strategy that writes it (DiLoCo, not SparseLoCo)."""
    residual: int
    """The downlink residual, float32: with the dense broadcast (the delta goes down through a
    codec and the difference is carried into the next close; with a lossless ``fp32`` downlink
    it holds the float32 rounding of θ + δ, still written). None with the sparse broadcast."""
    open_sums: int
    """Sums kept whole while a round is open, one per round open at once, in the aggregation's
    own words (``AggregationConfig.sum_word_bytes``): secure aggregation's masked sum, to which
    an update is added on arrival and never held. The weighted mean keeps none (its mean is
    folded at the close, a tensor at a time)."""
    held_updates: float
    """The updates the open rounds hold, as the bytes they came as: one per site per round open
    at once, the uplink codec's size each (the largest the sites may be told to use). A closed
    round's late updates are held too, until their fragment's next sync: not counted here."""
    broadcast: float
    """The encoded result being sent, the downlink codec's size (dense broadcast); the sparse
    broadcast forwards the held updates themselves."""

    @property
    def kept(self) -> int:
        """The state kept from close to close (float32 arrays, and masked sums)."""
        return self.params + self.momentum + self.residual + self.open_sums

    @property
    def total(self) -> float:
        """The state kept plus the compressed bytes held."""
        return self.kept + self.held_updates + self.broadcast


def _largest(specs: set[str]) -> float:
    return max(encoded_bytes_per_value(s) for s in specs)


def state_budget(config: Sections, sites: int) -> StateBudget:
    """What a coordinator configured as ``config`` holds per parameter it owns, from its first
    close on, with ``sites`` sites taking part in every round. (A restarted coordinator reads
    momentum and residual back from its checkpoint, so they take their bytes whatever the
    strategy.)"""
    dense = config.aggregation.broadcast == "dense"
    held = config.aggregation.holds_updates
    keeps_momentum = strategies.get(config.outer.strategy).keeps_momentum
    rounds_open = config.rounds.max_open
    schedule = config.schedule
    uplinks = {schedule.default_uplink} if schedule.default_uplink else set(schedule.ladder)
    uplinks |= set(schedule.fixed_uplink.values())
    downlinks = {schedule.fixed_downlink} if schedule.fixed_downlink else set(schedule.ladder)
    return StateBudget(
        params=FLOAT32,
        momentum=FLOAT32 if keeps_momentum else 0,
        residual=FLOAT32 if dense else 0,
        open_sums=0 if held else config.aggregation.sum_word_bytes * rounds_open,
        held_updates=sites * rounds_open * _largest(uplinks) if held else 0.0,
        broadcast=_largest(downlinks) if dense else 0.0,
    )


def state_bytes_per_param(config: Sections) -> int:
    """The state kept per parameter (:attr:`StateBudget.kept`): 12 for the default job (DiLoCo,
    the dense broadcast: θ, the outer momentum and the downlink residual)."""
    return state_budget(config, 0).kept
