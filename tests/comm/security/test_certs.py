"""Federation kits and X.509 certificates: issuing, verifying, tampering, validity, revocation
lists, file modes, refusing to overwrite, signed blobs, and the security config's defaults;
standard tools (openssl) read what the kit writes."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import zmq
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
    check_site_id,
    curve_raw,
)
from comm.security.crl import load_revocations, parse_revocations
from comm.security.kits import init_kit, issue_site, issued_certificates, revoke_site
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import SecurityConfig, load_coordinator_kit, load_site_kit
from comm.security.signing import (
    blob_digest,
    generate_signing_key,
    load_private_key,
    sign_blob,
    verify_blob,
    verify_digest,
)
from tests.support.keys import DAY, auth_reason

NOW = time.time()
"""The tests' "now"; refreshed before each test (below): certificates are issued at the real
time, and the suite may reach this module minutes after collecting it."""


@pytest.fixture(autouse=True)
def _fresh_now() -> None:
    global NOW
    NOW = time.time()


def _ca(kit: Path) -> Ed25519PublicKey:
    return load_ca_certificate(kit / CA_CERT).public_key


def _tampered(cert: Certificate, old: bytes, new: bytes) -> Certificate:
    """The certificate with bytes inside its signed part replaced (the signature kept)."""
    assert len(old) == len(new) and cert.der.count(old) == 1
    return Certificate.from_x509(x509.load_der_x509_certificate(cert.der.replace(old, new)))


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
    assert f'kit_dir = "./{issued.site_kit_dir.name}"' in toml  # where it was written, --out too
    assert not (issued.site_kit_dir / CA_KEY).exists()
    elsewhere = issue_site(kit, "us", 30, out_dir=kit.parent / "us-kit")
    assert 'kit_dir = "./us-kit"' in (elsewhere.site_kit_dir / SITE_TOML).read_text()


@pytest.mark.timeout(30)
def test_tampered_cert_bad_signature(kit: Path, tmp_path: Path) -> None:
    issued = issue_site(kit, "eu", 30)
    ca = _ca(kit)
    cert = issued.certificate
    forged = _tampered(cert, b"\x0c\x02eu", b"\x0c\x02us")  # the subject's CN
    assert forged.site_id == "us"
    with pytest.raises(AuthError) as exc:
        forged.verify(ca, NOW)
    assert auth_reason(exc) == "bad_signature"
    other_key = zmq.curve_keypair()[0]
    with pytest.raises(AuthError, match="subject public key differ") as exc:
        _tampered(cert, cert.curve_public, other_key)  # the CURVE key extension alone
    assert auth_reason(exc) == "bad_signature"
    flipped = _tampered(cert, cert.der[-8:], bytes([cert.der[-8] ^ 1]) + cert.der[-7:])
    with pytest.raises(AuthError) as exc:
        flipped.verify(ca, NOW)
    assert auth_reason(exc) == "bad_signature"
    other_ca = _ca(init_kit(tmp_path / "other"))
    with pytest.raises(AuthError) as exc:
        cert.verify(other_ca, NOW)
    assert auth_reason(exc) == "bad_signature"
    for garbage in (b"", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"):
        with pytest.raises(AuthError) as exc:
            Certificate.from_pem(garbage)
        assert auth_reason(exc) == "bad_signature"
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
    assert auth_reason(exc) == "unknown_key"


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
    # openssl dates the certificate from the second it ran, after NOW: check it at a later time.
    later = time.time() + 1
    cert = CertificateRegistry.from_kit(kit).authorize(public, later)
    assert (cert.site_id, cert.serial) == ("eu", f"{0x1234ABCD:032x}")
    cert.verify(_ca(kit), later, site_id="eu")
    assert load_ca_certificate(ca_cert).public_key == _ca(kit)


@pytest.mark.timeout(30)
def test_expired_and_not_yet_valid_certificates(kit: Path) -> None:
    ca = _ca(kit)
    old = issue_site(kit, "old", 1, now=NOW - 10 * DAY).certificate
    with pytest.raises(AuthError) as exc:
        old.verify(ca, NOW)
    assert auth_reason(exc) == "expired"
    old.verify(ca, NOW - 10 * DAY + 60)  # it was valid in its day
    future = issue_site(kit, "future", 1, now=NOW + DAY).certificate
    with pytest.raises(AuthError) as exc:
        future.verify(ca, NOW)
    assert auth_reason(exc) == "not_yet_valid"
    registry = CertificateRegistry.from_kit(kit)
    with pytest.raises(AuthError) as exc:
        registry.authorize(old.curve_public, NOW)
    assert auth_reason(exc) == "expired"
    with pytest.raises(AuthError) as exc:
        load_site_kit(kit / SITES_DIR / "old", now=NOW)
    assert auth_reason(exc) == "expired"


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
    assert auth_reason(exc) == "revoked"
    for cert in (first, second):  # picked up by the running registry without a restart
        with pytest.raises(AuthError) as exc:
            registry.authorize(cert.curve_public, NOW)
        assert auth_reason(exc) == "revoked"
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
        assert auth_reason(exc) == "bad_signature"
    with pytest.raises(AuthError) as exc:
        registry.authorize(eu.curve_public, NOW)
    assert auth_reason(exc) == "revoked"
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
    assert auth_reason(exc) == "wrong_site"
    with pytest.raises(AuthError) as exc:
        load_site_kit(issued.site_kit_dir, site_id="us")
    assert auth_reason(exc) == "wrong_site"
    registry = CertificateRegistry.from_kit(kit)
    cert = issued.certificate
    registry.check_peer(user_id="eu", serial=cert.serial, claimed_site_id="eu", now=NOW)
    with pytest.raises(AuthError) as exc:
        registry.check_peer(user_id="eu", serial=cert.serial, claimed_site_id="us", now=NOW)
    assert auth_reason(exc) == "wrong_site"


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
        assert auth_reason(exc) == "bad_signature"


@pytest.mark.timeout(30)
def test_security_config_is_secure_by_default() -> None:
    with pytest.raises(ValueError, match="security.kit_dir"):
        SecurityConfig().require()
    SecurityConfig(insecure=True).require()
    SecurityConfig(kit_dir="kit").require()
    with pytest.raises(ValueError, match="security.insecure"):
        SecurityConfig(kit_dir="kit", insecure=True)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("site_id", ["eu\n", "eu\r\n", "\neu", "eu ", "é", "x" * 65])
def test_a_site_id_is_matched_whole(site_id: str) -> None:
    with pytest.raises(ValueError, match="site_id"):
        check_site_id(site_id)
    assert check_site_id("eu-west_1") == "eu-west_1"
