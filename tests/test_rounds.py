"""Membership and round decisions as pure functions."""

from __future__ import annotations

import pytest

from coordinator.membership import Member, expired, ready_sites
from coordinator.rounds import Action, OpenRound, RoundPolicy, RoundSnapshot, decide, quorum_size

pytestmark = pytest.mark.timeout(30)

POLICY = RoundPolicy(min_sites=2, quorum_fraction=0.5, max_rounds=10)


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
    open_round: OpenRound | None = None, ready=("eu", "us"), alive=("eu", "us"), done=0
) -> RoundSnapshot:
    return RoundSnapshot(open_round, tuple(ready), frozenset(alive), done)


def rnd(received=(), participants=("eu", "us", "ap"), deadline=100.0) -> OpenRound:
    return OpenRound(5, 4, tuple(participants), 0.0, deadline, frozenset(received))


@pytest.mark.parametrize(
    ("now", "snapshot", "action", "who"),
    [
        (0.0, snap(ready=("eu",)), Action.WAIT, ()),
        (0.0, snap(ready=("us", "eu")), Action.OPEN, ("eu", "us")),
        (0.0, snap(done=10), Action.FINISH, ()),
        (
            1.0,
            snap(rnd(("eu", "us", "ap")), alive=("eu", "us", "ap")),
            Action.CLOSE,
            ("ap", "eu", "us"),
        ),
        (1.0, snap(rnd(("eu",)), alive=("eu", "us", "ap")), Action.WAIT, ()),
        (100.0, snap(rnd(("eu", "us")), alive=("eu", "us", "ap")), Action.CLOSE, ("eu", "us")),
        (100.0, snap(rnd(("eu",)), alive=("eu", "us", "ap")), Action.ABORT, ()),
        (1.0, snap(rnd(("eu", "us")), alive=("eu", "us")), Action.CLOSE, ("eu", "us")),
        (1.0, snap(rnd(("eu",)), alive=("eu",)), Action.ABORT, ()),
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
