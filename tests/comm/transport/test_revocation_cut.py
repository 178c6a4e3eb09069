"""Revocation on live connections: a coordinator with a key kit (CURVE + ZAP) on loopback, sites
as real CURVE DEALER channels, and a manual clock that drives the coordinator's sweeps.

Revoking a site cuts its open connection at the first sweep, at most one heartbeat interval
later, removes it as a member, and nothing it sends is handled after; its reconnect is refused
at the handshake. A second connection presenting a member's routing id is never delivered (no
ROUTER_HANDOVER) and is cut once it stayed silent for the heartbeat timeout, after which a site
reconnecting that way gets through.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.rolekits import SecurityConfig, load_site_kit
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import Heartbeat, Leave, Message
from tests.support.coordinator import Harness, ManualClock, join, rejected, running

pytestmark = pytest.mark.timeout(60)

SITES_DIR = "sites"


class CurveSite:
    """A site as the harness helpers use one: ``site_id``, ``chan``, ``send``."""

    def __init__(
        self, h: Harness, kit: Path, site_id: str, routing_id: bytes | None = None
    ) -> None:
        self.site_id = site_id
        keys = load_site_kit(kit / SITES_DIR / site_id).curve
        self.chan = DealerChannel(
            ChannelConfig(curve=keys, linger_s=0.1), identity=site_id, context=h.ctx
        )
        if routing_id is not None:
            self.chan._sock.setsockopt(zmq.ROUTING_ID, routing_id)
            self.chan.routing_id = routing_id
        self.monitor = self.chan._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self.chan.connect(h.coord.endpoint)
        self.events: list[int] = []

    def send(self, msg: Message) -> None:
        self.chan.send(msg)

    def beat(self) -> None:
        self.send(Heartbeat(site_id=self.site_id, global_version=-1, sent_at=1.0))

    def saw(self, event: int) -> bool:
        while self.monitor.poll(0):
            self.events.append(int(recv_monitor_message(self.monitor)["event"]))
        return event in self.events

    def close(self) -> None:
        if self.monitor.closed:
            return
        self.chan._sock.disable_monitor()
        self.monitor.close(linger=0)
        self.chan.close(flush_timeout_s=0)


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    root = init_kit(tmp_path / "kit")
    for site in ("eu", "us"):
        issue_site(root, site, 30)
    return root


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def h(kit: Path, clock: ManualClock) -> Iterator[Harness]:
    with running(clock=clock, security=SecurityConfig(kit_dir=str(kit))) as harness:
        yield harness


@pytest.fixture
def sites(h: Harness, kit: Path) -> Iterator[Callable[..., CurveSite]]:
    made: list[CurveSite] = []

    def make(site_id: str, routing_id: bytes | None = None) -> CurveSite:
        made.append(CurveSite(h, kit, site_id, routing_id))
        return made[-1]

    yield make
    for site in made:
        site.close()


def handled_from(h: Harness) -> list[tuple[bytes, Message]]:
    """Every message the coordinator's intake handles from now on."""
    seen: list[tuple[bytes, Message]] = []
    handle = h.coord.intake.handle

    def recording(peer: bytes, msg: Message) -> None:
        seen.append((peer, msg))
        handle(peer, msg)

    h.coord.intake.handle = recording  # type: ignore[method-assign]
    return seen


def pump(h: Harness, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Step the coordinator (its clock still) until ``cond`` holds: socket I/O, bounded."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        h.coord.step(0.01)


def echoed(h: Harness, site: CurveSite, steps: int = 100) -> bool:
    """``site`` sends a heartbeat: whether the coordinator echoes it within ``steps`` steps."""
    site.beat()
    for _ in range(steps):
        h.coord.step(0.005)
        if isinstance(site.chan.recv(0.0), Heartbeat):
            return True
    return False


def test_revoking_a_site_cuts_its_live_connection_within_one_heartbeat_interval(
    h: Harness, kit: Path, clock: ManualClock, sites: Callable[..., CurveSite]
) -> None:
    eu, us = sites("eu"), sites("us")
    join(h, eu)
    join(h, us)
    assert set(h.coord.members) == {"eu", "us"}
    seen = handled_from(h)
    revoke_site(kit, "us")
    assert h.coord.registry is not None
    h.coord.registry.reload()  # the coordinator knows now (it rereads the kit on its own too)
    # One heartbeat interval later, one tick: us is cut off and no longer a member.
    clock.now += h.coord.cfg.channel.heartbeat_interval_s
    h.coord.step(0.0)
    assert "us" not in h.coord.members and "eu" in h.coord.members
    assert rejected(h.coord, "revoked") == 1.0
    chan = h.coord.chan
    assert chan is not None and chan.connections.cuts == 1
    # Its TCP connection ends (the site sees it), without the clock moving.
    pump(h, lambda: us.saw(zmq.EVENT_DISCONNECTED))
    # It reconnects to send; the handshake is refused and nothing of it is handled.
    us.beat()
    pump(h, lambda: us.saw(zmq.EVENT_HANDSHAKE_FAILED_AUTH))
    for _ in range(50):
        h.coord.step(0.005)
    assert us.chan.recv(0.0) is None
    assert not [m for _, m in seen if getattr(m, "site_id", None) == "us"]
    # The other site is untouched.
    assert echoed(h, eu)


def test_a_message_of_a_revoked_site_is_refused_and_cuts_it_also_after_it_left(
    h: Harness, kit: Path, sites: Callable[..., CurveSite]
) -> None:
    eu, us = sites("eu"), sites("us")
    join(h, eu)
    join(h, us)
    us.send(Leave(site_id="us", reason="maintenance"))
    h.until(lambda: "us" not in h.coord.members)
    assert echoed(h, us)  # the heartbeat that asks for the LEAVE's acknowledgement
    seen = handled_from(h)
    revoke_site(kit, "us")
    assert h.coord.registry is not None
    h.coord.registry.reload()
    # The clock does not move (no sweep): the heartbeat itself is refused and cuts us off.
    assert not echoed(h, us)
    assert seen == []
    assert rejected(h.coord, "revoked") >= 1.0
    pump(h, lambda: us.saw(zmq.EVENT_DISCONNECTED))
    assert echoed(h, eu)


def test_a_second_connection_on_a_members_routing_id_is_never_delivered(
    h: Harness, clock: ManualClock, sites: Callable[..., CurveSite]
) -> None:
    eu = sites("eu")
    join(h, eu)
    peer = h.coord.members["eu"].peer
    seen = handled_from(h)
    # Another holder of eu's key that learnt eu's routing id: it does not take eu's place.
    thief = sites("eu", routing_id=eu.chan.routing_id)
    assert not echoed(h, thief)
    assert echoed(h, eu)
    assert [m for _, m in seen if isinstance(m, Heartbeat)] == [
        Heartbeat(site_id="eu", global_version=-1, sent_at=1.0)
    ]
    assert h.coord.members["eu"].peer == peer
    # The original connection ends; the one held apart is cut once it stayed silent for the
    # heartbeat timeout, and reconnecting, it gets through (as a site that reconnected before
    # its previous connection was seen to end).
    eu.close()
    beat = Heartbeat(site_id="coordinator", global_version=-1, sent_at=1.0)
    pump(h, lambda: not h.coord.post.probe(peer, beat))  # the socket saw eu's connection end
    clock.now += h.coord.cfg.channel.heartbeat_timeout_s
    h.coord.step(0.0)
    pump(h, lambda: thief.saw(zmq.EVENT_DISCONNECTED))
    pump(h, lambda: echoed(h, thief, steps=20))
