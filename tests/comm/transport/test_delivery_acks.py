"""Acknowledged delivery: numbered messages, acknowledgements on what flows anyway, resends.

The streams' state machines on their own; the header fields on the wire; then real channels
(ROUTER <-> DEALER over tcp loopback, through the WAN link emulator where a delay matters) with a
deterministic loss injector (``comm.transport.faults``): a message lost after ZeroMQ accepted it,
a large message whose transfer stalls until the channel gives it up (with what is queued behind
it), a send to a peer not connected, a resend whose original did arrive; and a coordinator whose
plan to a site is lost after accept, recovered by the transport with no silence or deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from comm.codecs.floats import Fp32Codec
from comm.transport.dealer import DealerChannel
from comm.transport.faults import WireFaults
from comm.transport.profile import ChannelConfig
from comm.transport.reliable import MUST_ARRIVE, InStream, OutStream, resend_timeout_s
from comm.transport.router import RouterChannel
from comm.wire.frames import WireError, from_wire_envelope, to_wire
from comm.wire.schema import (
    Global,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    RoundStart,
    SyncRequest,
)
from comm.wire.tensors import encode_tensors
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator
from tests.support.coordinator import PARAMS, join, running

WAIT_S = 30.0  # bound on waiting for something that must happen; never a speed assertion

CFG = ChannelConfig(
    heartbeat_interval_s=0.1,
    stall_timeout_s=0.2,
    resend_timeout_min_s=0.05,
    reconnect_interval_s=0.02,
    reconnect_interval_max_s=0.2,
    linger_s=0.1,
    send_timeout_s=1.0,
)


# ---- the streams ------------------------------------------------------------------------------


def test_an_out_stream_releases_what_is_acknowledged_and_moves_its_floor() -> None:
    out = OutStream()
    held = [out.add(Leave(site_id="eu", reason=str(i))) for i in range(5)]
    assert [h.rseq for h in held] == [1, 2, 3, 4, 5] and out.floor == 0
    assert out.on_ack(2, (4,)) == 3  # 1, 2 and 4
    assert list(out.held) == [3, 5] and out.floor == 2 and out.acked == 3
    assert out.on_ack(1, ()) == 0  # late: nothing more
    assert out.on_ack(9, ()) == 2 and not out.held and out.floor == 5  # 9 was never sent


def test_an_out_stream_gives_up_the_oldest_beyond_its_bounds() -> None:
    out = OutStream()
    for i in range(4):
        out.add(Leave(site_id="eu", reason=str(i))).nbytes = 100
    assert out.abandon(keep=3) == 1 and list(out.held) == [2, 3, 4] and out.floor == 1
    assert out.abandon(keep_bytes=150) == 2 and list(out.held) == [4] and out.floor == 3
    assert out.abandon() == 1 and out.floor == 4 and out.abandoned == 4


def test_an_out_stream_is_due_after_its_timeout_backing_off_per_send() -> None:
    out = OutStream()
    h = out.add(Leave(site_id="eu", reason="x"))
    assert out.due(100.0, lambda _: 1.0) == []  # never out: nothing to time
    h.sent_at, h.sends = 100.0, 1
    assert out.due(100.9, lambda _: 1.0) == [] and out.due(101.0, lambda _: 1.0) == [h]
    h.sends = 3  # two resends without an acknowledgement: four times the timeout
    assert out.due(103.9, lambda _: 1.0) == [] and out.due(104.0, lambda _: 1.0) == [h]
    out.heard_at = 100.5  # the peer spoke after the last send: it is there, and did not ack
    assert out.due(101.0, lambda _: 1.0) == [h]
    out.heard_at = -1.0
    later = out.add(Leave(site_id="eu", reason="y"))
    later.sent_at, later.sends = 100.0, 1  # due, but behind one that is not: it waits
    assert out.due(103.9, lambda _: 1.0) == [] and out.due(104.0, lambda _: 1.0) == [h, later]


def test_an_in_stream_delivers_in_order_and_drops_copies() -> None:
    into: InStream[str] = InStream("s1")
    assert into.offer(1, 0, "a") == ["a"]
    assert into.offer(3, 0, "c") == [] and into.offer(4, 0, "d") == []  # held behind 2
    assert into.ack() == ("s1", 1, (3, 4))
    assert into.offer(3, 0, "c") == [] and into.offer(1, 0, "a") == [] and into.duplicates == 2
    assert into.offer(2, 0, "b") == ["b", "c", "d"] and into.ack() == ("s1", 4, ())
    # The sender gave up 5 and 6: its floor says so, and 7 follows at once.
    assert into.offer(7, 6, "g") == ["g"] and into.ack() == ("s1", 7, ()) and into.skipped == 2


def test_a_floor_releases_what_waited_behind_a_gap_the_sender_gave_up() -> None:
    into: InStream[str] = InStream("s1")
    assert into.offer(2, 0, "b") == [] and into.offer(4, 0, "d") == []
    # 1 and 3 were given up: 2 goes, then 4, then 5.
    assert into.offer(5, 3, "e") == ["b", "d", "e"] and into.skipped == 2


def test_an_in_stream_full_behind_a_gap_drops_the_newest_unacknowledged_and_never_skips() -> None:
    into: InStream[int] = InStream("s1", max_pending=3)
    assert [into.offer(r, 0, r) for r in (2, 3, 4)] == [[], [], []]
    assert into.offer(5, 0, 5) == [] and into.refused == 1 and into.skipped == 0
    assert into.ack() == ("s1", 0, (2, 3, 4))  # 5 is not acknowledged: its sender resends it
    assert into.offer(1, 0, 1) == [1, 2, 3, 4]  # the missing one still counts
    assert into.offer(5, 0, 5) == [5] and into.skipped == 0


def test_an_in_stream_holds_behind_a_gap_only_the_bytes_it_is_given_room_for() -> None:
    into: InStream[str] = InStream("s1")
    assert into.offer(2, 0, "b", nbytes=600, room=1000) == [] and into.pending_bytes == 600
    assert into.offer(3, 0, "c", nbytes=600, room=400) == [] and into.refused == 1
    assert into.pending_bytes == 600 and into.ack() == ("s1", 0, (2,))
    # The next in order is never refused, whatever its size: it is delivered, not held.
    assert into.offer(1, 0, "a", nbytes=10**9, room=0) == ["a", "b"] and into.pending_bytes == 0


def test_the_resend_timeout_grows_with_the_round_trip_size_and_ack_delay() -> None:
    base = {"rtt_s": 0.1, "goodput_bps": 8e6, "nbytes": 1_000_000, "ack_delay_s": 0.5}
    assert resend_timeout_s(**base, floor_s=0.0) == pytest.approx(0.2 + 1.0 + 0.5)
    assert resend_timeout_s(**base, floor_s=5.0) == 5.0


def test_every_message_that_carries_round_state_must_arrive() -> None:
    assert {RoundStart, Global, Join, InitParams, SyncRequest, Leave} <= MUST_ARRIVE
    assert Heartbeat not in MUST_ARRIVE


# ---- the wire ---------------------------------------------------------------------------------


def test_the_header_carries_delivery_and_acknowledgement() -> None:
    frames = to_wire(
        Leave(site_id="eu", reason="x"),
        session="s",
        seq=3,
        delivery=(7, 5),
        ack=("peer", 4, (6, 9)),
    )
    msg, env = from_wire_envelope(frames)
    assert msg == Leave(site_id="eu", reason="x")
    assert env.delivery == (7, 5) and env.ack == ("peer", 4, (6, 9))
    plain = from_wire_envelope(to_wire(Leave(site_id="eu", reason="x")))[1]
    assert plain.delivery is None and plain.ack is None


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"r": [3, 3]}, "floor 3 >= number 3"),
        ({"r": [3]}, "delivery must be"),
        ({"r": [-1, 0]}, "delivery number"),
        ({"a": ["s", 1]}, "ack must be"),
        ({"a": ["s", 1, list(range(300))]}, "at most 256"),
        ({"a": ["s", True, []]}, "header ack must be an int"),
        ({"a": [1, 1, []]}, "ack session"),
        ({"x": 1}, "header keys"),
    ],
)
def test_a_malformed_delivery_header_is_refused_naming_the_field(
    extra: dict[str, Any], why: str
) -> None:
    frames = to_wire(Leave(site_id="eu", reason="x"), session="s", seq=1)
    header = msgpack.unpackb(frames[0], raw=False)
    frames[0] = msgpack.packb({**header, **extra}, use_bin_type=True)
    with pytest.raises(WireError, match=why):
        from_wire_envelope(frames)


# ---- real channels ----------------------------------------------------------------------------


class _Pair:
    """A ROUTER and a DEALER; the dealer talks through ``emulator`` when one is given."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.router = RouterChannel(CFG, context=ctx)
        self.endpoint = self.router.bind("tcp://127.0.0.1:0")
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.dealer = DealerChannel(CFG, identity="eu", context=ctx)
        self.router.faults = self.faults = WireFaults()
        self.got: list[Message] = []  # what the dealer received, heartbeat echoes aside
        self.up: list[Message] = []  # what the router received, heartbeats aside
        self.emulator: LinkEmulator | None = None
        self.peer = b""

    def connect(self, endpoint: str) -> None:
        self.dealer.connect(endpoint)
        self.dealer.send(Heartbeat(site_id="eu", global_version=0, sent_at=0.0))
        got = self.router.recv(WAIT_S)
        assert got is not None
        self.peer = got[0]

    def drive(self, until: Any, *, beat: bool = True) -> None:
        """Run both ends from this thread until ``until()``; the dealer sends a heartbeat every
        ``heartbeat_interval_s`` (its acknowledgements ride on them) and the router echoes it."""
        deadline = time.monotonic() + WAIT_S
        next_beat = 0.0
        while not until():
            assert time.monotonic() < deadline, "never happened"
            now = time.monotonic()
            if beat and now >= next_beat:
                self.dealer.send(Heartbeat(site_id="eu", global_version=0, sent_at=now))
                next_beat = now + CFG.heartbeat_interval_s
            got = self.router.recv(0.005)
            if got is not None and isinstance(got[1], Heartbeat):
                self.router.notify(got[0], got[1])
            elif got is not None:
                self.up.append(got[1])
            msg = self.dealer.recv(0.005)
            if msg is not None and not isinstance(msg, Heartbeat):
                self.got.append(msg)

    def close(self) -> None:
        self.dealer.close(flush_timeout_s=0)
        self.router.close(flush_timeout_s=0)


