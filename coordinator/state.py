"""Durable coordinator state: the global model, outer-optimizer state and round counter.

``GlobalState`` is everything a coordinator must not lose; ``StateStore`` is the seam that stores
it. The round counter is persisted before a round is announced, so a restarted coordinator never
reuses a round id. ``MemoryStateStore`` is the in-process implementation of that seam for tests;
the durable one is ``coordinator.file_store.FileStateStore``, and
``coordinator.state_writer.StateWriter`` runs either on a background thread.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from coordinator.strategies.base import Arrays


@dataclass(frozen=True)
class GlobalState:
    """Everything a coordinator must not lose."""

    params: Arrays
    """The authoritative global parameters: exactly what in-sync sites hold."""
    momentum: Arrays
    """Outer Nesterov buffer."""
    residual: Arrays
    """Downlink error feedback: exact outer result minus ``params``."""
    global_version: int
    """Id of the round that produced ``params`` (0: initial parameters)."""
    round_counter: int
    """Highest round id ever issued; the next round gets ``round_counter + 1``."""
    model_fingerprint: str
    history: tuple[dict[str, Any], ...] = field(default=())
    """One summary per completed round (JSON-able)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss reported by a site, per global version."""
    val_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    """The job's other validation metrics (accuracy, say) reported with a version's loss."""


class StateStore(Protocol):
    def load(self) -> GlobalState | None: ...

    def save(self, state: GlobalState) -> None:
        """Durably store a new global version (and everything else in ``state``).

        ``state.history`` must extend the stored history: the same rounds first, then new
        ones; only the last stored round may have changed (the coordinator amends a round with
        its broadcast figures after saving it). Otherwise ``ValueError`` and nothing is stored.
        """
        ...

    def save_counter(self, state: GlobalState) -> None:
        """Durably store ``round_counter``, ``history`` and ``val_losses`` only (the stored
        global version and its parameters stay)."""
        ...


def _check_extends(stored: Sequence[Any], history: Sequence[Any]) -> None:
    """``history`` extends ``stored`` (checked by the round before the last stored one: O(1))."""
    n = len(stored)
    if len(history) < n or (n >= 2 and history[n - 2] != stored[n - 2]):
        raise ValueError(f"history of {len(history)} rounds does not extend the stored {n} rounds")


class MemoryStateStore:
    """In-process state store (tests)."""

    def __init__(self) -> None:
        self.state: GlobalState | None = None
        self.saves = 0
        self._previous: GlobalState | None = None

    def load(self) -> GlobalState | None:
        return copy.deepcopy(self.state)

    def save(self, state: GlobalState) -> None:
        if self.state is not None:
            _check_extends(self.state.history, state.history)
        if self.state is None or self.state.global_version != state.global_version:
            self._previous = self.state
        self.state = copy.deepcopy(state)
        self.saves += 1

    def roll_back(self, version: int) -> None:
        """The version saved before the newest is the stored one again (its round counter
        stays): as ``FileStateStore.roll_back``."""
        if self.state is None or self._previous is None:
            raise ValueError("no version to go back to")
        if self._previous.global_version != version:
            raise ValueError(f"version {version} is not the one before {self.state.global_version}")
        self.state = replace(self._previous, round_counter=self.state.round_counter)
        self._previous = None

    def save_counter(self, state: GlobalState) -> None:
        assert self.state is not None, "save_counter before any save"
        _check_extends(self.state.history, state.history)
        self.state = replace(
            self.state,
            round_counter=state.round_counter,
            history=state.history,
            val_losses=dict(state.val_losses),
            val_metrics=dict(state.val_metrics),
        )
