"""``crossdc keys migrate``: a format-1 kit (before X.509) is refused clearly and migrates in
place keeping every identity, revocation and shipped site kit."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.security import legacy
from comm.security.certs import Certificate
from comm.security.common import (
    CA_CERT,
    CA_KEY,
    CERTS_DIR,
    CRL,
    MANIFEST,
    SITE_CERT,
    SITES_DIR,
    AuthError,
    _b64,
    key_fingerprint,
)
from comm.security.crl import load_revocations
from comm.security.kits import init_kit, issue_site, issued_certificates, revoke_site
from comm.security.migrate import migrate_kit
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import load_coordinator_kit, load_site_kit
from comm.security.signing import load_private_key
from crossdc import cli
from tests.support.keys import auth_reason

NOW = time.time()
"""The tests' "now"; refreshed before each test (below): certificates are issued at the real
time, and the suite may reach this module minutes after collecting it."""


@pytest.fixture(autouse=True)
def _fresh_now() -> None:
    global NOW
    NOW = time.time()


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
    assert auth_reason(exc) == "revoked"
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