@pytest.fixture
def pair() -> Iterator[_Pair]:
    ctx: zmq.Context[Any] = zmq.Context()
    made = _Pair(ctx)
    try:
        made.connect(made.endpoint)
        yield made
    finally:
        made.close()
        ctx.destroy(linger=0)


@pytest.fixture
def wan_pair() -> Iterator[_Pair]:
    """The pair through an emulated link of 40 ms each way."""
    ctx: zmq.Context[Any] = zmq.Context()
    made = _Pair(ctx)
    emulator = LinkEmulator("127.0.0.1", made.port, profile=LinkProfile(rate_bps=1e9, delay_ms=40))
    made.emulator = emulator
    try:
        emulator.start()
        made.connect(emulator.endpoint)
        yield made
    finally:
        made.close()
        emulator.close()
        ctx.destroy(linger=0)


def _big(seed: int, nbytes: int = 2 << 20) -> InitParams:
    values = np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)
    return InitParams(
        site_id="eu", model_fingerprint=f"fp{seed}", payload=(Fp32Codec().encode("w", values),)
    )


@pytest.mark.timeout(60)
def test_a_message_lost_after_accept_is_sent_again_when_its_ack_is_late(wan_pair: _Pair) -> None:
    p = wan_pair
    p.faults.lose_next(SyncRequest)
    msg = SyncRequest(site_id="eu", global_version=3)
    assert p.router.send(p.peer, msg)  # accepted, then lost on the way
    p.drive(lambda: bool(p.got))
    assert p.got == [msg] and p.faults.lost == [(p.peer, "SyncRequest")]
    assert p.router.stats.messages_resent >= 1
    p.drive(lambda: not p.router.out_streams[p.peer].held)  # acknowledged at last
    assert p.got == [msg]  # and only once


