"""Federation keys and the ZAP handler: certificates, revocation, file modes, and real CURVE
sockets on loopback (a ROUTER configured as ``comm.transport`` configures it, DEALER clients)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.utils.monitor as zmon
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security import legacy
from comm.security.certs import (
    CURVE_KEY_OID,
    Certificate,
    load_ca_certificate,
    make_site_certificate,
)
from comm.security.common import (
    CA_CERT,
    CA_KEY,
    CERTS_DIR,
    COORDINATOR_CURVE_KEY,
    COORDINATOR_CURVE_PUB,
    COORDINATOR_SIGN_KEY,
    CRL,
    MANIFEST,
    SITE_CERT,
    SITE_CURVE_KEY,
    SITE_CURVE_PUB,
    SITE_TOML,
    SITES_DIR,
    AuthError,
    _b64,
    curve_raw,
    key_fingerprint,
)
from comm.security.crl import load_revocations, parse_revocations
from comm.security.kits import (
    SecurityConfig,
    init_kit,
    issue_site,
    issued_certificates,
    load_coordinator_kit,
    load_site_kit,
    revoke_site,
)
from comm.security.migrate import migrate_kit
from comm.security.registry import CertificateRegistry
from comm.security.signing import (
    blob_digest,
    generate_signing_key,
    load_private_key,
    sign_blob,
    verify_blob,
    verify_digest,
)
from comm.security.zap import DOMAIN, ZapHandler, decide, peer_of
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.frames import from_wire
from comm.wire.schema import Leave
from crossdc import cli

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


def _ca(kit: Path) -> Ed25519PublicKey:
    return load_ca_certificate(kit / CA_CERT).public_key


def _tampered(cert: Certificate, old: bytes, new: bytes) -> Certificate:
    """The certificate with bytes inside its signed part replaced (the signature kept)."""
    assert len(old) == len(new) and cert.der.count(old) == 1
    return Certificate.from_x509(x509.load_der_x509_certificate(cert.der.replace(old, new)))


# ----------------------------------------------------------------------------- keys and certs


@pytest.mark.timeout(30)
def test_issue_and_verify_auth(kit: Path) -> None:
    issued = issue_site(kit, "eu", 30)
    site = load_site_kit(issued.site_kit_dir, site_id="eu")
    ca = _ca(kit)
    site.certificate.verify(ca, NOW, site_id="eu")
    assert site.certificate == issued.certificate
    assert site.curve.server_public == (kit / COORDINATOR_CURVE_PUB).read_bytes().strip()
    assert zmq.curve_public(site.curve.secret) == site.certificate.curve_public
    # The kit's certificate round-trips through PEM and the coordinator's copy.
    assert Certificate.from_pem(issued.certificate.to_pem()) == issued.certificate
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
    ca = _ca(kit)
    cert = issued.certificate
    forged = _tampered(cert, b"\x0c\x02eu", b"\x0c\x02us")  # the subject's CN
    assert forged.site_id == "us"
    with pytest.raises(AuthError) as exc:
        forged.verify(ca, NOW)
    assert _reason(exc) == "bad_signature"
    other_key = zmq.curve_keypair()[0]
    with pytest.raises(AuthError, match="subject public key differ") as exc:
        _tampered(cert, cert.curve_public, other_key)  # the CURVE key extension alone
    assert _reason(exc) == "bad_signature"
    flipped = _tampered(cert, cert.der[-8:], bytes([cert.der[-8] ^ 1]) + cert.der[-7:])
    with pytest.raises(AuthError) as exc:
        flipped.verify(ca, NOW)
    assert _reason(exc) == "bad_signature"
    other_ca = _ca(init_kit(tmp_path / "other"))
    with pytest.raises(AuthError) as exc:
        cert.verify(other_ca, NOW)
    assert _reason(exc) == "bad_signature"
    for garbage in (b"", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"):
        with pytest.raises(AuthError) as exc:
            Certificate.from_pem(garbage)
        assert _reason(exc) == "bad_signature"
    with pytest.raises(AuthError, match="not a crossdc site certificate"):
        Certificate.from_pem((kit / CA_CERT).read_bytes())  # a CA, with no CURVE key
    # A certificate for another key, signed by another CA, dropped into certs/ is skipped.
    forged_key = zmq.curve_keypair()[0]
    stranger = make_site_certificate(
        load_private_key(tmp_path / "other" / CA_KEY),
        site_id="us",
        curve_public=forged_key,
        not_before=int(NOW) - 60,
        not_after=int(NOW + DAY),
        serial="ab" * 16,
    )
    (kit / CERTS_DIR / f"us-{stranger.serial}.pem").write_bytes(stranger.to_pem())
    with pytest.raises(AuthError) as exc:
        CertificateRegistry.from_kit(kit).authorize(forged_key, NOW)
    assert _reason(exc) == "unknown_key"


@pytest.mark.timeout(30)
def test_site_certificate_is_x509_with_the_curve_key(kit: Path) -> None:
    cert = issue_site(kit, "eu", 30).certificate
    parsed = x509.load_pem_x509_certificate(cert.to_pem())
    assert parsed.subject.rfc4514_string() == "CN=eu"
    assert parsed.issuer == load_ca_certificate(kit / CA_CERT).name
    assert f"{parsed.serial_number:032x}" == cert.serial
    assert int(parsed.not_valid_after_utc.timestamp()) == cert.not_after
    extension = parsed.extensions.get_extension_for_oid(CURVE_KEY_OID)
    assert not extension.critical  # other tools must not reject the certificate for it
    assert extension.value.value[2:] == cert.curve_public
    assert parsed.extensions.get_extension_for_class(x509.KeyUsage).value.key_agreement


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_openssl_verifies_issued_and_rejects_revoked(kit: Path) -> None:
    """Standard PKI tools read the kit: openssl accepts an issued site certificate against the
    CA, and with the CRL rejects a revoked one (and still accepts the others)."""
    eu = issue_site(kit, "eu", 30).site_kit_dir / SITE_CERT
    us = issue_site(kit, "us", 30).site_kit_dir / SITE_CERT
    revoke_site(kit, "us")

    def openssl(*args: str | Path) -> subprocess.CompletedProcess[str]:
        argv = ["openssl", *map(str, args)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)

    ca, crl = kit / CA_CERT, kit / CRL
    for site in (eu, us):
        done = openssl("verify", "-CAfile", ca, site)
        assert done.returncode == 0 and done.stdout.strip() == f"{site}: OK", done.stderr
    assert openssl("verify", "-crl_check", "-CAfile", ca, "-CRLfile", crl, eu).returncode == 0
    refused = openssl("verify", "-crl_check", "-CAfile", ca, "-CRLfile", crl, us)
    assert refused.returncode != 0
    assert "certificate revoked" in refused.stdout + refused.stderr
    shown = openssl("x509", "-in", eu, "-noout", "-text").stdout
    assert "Subject: CN = eu" in shown and "X25519" in shown
    assert (kit / SITES_DIR / "eu" / SITE_CURVE_PUB).read_text().strip() in shown
    assert "CA:TRUE" in openssl("x509", "-in", ca, "-noout", "-text").stdout
    other = init_kit(kit.parent / "other") / CA_CERT
    assert openssl("verify", "-CAfile", other, eu).returncode != 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_certificate_issued_by_openssl_from_the_ca_key_is_accepted(kit: Path) -> None:
    """Another PKI can issue site certificates from ca.key, under its own CA certificate for
    that key: a certificate of crossdc's shape made by openssl is trusted by the coordinator's
    registry and verifies like our own."""
    while True:  # a key whose Z85 text needs no quoting in an openssl config file
        public, _secret = zmq.curve_keypair()
        if not any(c in public.decode() for c in '$#"\\;'):
            break
    spki = x25519.X25519PublicKey.from_public_bytes(curve_raw(public)).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (kit / "site-key.pem").write_bytes(spki)
    (kit / "ext.cnf").write_text(
        "basicConstraints = critical,CA:FALSE\n"
        "keyUsage = critical,keyAgreement\n"
        f"{CURVE_KEY_OID.dotted_string} = ASN1:UTF8String:{public.decode()}\n"
    )
    # The PKI's own CA certificate for the same key, under its own name.
    ca_cert = kit / "corp-ca.pem"
    made = subprocess.run(
        ["openssl", "req", "-new", "-x509", "-key", str(kit / CA_KEY), "-subj", "/CN=Corp CA"]
        + ["-days", "365", "-addext", "basicConstraints=critical,CA:TRUE", "-out", str(ca_cert)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert made.returncode == 0, made.stderr
    out = kit / CERTS_DIR / "eu-openssl.pem"
    argv = ["openssl", "x509", "-new", "-force_pubkey", str(kit / "site-key.pem")]
    argv += ["-subj", "/CN=eu", "-CA", str(ca_cert), "-CAkey", str(kit / CA_KEY)]
    argv += ["-days", "30", "-set_serial", "0x1234abcd", "-extfile", str(kit / "ext.cnf")]
    done = subprocess.run([*argv, "-out", str(out)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca_cert), str(out)], capture_output=True, timeout=30
    )
    assert verified.returncode == 0, verified.stderr
    cert = CertificateRegistry.from_kit(kit).authorize(public, NOW)
    assert (cert.site_id, cert.serial) == ("eu", f"{0x1234ABCD:032x}")
    cert.verify(_ca(kit), NOW, site_id="eu")
    assert load_ca_certificate(ca_cert).public_key == _ca(kit)


@pytest.mark.timeout(30)
def test_expired_and_not_yet_valid_certificates(kit: Path) -> None:
    ca = _ca(kit)
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
    ca = _ca(kit)
    first = issue_site(kit, "eu", 30).certificate
    second = issue_site(kit, "eu", 30, out_dir=kit / "eu-renewed").certificate
    issue_site(kit, "us", 30)
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    assert registry.authorize(first.curve_public, NOW).site_id == "eu"
    assert sorted(revoke_site(kit, "eu")) == sorted([first.serial, second.serial])
    assert revoke_site(kit, "eu") == []  # idempotent
    revocations = load_revocations(kit / CRL, ca)
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
def test_revocation_list_is_signed_and_never_rolls_back(kit: Path, tmp_path: Path) -> None:
    ca = _ca(kit)
    eu = issue_site(kit, "eu", 30).certificate
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    before = (kit / CRL).read_bytes()
    revoke_site(kit, "eu")
    after = (kit / CRL).read_bytes()
    # The same CRL signed by another CA, or with its signature broken, does not parse.
    other = init_kit(tmp_path / "other")
    der = x509.load_pem_x509_crl(after).public_bytes(serialization.Encoding.DER)
    broken = x509.load_der_x509_crl(der[:-1] + bytes([der[-1] ^ 1]))
    for text in (
        (other / CRL).read_bytes(),
        broken.public_bytes(serialization.Encoding.PEM),
        b"not a CRL",
    ):
        with pytest.raises(AuthError) as exc:
            parse_revocations(text, ca)
        assert _reason(exc) == "bad_signature"
    with pytest.raises(AuthError) as exc:
        registry.authorize(eu.curve_public, NOW)
    assert _reason(exc) == "revoked"
    # Putting back the older (validly signed) list, or deleting it, does not un-revoke.
    (kit / CRL).write_bytes(before)
    registry.reload()
    assert eu.serial in registry.revoked_serials
    (kit / CRL).unlink()
    registry.reload()
    assert eu.serial in registry.revoked_serials


@pytest.mark.timeout(30)
def test_wrong_site_certificate(kit: Path) -> None:
    ca = _ca(kit)
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
    public = [kit / CA_CERT, kit / CRL, issued.site_kit_dir / SITE_CERT]
    for path in public:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    # No key material in the manifest, and a loosened private key file is refused.
    manifest = (kit / MANIFEST).read_text()
    assert "PRIVATE" not in manifest
    assert (kit / COORDINATOR_CURVE_KEY).read_bytes().strip() not in manifest.encode()
    os.chmod(kit / COORDINATOR_SIGN_KEY, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_coordinator_kit(kit)


def _seal(kind: str, body: dict[str, Any], key: Ed25519PrivateKey) -> str:
    """A format-1 one-line document, as kits before X.509 held them."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    signature = key.sign(kind.encode() + b"\0" + raw)
    return f"{kind}.{_b64(raw)}.{_b64(signature)}"


