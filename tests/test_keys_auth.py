"""Federation keys and the ZAP handler: certificates, revocation, file modes, and real CURVE
sockets on loopback (a ROUTER configured as ``comm.transport`` configures it, DEALER clients)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.utils.monitor as zmon

from comm.security.certs import Certificate, load_revocations, parse_revocations
from comm.security.common import (
    CA_KEY,
    CA_PUB,
    CERTS_DIR,
    COORDINATOR_CURVE_KEY,
    COORDINATOR_CURVE_PUB,
    COORDINATOR_SIGN_KEY,
    MANIFEST,
    REVOCATIONS,
    SITE_CERT,
    SITE_CURVE_KEY,
    SITE_CURVE_PUB,
    SITE_TOML,
    SITES_DIR,
    AuthError,
    _b64,
    _canonical,
    _unb64,
    curve_raw,
    key_fingerprint,
)
from comm.security.kits import (
    SecurityConfig,
    init_kit,
    issue_site,
    issued_certificates,
    load_coordinator_kit,
    load_site_kit,
    revoke_site,
)
from comm.security.registry import CertificateRegistry
from comm.security.signing import (
    blob_digest,
    generate_signing_key,
    load_public_key,
    sign_blob,
    verify_blob,
    verify_digest,
)
from comm.security.zap import DOMAIN, ZapHandler, decide, peer_of
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.frames import from_wire
from comm.wire.schema import Leave

DAY = 86400.0
NOW = time.time()
"""The tests' "now"; refreshed before each test (below): certificates are issued at the real
time, and the suite may reach this module minutes after collecting it."""


@pytest.fixture(autouse=True)
def _fresh_now() -> None:
    global NOW
    NOW = time.time()


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    return init_kit(tmp_path / "kit")


def _reason(exc: pytest.ExceptionInfo[AuthError]) -> str:
    return exc.value.reason


def _retext(cert_text: str, **body_changes: Any) -> str:
    """A certificate whose body was edited after signing (the signature kept)."""
    kind, body, sig = cert_text.strip().split(".")
    doc = json.loads(_unb64(body))
    doc.update(body_changes)
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return f"{kind}.{_b64(raw)}.{sig}"


# ----------------------------------------------------------------------------- keys and certs


@pytest.mark.timeout(30)
def test_issue_and_verify_auth(kit: Path) -> None:
    issued = issue_site(kit, "eu", 30)
    site = load_site_kit(issued.site_kit_dir, site_id="eu")
    ca = load_public_key(kit / CA_PUB)
    site.certificate.verify(ca, NOW, site_id="eu")
    assert site.certificate == issued.certificate
    assert site.curve.server_public == (kit / COORDINATOR_CURVE_PUB).read_bytes().strip()
    assert zmq.curve_public(site.curve.secret) == site.certificate.curve_public
    # The kit's certificate round-trips through its text form and the coordinator's copy.
    assert Certificate.from_text(issued.certificate.to_text()) == issued.certificate
    [recorded] = issued_certificates(kit)
    assert recorded == issued.certificate
    registry = CertificateRegistry.from_kit(kit)
    assert registry.authorize(site.curve.public, NOW).site_id == "eu"
    assert registry.authorize(curve_raw(site.curve.public), NOW).serial == recorded.serial
    # The starter config names the site and the kit; the kit holds no secret but its own.
    toml = (issued.site_kit_dir / SITE_TOML).read_text()
    assert 'site_id = "eu"' in toml and "[site.security]" in toml
    assert not (issued.site_kit_dir / CA_KEY).exists()


@pytest.mark.timeout(30)
def test_tampered_cert_bad_signature(kit: Path, tmp_path: Path) -> None:
    issued = issue_site(kit, "eu", 30)
    ca = load_public_key(kit / CA_PUB)
    text = issued.certificate.to_text()
    forged = Certificate.from_text(_retext(text, site_id="us"))
    with pytest.raises(AuthError) as exc:
        forged.verify(ca, NOW)
    assert _reason(exc) == "bad_signature"
    longer = Certificate.from_text(_retext(text, not_after=issued.certificate.not_after + 1))
    with pytest.raises(AuthError) as exc:
        longer.verify(ca, NOW)
    assert _reason(exc) == "bad_signature"
    flipped = dataclasses.replace(
        issued.certificate,
        signature=bytes([issued.certificate.signature[0] ^ 1]) + issued.certificate.signature[1:],
    )
    with pytest.raises(AuthError) as exc:
        flipped.verify(ca, NOW)
    assert _reason(exc) == "bad_signature"
    other_ca = load_public_key(init_kit(tmp_path / "other") / CA_PUB)
    with pytest.raises(AuthError) as exc:
        issued.certificate.verify(other_ca, NOW)
    assert _reason(exc) == "bad_signature"
    for garbage in ("", "crossdc-cert-v1.x.y", text.replace("crossdc-cert-v1", "crossdc-cert-v2")):
        with pytest.raises(AuthError) as exc:
            Certificate.from_text(garbage)
        assert _reason(exc) == "bad_signature"
    # A forged certificate dropped into certs/ is skipped: the key stays unknown.
    forged_key = zmq.curve_keypair()[0]
    (kit / CERTS_DIR / "us-forged.cert").write_text(
        _retext(text, site_id="us", curve_public=forged_key.decode())
    )
    with pytest.raises(AuthError) as exc:
        CertificateRegistry.from_kit(kit).authorize(forged_key, NOW)
    assert _reason(exc) == "unknown_key"


@pytest.mark.timeout(30)
def test_expired_and_not_yet_valid_certificates(kit: Path) -> None:
    ca = load_public_key(kit / CA_PUB)
    old = issue_site(kit, "old", 1, now=NOW - 10 * DAY).certificate
    with pytest.raises(AuthError) as exc:
        old.verify(ca, NOW)
    assert _reason(exc) == "expired"
    old.verify(ca, NOW - 10 * DAY + 60)  # it was valid in its day
    future = issue_site(kit, "future", 1, now=NOW + DAY).certificate
    with pytest.raises(AuthError) as exc:
        future.verify(ca, NOW)
    assert _reason(exc) == "not_yet_valid"
    registry = CertificateRegistry.from_kit(kit)
    with pytest.raises(AuthError) as exc:
        registry.authorize(old.curve_public, NOW)
    assert _reason(exc) == "expired"
    with pytest.raises(AuthError) as exc:
        load_site_kit(kit / SITES_DIR / "old", now=NOW)
    assert _reason(exc) == "expired"


@pytest.mark.timeout(30)
def test_revoked_certificate(kit: Path) -> None:
    ca = load_public_key(kit / CA_PUB)
    first = issue_site(kit, "eu", 30).certificate
    second = issue_site(kit, "eu", 30, out_dir=kit / "eu-renewed").certificate
    issue_site(kit, "us", 30)
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    assert registry.authorize(first.curve_public, NOW).site_id == "eu"
    assert sorted(revoke_site(kit, "eu")) == sorted([first.serial, second.serial])
    assert revoke_site(kit, "eu") == []  # idempotent
    revocations = load_revocations(kit / REVOCATIONS, ca)
    assert revocations.serials == {first.serial, second.serial}
    assert revocations.version == 1
    with pytest.raises(AuthError) as exc:
        first.verify(ca, NOW, revoked=revocations.serials)
    assert _reason(exc) == "revoked"
    for cert in (first, second):  # picked up by the running registry without a restart
        with pytest.raises(AuthError) as exc:
            registry.authorize(cert.curve_public, NOW)
        assert _reason(exc) == "revoked"
    with pytest.raises(ValueError, match="no certificate"):
        revoke_site(kit, "nobody")


@pytest.mark.timeout(30)
def test_revocation_list_is_signed_and_never_rolls_back(kit: Path) -> None:
    ca = load_public_key(kit / CA_PUB)
    eu = issue_site(kit, "eu", 30).certificate
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    before = (kit / REVOCATIONS).read_text()
    revoke_site(kit, "eu")
    after = (kit / REVOCATIONS).read_text()
    kind, body, sig = after.strip().split(".")
    doc = json.loads(_unb64(body))
    doc["revoked"] = []
    unrevoked = f"{kind}.{_b64(_canonical(doc))}.{sig}"
    with pytest.raises(AuthError) as exc:
        parse_revocations(unrevoked, ca)
    assert _reason(exc) == "bad_signature"
    with pytest.raises(AuthError) as exc:
        registry.authorize(eu.curve_public, NOW)
    assert _reason(exc) == "revoked"
    # Putting back the older (validly signed) list, or deleting it, does not un-revoke.
    (kit / REVOCATIONS).write_text(before)
    registry.reload()
    assert eu.serial in registry.revoked_serials
    (kit / REVOCATIONS).unlink()
    registry.reload()
    assert eu.serial in registry.revoked_serials


@pytest.mark.timeout(30)
def test_wrong_site_certificate(kit: Path) -> None:
    ca = load_public_key(kit / CA_PUB)
    issued = issue_site(kit, "eu", 30)
    with pytest.raises(AuthError) as exc:
        issued.certificate.verify(ca, NOW, site_id="us")
    assert _reason(exc) == "wrong_site"
    with pytest.raises(AuthError) as exc:
        load_site_kit(issued.site_kit_dir, site_id="us")
    assert _reason(exc) == "wrong_site"
    registry = CertificateRegistry.from_kit(kit)
    cert = issued.certificate
    registry.check_peer(user_id="eu", serial=cert.serial, claimed_site_id="eu", now=NOW)
    with pytest.raises(AuthError) as exc:
        registry.check_peer(user_id="eu", serial=cert.serial, claimed_site_id="us", now=NOW)
    assert _reason(exc) == "wrong_site"


@pytest.mark.timeout(30)
def test_private_key_files_are_0600(kit: Path) -> None:
    issued = issue_site(kit, "eu", 30)
    private = [
        kit / CA_KEY,
        kit / COORDINATOR_CURVE_KEY,
        kit / COORDINATOR_SIGN_KEY,
        issued.site_kit_dir / SITE_CURVE_KEY,
    ]
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in (kit, issued.site_kit_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    public = [kit / CA_PUB, issued.site_kit_dir / SITE_CERT]
    for path in public:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    # No key material in the manifest, and a loosened private key file is refused.
    manifest = (kit / MANIFEST).read_text()
    assert "PRIVATE" not in manifest
    assert (kit / COORDINATOR_CURVE_KEY).read_bytes().strip() not in manifest.encode()
    os.chmod(kit / COORDINATOR_SIGN_KEY, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_coordinator_kit(kit)


@pytest.mark.timeout(30)
def test_init_refuses_overwrite(kit: Path, tmp_path: Path) -> None:
    ca_before = (kit / CA_KEY).read_bytes()
    with pytest.raises(ValueError, match=str(kit)):
        init_kit(kit)
    assert (kit / CA_KEY).read_bytes() == ca_before
    issue_site(kit, "eu", 30)
    with pytest.raises(ValueError, match="refusing to overwrite"):
        issue_site(kit, "eu", 30)
    with pytest.raises(ValueError, match="site_id"):
        issue_site(kit, "eu/../x", 30)
    with pytest.raises(ValueError, match="days"):
        issue_site(kit, "us", 0)
    empty = tmp_path / "empty"
    empty.mkdir()
    init_kit(empty)  # an existing empty directory is fine


@pytest.mark.timeout(30)
def test_signed_checkpoint_blob(kit: Path) -> None:
    coordinator = load_coordinator_kit(kit)
    site = load_site_kit(issue_site(kit, "eu", 30).site_kit_dir)
    blob = os.urandom(4096)
    signature = sign_blob(coordinator.signing_key, blob)
    verify_blob(site.coordinator_sign_public, blob, signature)
    verify_digest(site.coordinator_sign_public, blob_digest(blob), signature)
    for data, sig, context in [
        (blob[:-1] + bytes([blob[-1] ^ 1]), signature, "checkpoint"),
        (blob, signature, "global"),
        (blob, sign_blob(generate_signing_key(), blob), "checkpoint"),
    ]:
        with pytest.raises(AuthError) as exc:
            verify_blob(site.coordinator_sign_public, data, sig, context=context)
        assert _reason(exc) == "bad_signature"


@pytest.mark.timeout(30)
def test_security_config_is_secure_by_default() -> None:
    with pytest.raises(ValueError, match="security.kit_dir"):
        SecurityConfig().require()
    SecurityConfig(insecure=True).require()
    SecurityConfig(kit_dir="kit").require()
    with pytest.raises(ValueError, match="security.insecure"):
        SecurityConfig(kit_dir="kit", insecure=True)


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
    stranger.send(b"let me in")
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
    old.send(b"from the past")
    assert net.next_rejection()[0] == "expired"
    _assert_silent(net, old)


@pytest.mark.timeout(30)
def test_zap_auth_revoked_cert_refused(net: Net) -> None:
    gone = net.site_client("gone")
    gone.send(b"still here?")
    assert net.next_rejection()[0] == "revoked"
    _assert_silent(net, gone)


@pytest.mark.timeout(30)
def test_zap_auth_plain_client_cannot_talk_to_curve_server(net: Net) -> None:
    plain = net.client(None, None)
    plain.send(b"no crypto")
    assert net.handshake_event() == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    _assert_silent(net, plain)
    assert net.zap is not None and net.zap.accepted == 0  # refused before ZAP is asked


@pytest.mark.timeout(30)
def test_zap_auth_without_handler_refuses_everyone(federation: Path) -> None:
    n = Net(federation, with_zap=False)
    try:
        eu = n.site_client("eu")
        eu.send(b"hello")
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
