"""The ZAP handler: its decisions on raw requests, and real CURVE sockets on loopback (a ROUTER
configured as ``comm.transport`` configures it, DEALER clients)."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.utils.monitor as zmon

from comm.security.common import (
    SITE_CURVE_KEY,
    SITE_CURVE_PUB,
    SITES_DIR,
    AuthError,
    curve_raw,
    key_fingerprint,
)
from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import load_coordinator_kit, load_site_kit
from comm.security.zap import DOMAIN, ZapHandler, decide, peer_of
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.frames import from_wire
from comm.wire.schema import Leave
from tests.support.keys import DAY

NOW = time.time()
"""The tests' "now"; refreshed before each test (below): certificates are issued at the real
time, and the suite may reach this module minutes after collecting it."""


@pytest.fixture(autouse=True)
def _fresh_now() -> None:
    global NOW
    NOW = time.time()


@pytest.mark.timeout(30)
def test_zap_decide_refuses_non_curve_requests(kit: Path) -> None:
    registry = CertificateRegistry.from_kit(kit)
    key = curve_raw(zmq.curve_keypair()[0])
    base = [b"1.0", b"7", DOMAIN, b"10.0.0.1", b"", b"CURVE", key]
    assert decide(base, registry, now=NOW).reason == "unknown_key"
    assert decide(base[:2] + [b"other"] + base[3:], registry, now=NOW).reason == "bad_request"
    assert decide(base[:5] + [b"PLAIN", b"u", b"p"], registry, now=NOW).reason == "bad_request"
    assert decide(base[:5] + [b"NULL"], registry, now=NOW).reason == "bad_request"
    assert decide([b"2.0", b"7"], registry, now=NOW).status_code == b"500"
    assert decide(base, registry, now=NOW).request_id == b"7"


# ----------------------------------------------------------------------------- CURVE + ZAP


class Net:
    """One zmq.Context with a ZAP handler and a CURVE ROUTER; closes everything it made."""

    def __init__(self, kit: Path, *, with_zap: bool = True) -> None:
        self.kit = kit
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sockets: list[zmq.Socket[Any]] = []
        self.rejections: queue.Queue[tuple[str, str]] = queue.Queue()
        self.registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
        self.zap: ZapHandler | None = None
        if with_zap:
            self.zap = ZapHandler(
                self.ctx, self.registry, on_reject=lambda r, d: self.rejections.put((r, d))
            )
            self.zap.start()
        coordinator = load_coordinator_kit(kit)
        self.server_public = coordinator.curve.public
        router = self.socket(zmq.ROUTER)
        # As comm.transport.profile._apply_profile sets them for a CURVE server.
        router.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        router.setsockopt(zmq.CURVE_PUBLICKEY, coordinator.curve.public)
        router.setsockopt(zmq.CURVE_SECRETKEY, coordinator.curve.secret)
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.monitor = router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        router.bind("tcp://127.0.0.1:*")
        self.endpoint = router.get_string(zmq.LAST_ENDPOINT)
        self.router = router

    def socket(self, kind: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def client(self, public: bytes | None, secret: bytes | None) -> zmq.Socket[Any]:
        dealer = self.socket(zmq.DEALER)
        if public is not None and secret is not None:
            dealer.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            dealer.setsockopt(zmq.CURVE_PUBLICKEY, public)
            dealer.setsockopt(zmq.CURVE_SECRETKEY, secret)
        dealer.connect(self.endpoint)
        return dealer

    def site_client(self, site_id: str) -> zmq.Socket[Any]:
        # Read the keys directly: load_site_kit would refuse the expired and revoked ones.
        site_dir = self.kit / SITES_DIR / site_id
        public = (site_dir / SITE_CURVE_PUB).read_bytes().strip()
        secret = (site_dir / SITE_CURVE_KEY).read_bytes().strip()
        return self.client(public, secret)

    def handshake_event(self, timeout_s: float = 10.0) -> int:
        assert self.monitor.poll(int(timeout_s * 1000)), "no handshake event"
        event: int = zmon.recv_monitor_message(self.monitor)["event"]
        return event

    def next_rejection(self, timeout_s: float = 10.0) -> tuple[str, str]:
        return self.rejections.get(timeout=timeout_s)

    def close(self) -> None:
        if self.zap is not None:
            self.zap.close()
        self.router.disable_monitor()
        self.monitor.close(linger=0)
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def federation(tmp_path: Path) -> Path:
    kit = init_kit(tmp_path / "kit")
    issue_site(kit, "eu", 30)
    issue_site(kit, "us", 30)
    issue_site(kit, "old", 1, now=NOW - 10 * DAY)
    issue_site(kit, "gone", 30)
    revoke_site(kit, "gone")
    return kit


@pytest.fixture
def net(federation: Path) -> Iterator[Net]:
    n = Net(federation)
    try:
        yield n
    finally:
        n.close()


def _send_refused(client: zmq.Socket[Any], data: bytes) -> None:
    """A message from a client whose handshake will be refused: the handshake runs from the
    connect, and once the refusal closed the connection a DEALER has no pipe to queue on, so a
    blocking send would wait for a reconnect that is refused again. Sent if it can be queued."""
    with contextlib.suppress(zmq.Again):
        client.send(data, zmq.NOBLOCK)


def _assert_silent(net: Net, client: zmq.Socket[Any]) -> None:
    """After a refused handshake nothing can cross either way (the refusal already happened)."""
    assert net.router.poll(300) == 0
    assert client.poll(0) == 0


@pytest.mark.timeout(30)
def test_zap_auth_valid_site_exchanges_messages(net: Net) -> None:
    eu = net.site_client("eu")
    eu.send(b"hello from eu")
    assert net.router.poll(10_000)
    routing_id, frame = net.router.recv_multipart(copy=False)
    assert frame.bytes == b"hello from eu"
    peer = peer_of(frame)
    assert peer is not None and peer.site_id == "eu"
    cert = net.registry.authorize(load_site_kit(net.kit / "sites" / "eu").curve.public, NOW)
    assert peer.serial == cert.serial
    net.registry.check_peer(
        user_id=peer.site_id, serial=peer.serial, claimed_site_id="eu", now=time.time()
    )
    net.router.send_multipart([routing_id.bytes, b"welcome eu"])
    assert eu.poll(10_000)
    assert eu.recv() == b"welcome eu"
    assert net.zap is not None and net.zap.accepted >= 1 and not net.zap.rejected


@pytest.mark.timeout(30)
def test_zap_auth_user_id_is_certified_site_and_claims_are_checked(net: Net) -> None:
    eu, us = net.site_client("eu"), net.site_client("us")
    eu.send(b"claim:us")  # eu pretends to be us
    us.send(b"claim:us")
    seen: dict[str, str] = {}
    for _ in range(2):
        assert net.router.poll(10_000)
        _, frame = net.router.recv_multipart(copy=False)
        peer = peer_of(frame)
        assert peer is not None
        claimed = frame.bytes.decode().split(":")[1]
        try:
            net.registry.check_peer(
                user_id=peer.site_id, serial=peer.serial, claimed_site_id=claimed, now=NOW
            )
            seen[peer.site_id] = "ok"
        except AuthError as refused:
            seen[peer.site_id] = refused.reason
    assert seen == {"eu": "wrong_site", "us": "ok"}
    # Revoking a connected site cuts it at its next message, without waiting for a reconnect.
    revoke_site(net.kit, "us")
    us.send(b"claim:us")
    assert net.router.poll(10_000)
    _, frame = net.router.recv_multipart(copy=False)
    peer = peer_of(frame)
    assert peer is not None and peer.site_id == "us"
    with pytest.raises(AuthError) as exc:
        net.registry.check_peer(user_id="us", serial=peer.serial, claimed_site_id="us", now=NOW)
    assert exc.value.reason == "revoked"


@pytest.mark.timeout(30)
def test_zap_auth_unknown_key_refused(net: Net) -> None:
    public, secret = zmq.curve_keypair()
    stranger = net.client(public, secret)
    _send_refused(stranger, b"let me in")
    reason, detail = net.next_rejection()
    assert reason == "unknown_key"
    assert key_fingerprint(public) in detail
    assert public.decode() not in detail and secret.decode() not in detail
    assert net.handshake_event() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    _assert_silent(net, stranger)
    assert net.zap is not None and net.zap.rejected["unknown_key"] >= 1


@pytest.mark.timeout(30)
def test_zap_auth_expired_cert_refused(net: Net) -> None:
    old = net.site_client("old")
    _send_refused(old, b"from the past")
    assert net.next_rejection()[0] == "expired"
    _assert_silent(net, old)


@pytest.mark.timeout(30)
def test_zap_auth_revoked_cert_refused(net: Net) -> None:
    gone = net.site_client("gone")
    _send_refused(gone, b"still here?")
    assert net.next_rejection()[0] == "revoked"
    _assert_silent(net, gone)


@pytest.mark.timeout(30)
def test_zap_auth_plain_client_cannot_talk_to_curve_server(net: Net) -> None:
    plain = net.client(None, None)
    _send_refused(plain, b"no crypto")
    assert net.handshake_event() == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    _assert_silent(net, plain)
    assert net.zap is not None and net.zap.accepted == 0  # refused before ZAP is asked


@pytest.mark.timeout(30)
def test_zap_auth_without_handler_refuses_everyone(federation: Path) -> None:
    n = Net(federation, with_zap=False)
    try:
        eu = n.site_client("eu")
        _send_refused(eu, b"hello")
        assert n.handshake_event() == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        _assert_silent(n, eu)
    finally:
        n.close()


@pytest.mark.timeout(30)
def test_zap_auth_site_kit_drives_the_channel(net: Net) -> None:
    """A site kit's keys plug into ChannelConfig: the real DEALER channel authenticates."""
    site = load_site_kit(net.kit / SITES_DIR / "us")
    chan = DealerChannel(
        ChannelConfig(curve=site.curve, linger_s=0.1), identity="us", context=net.ctx
    )
    try:
        chan.connect(net.endpoint)
        chan.send(Leave(site_id="us", reason="maintenance"))
        assert net.router.poll(10_000)
        _, *frames = net.router.recv_multipart(copy=False)
        peer = peer_of(frames[0])
        assert peer is not None and peer.site_id == "us"
        msg = from_wire([f.buffer for f in frames])
        assert msg == Leave(site_id="us", reason="maintenance")
    finally:
        chan.close()
