"""The outer strategy's names as the round's code imports them.

Defined in :mod:`coordinator.strategies`: the contract and shared math in
:mod:`~coordinator.strategies.base`, one module per strategy, and the registry that finds a
strategy by its name. Code that chooses a strategy asks the registry, never a class by name.
"""

from __future__ import annotations

from coordinator.strategies.base import (
    Arrays,
    OuterResult,
    OuterSettings,
    OuterStrategy,
    Strategy,
    global_norm,
    nesterov_step,
    weighted_mean,
)
from coordinator.strategies.diloco import DiLoCo
from coordinator.strategies.sparseloco import SparseLoCo

__all__ = [
    "Arrays",
    "DiLoCo",
    "OuterResult",
    "OuterSettings",
    "OuterStrategy",
    "SparseLoCo",
    "Strategy",
    "global_norm",
    "nesterov_step",
    "weighted_mean",
]