def _as_format1(kit: Path) -> None:
    """Rewrite a kit the way crossdc laid kits out before X.509 (format 1)."""
    ca = load_private_key(kit / CA_KEY)
    fingerprint = key_fingerprint(ca.public_key())
    public_pem = ca.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    revocations = load_revocations(kit / CRL, ca.public_key())
    revoked = [
        {"serial": e.serial, "site_id": "x", "revoked_at": e.revoked_at}
        for e in revocations.entries
    ]
    body = {"v": 1, "version": revocations.version, "issued_at": 1, "revoked": revoked}
    (kit / legacy.REVOCATIONS).write_text(_seal(legacy.REVOCATIONS_KIND, body, ca) + "\n")

    def old_cert(cert: Certificate) -> str:
        body = {
            "v": 1,
            "site_id": cert.site_id,
            "curve_public": cert.curve_public.decode(),
            "not_before": cert.not_before,
            "not_after": cert.not_after,
            "serial": cert.serial,
            "issuer": fingerprint,
        }
        return _seal(legacy.CERT_KIND, body, ca) + "\n"

    for cert in issued_certificates(kit):
        (kit / CERTS_DIR / f"{cert.site_id}-{cert.serial}.cert").write_text(old_cert(cert))
        (kit / CERTS_DIR / f"{cert.site_id}-{cert.serial}.pem").unlink()
    for site_dir in [*(kit / SITES_DIR).iterdir(), *kit.parent.glob("shipped-*")]:
        cert = Certificate.from_pem((site_dir / SITE_CERT).read_bytes())
        (site_dir / legacy.SITE_CERT).write_text(old_cert(cert))
        (site_dir / legacy.CA_PUB).write_bytes(public_pem)
        (site_dir / SITE_CERT).unlink()
        (site_dir / CA_CERT).unlink()
    (kit / legacy.CA_PUB).write_bytes(public_pem)
    for name in (CA_CERT, CRL):
        (kit / name).unlink()
    manifest = json.loads((kit / MANIFEST).read_text())
    (kit / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))


