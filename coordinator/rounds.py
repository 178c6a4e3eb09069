"""Round decisions: when to open, close or abort a round, as pure functions.

``decide`` takes ``(now, snapshot, config)`` and returns ``(decision, reason)``; the service
loop only gathers the snapshot and carries the decision out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    WAIT = "wait"
    OPEN = "open"
    CLOSE = "close"
    ABORT = "abort"
    FINISH = "finish"


@dataclass(frozen=True)
class OpenRound:
    """The round in flight."""

    round_id: int
    base_version: int
    participants: tuple[str, ...]
    opened_at: float
    deadline_at: float
    received: frozenset[str]


@dataclass(frozen=True)
class RoundSnapshot:
    """What the decision needs to know, copied out of the service's state."""

    open_round: OpenRound | None
    ready: tuple[str, ...]
    """Sites joined and in sync with the current global version."""
    alive: frozenset[str]
    """All sites currently members (timed-out sites already removed)."""
    completed_rounds: int


@dataclass(frozen=True)
class RoundPolicy:
    min_sites: int
    quorum_fraction: float
    max_rounds: int


@dataclass(frozen=True)
class Decision:
    action: Action
    participants: tuple[str, ...] = ()
    """OPEN: who takes part. CLOSE: whose updates are merged."""


def quorum_size(num_participants: int, quorum_fraction: float) -> int:
    return max(1, math.ceil(quorum_fraction * num_participants - 1e-9))


def decide(now: float, snap: RoundSnapshot, policy: RoundPolicy) -> tuple[Decision, str]:
    r = snap.open_round
    if r is None:
        if policy.max_rounds and snap.completed_rounds >= policy.max_rounds:
            return Decision(Action.FINISH), f"completed {snap.completed_rounds} rounds"
        if len(snap.ready) >= policy.min_sites:
            return Decision(Action.OPEN, tuple(sorted(snap.ready))), (
                f"{len(snap.ready)} sites ready (min {policy.min_sites})"
            )
        return Decision(Action.WAIT), f"{len(snap.ready)} of {policy.min_sites} sites ready"

    received = tuple(sorted(r.received))
    need = quorum_size(len(r.participants), policy.quorum_fraction)
    if set(r.participants) <= r.received:
        return Decision(Action.CLOSE, received), "all participants sent updates"
    outstanding = set(r.participants) - r.received
    if not outstanding & snap.alive:
        if len(received) >= need:
            return Decision(Action.CLOSE, received), (
                f"remaining participants left: {sorted(outstanding)}; quorum {len(received)}/{need}"
            )
        return Decision(Action.ABORT), (
            f"participants left {sorted(outstanding)} and quorum {len(received)}/{need} is lost"
        )
    if now >= r.deadline_at:
        if len(received) >= need:
            return Decision(Action.CLOSE, received), (
                f"deadline passed with quorum {len(received)}/{need}; late: {sorted(outstanding)}"
            )
        return Decision(Action.ABORT), f"deadline passed with {len(received)}/{need} updates"
    return Decision(Action.WAIT), f"{len(received)}/{len(r.participants)} updates in"
