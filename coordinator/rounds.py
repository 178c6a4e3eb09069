"""Round decisions: when to open, close or abort rounds, and how long to wait for stragglers.

``decide`` takes ``(now, snapshot, policy)`` and returns ``(call, reason)``; the service loop
only gathers the snapshot and carries the decision out. Up to ``policy.max_open`` rounds are open
at once (two when sync overlaps compute: sites train round r+1 while round r is in flight); they
close in order. After quorum, a round waits a grace window learned from recent arrival lags
(``grace_window``), then closes without the stragglers, whose updates are merged later. A
restarted coordinator syncs the fragment after the last completed round's (``next_fragment``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Action(Enum):
    WAIT = "wait"
    OPEN = "open"
    CLOSE = "close"
    ABORT = "abort"
    FINISH = "finish"


@dataclass(frozen=True)
class OpenRound:
    """A round in flight."""

    round_id: int
    base_version: int
    participants: tuple[str, ...]
    opened_at: float
    deadline_at: float
    received: frozenset[str]
    quorum_at: float | None = None
    """When the quorum's last needed update arrived (None: not yet)."""
    fragment: int = 0
    dropped: frozenset[str] = frozenset()
    """Participants that will never send their update: they joined again (a restarted site
    holds no plan), so they count as gone although they are members."""


@dataclass(frozen=True)
class RoundSnapshot:
    """What the decision needs to know, copied out of the service's state."""

    open_rounds: tuple[OpenRound, ...]
    """Oldest first."""
    ready: tuple[str, ...]
    """Sites joined and in sync with the global model."""
    alive: frozenset[str]
    """All sites currently members (timed-out sites already removed)."""
    completed_rounds: int
    grace_s: float
    """How long a round with quorum waits for the rest (from ``grace_window``)."""


@dataclass(frozen=True)
class RoundPolicy:
    min_sites: int
    quorum_fraction: float
    max_rounds: int
    max_open: int = 1
    """Rounds open at once: 1 blocks sites on each sync, 2 overlaps sync with compute."""


@dataclass(frozen=True)
class RoundCall:
    """What the oldest round (or the next one) calls for; the lifecycle turns it into a
    :data:`~coordinator.decisions.Decision`."""

    action: Action
    participants: tuple[str, ...] = ()
    """OPEN: who takes part. CLOSE: whose updates are merged."""


def quorum_size(num_participants: int, quorum_fraction: float) -> int:
    return max(1, math.ceil(quorum_fraction * num_participants - 1e-9))


def grace_window(
    lags_s: Sequence[float], *, floor_s: float, ceiling_s: float, factor: float = 1.5
) -> tuple[float, str]:
    """How long to wait after quorum, learned from recent lags (arrival after quorum).

    The 90th percentile of recent lags times ``factor``, clamped to ``[floor_s, ceiling_s]``:
    a site that is usually a little late is waited for; one that is far behind is not.
    """
    if not lags_s:
        return floor_s, f"no arrival history: floor {floor_s:.2f}s"
    ordered = sorted(lags_s)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    grace = min(ceiling_s, max(floor_s, factor * p90))
    return grace, f"p90 lag {p90:.2f}s x {factor} over {len(ordered)} arrivals -> {grace:.2f}s"


def _decide_oldest(
    now: float, r: OpenRound, snap: RoundSnapshot, policy: RoundPolicy
) -> tuple[RoundCall, str]:
    received = tuple(sorted(r.received))
    need = quorum_size(len(r.participants), policy.quorum_fraction)
    outstanding = set(r.participants) - r.received
    if not outstanding:
        return RoundCall(
            Action.CLOSE, received
        ), f"round {r.round_id}: all participants sent updates"
    if not outstanding & (snap.alive - r.dropped):
        if len(received) >= need:
            return RoundCall(Action.CLOSE, received), (
                f"round {r.round_id}: remaining participants left {sorted(outstanding)}; "
                f"quorum {len(received)}/{need}"
            )
        return RoundCall(Action.ABORT), (
            f"round {r.round_id}: participants left {sorted(outstanding)}, quorum {len(received)}/{need} lost"
        )
    if r.quorum_at is not None and now >= r.quorum_at + snap.grace_s:
        return RoundCall(Action.CLOSE, received), (
            f"round {r.round_id}: quorum {len(received)}/{need} and grace {snap.grace_s:.2f}s "
            f"passed; late: {sorted(outstanding)}"
        )
    if now >= r.deadline_at:
        if len(received) >= need:
            return RoundCall(Action.CLOSE, received), (
                f"round {r.round_id}: deadline with quorum {len(received)}/{need}; late: {sorted(outstanding)}"
            )
        return RoundCall(
            Action.ABORT
        ), f"round {r.round_id}: deadline with {len(received)}/{need} updates"
    return RoundCall(
        Action.WAIT
    ), f"round {r.round_id}: {len(received)}/{len(r.participants)} updates in"


def decide(now: float, snap: RoundSnapshot, policy: RoundPolicy) -> tuple[RoundCall, str]:
    if snap.open_rounds:
        decision, why = _decide_oldest(now, snap.open_rounds[0], snap, policy)
        if decision.action is not Action.WAIT:
            return decision, why
    else:
        why = "no round open"
    planned = snap.completed_rounds + len(snap.open_rounds)
    if policy.max_rounds and planned >= policy.max_rounds:
        if not snap.open_rounds:
            return RoundCall(Action.FINISH), f"completed {snap.completed_rounds} rounds"
        return RoundCall(Action.WAIT), f"{why}; all {policy.max_rounds} rounds planned"
    if len(snap.open_rounds) >= policy.max_open:
        return RoundCall(Action.WAIT), why
    if len(snap.ready) >= policy.min_sites:
        return RoundCall(Action.OPEN, tuple(sorted(snap.ready))), (
            f"{len(snap.ready)} sites ready (min {policy.min_sites}), "
            f"{len(snap.open_rounds)} of {policy.max_open} rounds open"
        )
    return RoundCall(Action.WAIT), f"{why}; {len(snap.ready)} of {policy.min_sites} sites ready"


def next_fragment(history: Sequence[Mapping[str, Any]], num_fragments: int) -> int:
    """The fragment a resumed coordinator syncs first: the one after the last completed round's,
    so a restart keeps the rotation instead of syncing fragment 0 out of turn. 0 without history
    or when the fragment count has changed since."""
    if not history:
        return 0
    last = history[-1]
    if last.get("num_fragments") != num_fragments or not isinstance(last.get("fragment"), int):
        return 0
    return (int(last["fragment"]) + 1) % num_fragments