@pytest.mark.timeout(60)
def test_a_stalled_transfer_given_up_is_sent_again_with_what_queued_behind_it(
    wan_pair: _Pair,
) -> None:
    p = wan_pair
    p.faults.stall_next(InitParams)
    big, after = _big(1), Leave(site_id="eu", reason="behind the big one")
    assert p.router.send(p.peer, big) and p.router.send(p.peer, after)
    p.drive(lambda: len(p.got) == 2)
    assert [type(m) for m in p.got] == [InitParams, Leave]  # in the order sent
    assert p.got[1] == after
    assert np.array_equal(
        Fp32Codec().decode(p.got[0].payload[0]),  # type: ignore[attr-defined]
        Fp32Codec().decode(big.payload[0]),
    )
    stats = p.router.stats
    assert stats.messages_dropped == 2 and stats.messages_resent == 2  # given up, then resent


@pytest.mark.timeout(60)
def test_a_resend_whose_original_arrived_is_dropped_by_the_receiver(pair: _Pair) -> None:
    p = pair
    msg = Leave(site_id="eu", reason="once")
    assert p.router.send(p.peer, msg)
    # The dealer acknowledges nothing (no heartbeats): the router sends it again, and again.
    p.drive(lambda: p.router.stats.messages_resent >= 2, beat=False)
    p.drive(lambda: p.dealer.stats.duplicates_dropped >= 2, beat=False)
    assert p.got == [msg]
    p.drive(lambda: not p.router.out_streams[p.peer].held)  # the heartbeats acknowledge it
    assert p.got == [msg]


