"""Replay protection stays bounded over long runs with reconnects and restarts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from comm.transport.profile import ChannelConfig
from comm.transport.router import RouterChannel
from comm.wire.frames import ReplayGuard, WireError
from comm.wire.schema import ErrorCode

pytestmark = pytest.mark.timeout(30)


def _replayed(guard: ReplayGuard, sender: bytes, session: str, seq: int) -> bool:
    try:
        guard.check(sender, session, seq)
    except WireError as exc:
        assert exc.code is ErrorCode.REPLAY
        return True
    return False


def test_replays_are_refused() -> None:
    guard = ReplayGuard()
    assert guard.check(b"p", "s1", 1) is False  # first session: nothing replaced
    assert _replayed(guard, b"p", "s1", 1)  # same sequence again
    assert guard.check(b"p", "s1", 5) is False
    assert _replayed(guard, b"p", "s1", 3)  # an older one
    assert guard.check(b"p", "s2", 1) is True  # the peer restarted
    assert _replayed(guard, b"p", "s1", 9)  # its ended session
    guard.check(b"p", "s2", 2, inner=True)  # reassembled in the current session
    with pytest.raises(WireError):
        guard.check(b"p", "s1", 2, inner=True)


def test_ended_sessions_per_peer_are_bounded_newest_kept() -> None:
    guard = ReplayGuard(max_ended_sessions=8)
    for i in range(1000):  # one peer restarting 1000 times
        guard.check(b"p", f"s{i}", 1)
    assert guard.ended_sessions(b"p") == 8
    assert all(_replayed(guard, b"p", f"s{i}", 2) for i in range(991, 999))  # the last 8 ended
    assert guard.peers == 1


def test_peers_are_bounded_least_recently_heard_forgotten() -> None:
    guard = ReplayGuard(max_peers=16, max_ended_sessions=4)
    guard.check(b"keep", "k", 1)
    for i in range(1000):
        guard.check(f"p{i}".encode(), "a", 1)
        guard.check(f"p{i}".encode(), "b", 1)  # each with one ended session
        guard.check(b"keep", "k", 2 + i)  # heard from all along: never evicted
    assert guard.peers == 16
    assert guard.ended_sessions() <= 15  # an evicted peer's ended sessions go with it
    assert _replayed(guard, b"keep", "k", 1)


def test_forget_drops_the_peer() -> None:
    guard = ReplayGuard()
    guard.check(b"p", "a", 1)
    guard.check(b"p", "b", 1)
    guard.forget(b"p")
    assert guard.peers == 0 and guard.ended_sessions() == 0
    assert guard.check(b"p", "c", 1) is False


@pytest.fixture
def router() -> Iterator[RouterChannel]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = RouterChannel(ChannelConfig(), context=ctx)
    try:
        yield chan
    finally:
        chan.close(flush_timeout_s=0)
        ctx.term()


def test_a_long_run_of_restarts_and_departures_keeps_the_channel_bounded(
    router: RouterChannel,
) -> None:
    """The coordinator's view: one routing id restarting, and many site processes that each
    joined once and were forgotten when they left (a restarted site has a new routing id)."""
    restarts = 2 * router.replay.max_ended_sessions
    for i in range(restarts):
        router._check_replay(b"eu/x", f"s{i}", 1, inner=False)
    for i in range(2000):
        peer = f"eu/{i}".encode()
        router._check_replay(peer, "t", 1, inner=False)
        router.forget(peer)
    assert router.replay.ended_sessions() == router.replay.max_ended_sessions
    assert router.replay.peers == 1