@pytest.mark.timeout(60)
def test_format1_kits_are_refused_clearly_and_migrate_keeping_identities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kit = init_kit(tmp_path / "kit")
    eu = issue_site(kit, "eu", 30).certificate
    shipped = issue_site(kit, "us", 30, out_dir=tmp_path / "shipped-us").certificate
    gone = issue_site(kit, "gone", 30).certificate
    revoke_site(kit, "gone")
    _as_format1(kit)
    for load in (load_coordinator_kit, CertificateRegistry.from_kit):
        with pytest.raises(ValueError, match="format-1 kit.*crossdc keys migrate"):
            load(kit)
    with pytest.raises(ValueError, match="format-1 kit.*crossdc keys migrate"):
        issue_site(kit, "ap", 30)
    with pytest.raises(ValueError, match="format-1 site kit.*site.pem"):
        load_site_kit(tmp_path / "shipped-us")
    before = sorted(p.name for p in (kit / CERTS_DIR).iterdir())

    assert cli.main(["keys", "migrate", "--kit", str(kit), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["certificates"] == 3 and report["revoked_serials"] == [gone.serial]
    assert sorted(p.name for p in (kit / "format1-backup" / CERTS_DIR).iterdir()) == before
    # Same keys, serials and validity; the revoked one stays revoked; the CA key is the same.
    registry = CertificateRegistry.from_kit(kit)
    for cert in (eu, shipped):
        again = registry.authorize(cert.curve_public, NOW)
        assert (again.site_id, again.serial, again.not_after) == (
            cert.site_id,
            cert.serial,
            cert.not_after,
        )
    with pytest.raises(AuthError) as exc:
        registry.authorize(gone.curve_public, NOW)
    assert _reason(exc) == "revoked"
    assert load_site_kit(kit / SITES_DIR / "eu", site_id="eu").certificate.serial == eu.serial
    # A kit already shipped gets the two files migrate wrote for its site, and loads.
    for path in report["site_files"]["us"]:
        shutil.copy(path, tmp_path / "shipped-us" / Path(path).name)
    assert load_site_kit(tmp_path / "shipped-us", site_id="us").certificate.serial == shipped.serial
    issue_site(kit, "ap", 30)  # a migrated kit issues X.509 certificates
    with pytest.raises(ValueError, match="only format-1 kits migrate"):
        migrate_kit(kit)
    assert cli.main(["keys", "migrate", "--kit", str(kit)]) == 2
    assert "only format-1" in capsys.readouterr().err


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