@pytest.mark.timeout(60)
def test_both_directions_are_numbered_and_acknowledged_at_once(pair: _Pair) -> None:
    p = pair
    p.faults.lose_next(Join)
    down = Join(site_id="eu", model_fingerprint="fp", global_version=-1, state_hash="")
    up = Leave(site_id="eu", reason="up")
    assert p.router.send(p.peer, down)  # lost: sent again when the heartbeats carry no ack
    p.dealer.send(up)
    p.drive(
        lambda: (
            bool(p.got and p.up)
            and not p.dealer.out_streams[b"coordinator"].held
            and not p.router.out_streams[p.peer].held
        )
    )
    assert p.got == [down] and p.up == [up]


@pytest.mark.timeout(60)
def test_what_failed_to_reach_a_peer_goes_once_the_peer_is_heard_from(wan_pair: _Pair) -> None:
    p = wan_pair
    assert p.emulator is not None
    p.emulator.set_down(True)
    p.emulator.cut()
    beat = Heartbeat(site_id="eu", global_version=0, sent_at=0.0)
    deadline = time.monotonic() + WAIT_S
    while p.router.notify(p.peer, beat):  # until the router knows the connection is gone
        assert time.monotonic() < deadline, "the router never saw the connection drop"
        p.router.recv(0.01)
    msg = Leave(site_id="eu", reason="while away")
    assert p.router.send(p.peer, msg)  # not connected, but held: it will arrive
    held = p.router.out_streams[p.peer].held
    assert [h.failed for h in held.values()] == [True]
    p.emulator.set_down(False)
    p.drive(lambda: bool(p.got))  # the dealer reconnects; its first heartbeat brings msg
    assert p.got == [msg]


@pytest.mark.timeout(60)
def test_an_acknowledgement_of_an_earlier_session_releases_nothing(pair: _Pair) -> None:
    p = pair
    p.faults.lose_next(Leave)
    assert p.router.send(p.peer, Leave(site_id="eu", reason="x"))
    stream = p.router.out_streams[p.peer]
    p.router._on_delivery_ack(p.peer, ("an-earlier-session", 5, ()))
    assert list(stream.held) == [1]
    p.router._on_delivery_ack(p.peer, (p.router.session, 1, ()))
    assert not stream.held


# ---- a coordinator ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_plan_lost_after_accept_reaches_the_site_without_a_deadline() -> None:
    with running() as h:  # heartbeat timeout 10 s, round deadline far off
        chan = h.coord.post.chan
        assert chan is not None
        chan.faults = faults = WireFaults()
        eu, us = h.site("eu"), h.site("us")
        assert join(h, eu).need_init
        eu.send(
            InitParams(
                site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
            )
        )
        faults.lose_next(RoundStart, peer=h.coord.members["eu"].peer)
        join(h, us)
        plans: dict[str, RoundStart] = {}
        beat = Heartbeat(site_id="", global_version=0, sent_at=1.0)

        def both_planned() -> bool:
            for site in (eu, us):
                site.send(replace(beat, site_id=site.site_id))
                msg = site.chan.recv(0.0)
                while msg is not None:
                    if isinstance(msg, RoundStart):
                        plans[site.site_id] = msg
                    msg = site.chan.recv(0.0)
            return len(plans) == 2

        deadline = time.monotonic() + WAIT_S
        while not both_planned():
            assert time.monotonic() < deadline, f"plans: {sorted(plans)}"
            h.coord.step(0.005)
        assert faults.lost == [(h.coord.members["eu"].peer, "RoundStart")]
        assert plans["eu"].round_id == plans["us"].round_id == 1
        assert chan.stats.messages_resent >= 1  # the channel sent it again


@pytest.mark.timeout(60)
def test_numbers_are_never_reused_for_a_peer_forgotten_and_back(pair: _Pair) -> None:
    p = pair
    first, second = Leave(site_id="eu", reason="1"), Leave(site_id="eu", reason="2")
    assert p.router.send(p.peer, first)
    p.drive(lambda: bool(p.got) and not p.router.out_streams[p.peer].held)
    p.router.forget(p.peer)  # timed out, say, while the site process lives on
    assert p.router.send(p.peer, second)  # a copy of number 1 to the site, were it renumbered
    p.drive(lambda: len(p.got) == 2)
    assert p.got == [first, second] and p.dealer.stats.duplicates_dropped == 0


@pytest.mark.timeout(60)
def test_a_join_starts_the_stream_afresh_and_is_not_held_behind_a_gap(pair: _Pair) -> None:
    p = pair
    p.faults.lose_next(Leave)
    assert p.router.send(p.peer, Leave(site_id="eu", reason="lost, never resent"))
    join_msg = Join(site_id="eu", model_fingerprint="fp", global_version=-1, state_hash="")
    assert p.router.send(p.peer, join_msg)  # gives up what was held: the lost one is void
    p.drive(lambda: bool(p.got), beat=False)  # no acknowledgement, so no resend either
    assert p.got == [join_msg] and p.router.stats.messages_abandoned == 1
