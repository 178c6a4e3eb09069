"""Membership and round decisions as pure functions."""

from __future__ import annotations

import pytest

from coordinator.membership import Member, expired, ready_sites
from coordinator.rounds import (
    Action,
    OpenRound,
    RoundPolicy,
    RoundSnapshot,
    decide,
    grace_window,
    quorum_size,
)

pytestmark = pytest.mark.timeout(30)

POLICY = RoundPolicy(min_sites=2, quorum_fraction=0.5, max_rounds=10, max_open=2)


def member(site: str, last_seen: float = 0.0, version: int = 3, in_sync: bool = True) -> Member:
    return Member(site, site.encode(), 0.0, last_seen, version, in_sync)


def test_expired_lists_silent_sites_with_reason() -> None:
    members = {"eu": member("eu", 95.0), "us": member("us", 50.0)}
    gone, why = expired(100.0, members, 30.0)
    assert gone == ["us"]
    assert "us=50.0s" in why
    assert expired(100.0, {"eu": member("eu", 95.0)}, 30.0)[0] == []


def test_ready_sites_need_sync_and_current_version() -> None:
    members = {"a": member("a"), "b": member("b", in_sync=False), "c": member("c", version=2)}
    assert ready_sites(members, 3) == ["a"]


def test_quorum_size() -> None:
    assert quorum_size(3, 0.5) == 2
    assert quorum_size(4, 0.5) == 2
    assert quorum_size(3, 1.0) == 3
    assert quorum_size(1, 0.1) == 1


def snap(
    *rounds: OpenRound, ready=("eu", "us"), alive=("eu", "us"), done=0, grace=5.0
) -> RoundSnapshot:
    return RoundSnapshot(tuple(rounds), tuple(ready), frozenset(alive), done, grace)


def rnd(
    received=(), participants=("eu", "us", "ap"), deadline=100.0, quorum_at=None, rid=5
) -> OpenRound:
    return OpenRound(rid, 4, tuple(participants), 0.0, deadline, frozenset(received), quorum_at)


ALL = ("eu", "us", "ap")


@pytest.mark.parametrize(
    ("now", "snapshot", "action", "who"),
    [
        (0.0, snap(ready=("eu",)), Action.WAIT, ()),
        (0.0, snap(ready=("us", "eu")), Action.OPEN, ("eu", "us")),
        (0.0, snap(done=10), Action.FINISH, ()),
        (1.0, snap(rnd(ALL), alive=ALL), Action.CLOSE, ("ap", "eu", "us")),
        (1.0, snap(rnd(("eu",)), alive=ALL, ready=()), Action.WAIT, ()),
        (100.0, snap(rnd(("eu", "us")), alive=ALL), Action.CLOSE, ("eu", "us")),
        (100.0, snap(rnd(("eu",)), alive=ALL), Action.ABORT, ()),
        (1.0, snap(rnd(("eu", "us")), alive=("eu", "us")), Action.CLOSE, ("eu", "us")),
        (1.0, snap(rnd(("eu",)), alive=("eu",)), Action.ABORT, ()),
        # Quorum reached at t=10: wait the grace window, then close without the straggler.
        (12.0, snap(rnd(("eu", "us"), quorum_at=10.0), alive=ALL, ready=()), Action.WAIT, ()),
        (15.0, snap(rnd(("eu", "us"), quorum_at=10.0), alive=ALL), Action.CLOSE, ("eu", "us")),
        # With overlap a second round opens while the first is in flight, but not a third.
        (1.0, snap(rnd(("eu",)), alive=ALL, ready=ALL), Action.OPEN, ("ap", "eu", "us")),
        (1.0, snap(rnd(("eu",)), rnd(rid=6), alive=ALL, ready=ALL), Action.WAIT, ()),
        # Never plan more rounds than max_rounds.
        (1.0, snap(rnd(("eu",)), alive=ALL, ready=ALL, done=9), Action.WAIT, ()),
    ],
)
def test_decide_table(
    now: float, snapshot: RoundSnapshot, action: Action, who: tuple[str, ...]
) -> None:
    decision, reason = decide(now, snapshot, POLICY)
    assert decision.action is action, reason
    assert decision.participants == who
    assert reason


def test_max_rounds_zero_runs_forever() -> None:
    d, _ = decide(0.0, snap(done=10_000), RoundPolicy(2, 1.0, 0))
    assert d.action is Action.OPEN


def test_grace_window_learns_from_lags() -> None:
    assert grace_window([], floor_s=1.0, ceiling_s=60.0)[0] == 1.0
    lags = [0.5] * 8 + [4.0] * 2
    grace, why = grace_window(lags, floor_s=1.0, ceiling_s=60.0)
    assert grace == pytest.approx(6.0)  # p90 = 4.0 (the 9th of 10 sorted), x1.5
    assert "p90" in why
    assert grace_window([1000.0], floor_s=1.0, ceiling_s=60.0)[0] == 60.0
    assert grace_window([0.01] * 20, floor_s=1.0, ceiling_s=60.0)[0] == 1.0
