"""CA rollover on a kit: `keys rotate-ca` and `keys retire-ca`, what the coordinator's registry and
a site's kit watcher make of each step while they run, and what they refuse.

The live federation rolled over while it trains is tests/comm/security/test_rollover_federation.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import zmq

from comm.security.certs import load_ca_bundle, load_certificate, make_site_certificate
from comm.security.common import (
    CA_CERT,
    CA_KEY,
    CERTS_DIR,
    CRL,
    PREVIOUS_CA_KEY,
    RETIRED_DIR,
    SITE_CERT,
    SITE_CURVE_KEY,
    SITE_CURVE_PUB,
    AuthError,
)
from comm.security.crl import parse_revocation_bundle
from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import SiteKitWatcher, load_site_kit
from comm.security.rollover import retire_ca, rotate_ca
from comm.security.signing import load_private_key
from crossdc.cli import main
from tests.support.keys import DAY, auth_reason

NOW = time.time()


@pytest.fixture(autouse=True)
def _fresh_now() -> None:
    global NOW
    NOW = time.time()


@pytest.fixture
def federation(tmp_path: Path) -> Path:
    kit = init_kit(tmp_path / "kit")
    for site in ("eu", "us"):
        issue_site(kit, site, 30)
    issue_site(kit, "old", 1, now=NOW - 10 * DAY)  # expired: not carried over
    issue_site(kit, "gone", 30)
    revoke_site(kit, "gone")  # revoked: not carried over
    return kit


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes: the whole state of a kit."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _site_kit(kit: Path, site_id: str) -> Path:
    return kit / "sites" / site_id


def _key(kit: Path, site_id: str) -> bytes:
    return (_site_kit(kit, site_id) / SITE_CURVE_PUB).read_bytes().strip()


def _openssl_verify(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["openssl", "verify", *map(str, argv)], capture_output=True, text=True, timeout=30
    )


# ---------------------------------------------------------------------------- rotate-ca


@pytest.mark.timeout(30)
def test_rotate_ca_adds_a_ca_and_reissues_every_valid_certificate_for_the_same_key(
    federation: Path,
) -> None:
    kit = federation
    (old,) = load_ca_bundle(kit / CA_CERT)
    before = {
        c.site_id: c
        for c in (load_certificate(_site_kit(kit, s) / SITE_CERT) for s in ("eu", "us"))
    }
    rolled = rotate_ca(kit)
    new, previous = load_ca_bundle(kit / CA_CERT)
    assert previous == old and new == rolled.ca != old
    assert rolled.previous_ca == old
    # Only the valid certificates come over: not the expired "old", not the revoked "gone".
    assert sorted(c.site_id for c in rolled.certificates) == ["eu", "us"]
    for cert in rolled.certificates:
        was = before[cert.site_id]
        assert cert.curve_public == was.curve_public and cert.not_after == was.not_after
        assert cert.serial != was.serial and cert.issuer_among([new]) == new
        assert (kit / CERTS_DIR / f"{cert.site_id}-{cert.serial}.pem").read_bytes() == cert.to_pem()
    # The old CA's key is kept for the overlap (0600), the new one issues.
    assert (kit / PREVIOUS_CA_KEY).stat().st_mode & 0o777 == 0o600
    assert (kit / CA_KEY).stat().st_mode & 0o777 == 0o600
    assert issue_site(kit, "ap", 30).certificate.issuer_among([new]) == new
    # One CRL per CA; the new CA's is empty, the old one's still revokes "gone".
    lists = parse_revocation_bundle((kit / CRL).read_bytes(), [new.public_key, old.public_key])
    assert lists[new.fingerprint].serials == frozenset()
    assert len(lists[old.fingerprint].serials) == 1
    # What each site installs: the bundle, then its new certificate.
    assert set(rolled.site_files) == {"eu", "us"}
    for site, (bundle, site_pem) in rolled.site_files.items():
        assert (bundle.name, site_pem.name) == (CA_CERT, SITE_CERT)
        assert bundle.read_bytes() == (kit / CA_CERT).read_bytes()
        assert load_certificate(site_pem).site_id == site
    manifest = json.loads((kit / "kit.json").read_text())
    assert manifest["ca_fingerprint"] == new.fingerprint
    assert manifest["previous_ca_fingerprint"] == old.fingerprint


@pytest.mark.timeout(30)
def test_during_the_overlap_both_cas_are_trusted_by_the_registry_sites_and_openssl(
    federation: Path,
) -> None:
    kit = federation
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    eu_old = registry.authorize(_key(kit, "eu"), NOW)
    rolled = rotate_ca(kit)
    registry.reload()
    assert [c.fingerprint for c in registry.trusted_cas()] == [
        rolled.ca.fingerprint,
        rolled.previous_ca.fingerprint,
    ]
    assert registry.refused == {}
    # Both certificates of each key are trusted; a handshake gets the new CA's (same expiry).
    trusted = {c.serial for c in registry.trusted_certificates()}
    assert eu_old.serial in trusted
    assert {c.serial for c in rolled.certificates} <= trusted
    eu_new = registry.authorize(_key(kit, "eu"), NOW)
    assert eu_new.issuer_among([rolled.ca]) == rolled.ca and eu_new.not_after == eu_old.not_after
    # A site kit with the bundle verifies its old certificate and its new one.
    site = _site_kit(kit, "eu")
    shutil.copy(rolled.site_files["eu"][0], site / CA_CERT)
    assert load_site_kit(site).ca == rolled.previous_ca
    shutil.copy(rolled.site_files["eu"][1], site / SITE_CERT)
    loaded = load_site_kit(site, site_id="eu")
    assert loaded.ca == rolled.ca and len(loaded.cas) == 2
    # openssl reads the bundle and both CRLs.
    for cert in (kit / CERTS_DIR).glob("eu-*.pem"):
        done = _openssl_verify("-crl_check", "-CAfile", kit / CA_CERT, "-CRLfile", kit / CRL, cert)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(30)
def test_revoking_during_the_overlap_revokes_under_both_cas(federation: Path) -> None:
    kit = federation
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    rolled = rotate_ca(kit)
    eu_serials = {load_certificate(p).serial for p in (kit / CERTS_DIR).glob("eu-*.pem")}
    assert len(eu_serials) == 2
    assert set(revoke_site(kit, "eu")) == eu_serials
    registry.reload()
    with pytest.raises(AuthError) as exc:
        registry.authorize(_key(kit, "eu"), NOW)
    assert auth_reason(exc) == "revoked"
    lists = parse_revocation_bundle(
        (kit / CRL).read_bytes(), [rolled.ca.public_key, rolled.previous_ca.public_key]
    )
    assert all(len(lists[fp].serials & eu_serials) == 1 for fp in lists)
    # The previous CA's key is needed for its half; without it nothing is written.
    issue_site(kit, "ap", 30)
    held = (kit / PREVIOUS_CA_KEY).read_bytes()
    (kit / PREVIOUS_CA_KEY).unlink()
    with pytest.raises(ValueError, match="previous-ca.key"):
        revoke_site(kit, "us")
    (kit / PREVIOUS_CA_KEY).write_bytes(held)
    (kit / PREVIOUS_CA_KEY).chmod(0o600)


@pytest.mark.timeout(30)
def test_rotate_ca_refuses_bad_input_and_changes_nothing(federation: Path, tmp_path: Path) -> None:
    kit = federation
    state = _files(kit)
    # ca.key of another federation.
    other = init_kit(tmp_path / "other")
    good_key = (kit / CA_KEY).read_bytes()
    (kit / CA_KEY).write_bytes((other / CA_KEY).read_bytes())
    with pytest.raises(ValueError, match="is not the key of the current CA"):
        rotate_ca(kit)
    (kit / CA_KEY).write_bytes(good_key)
    assert _files(kit) == state
    # Not a federation kit; a bad number of days; a new CA too short for what it re-issues.
    with pytest.raises(ValueError, match="not a federation kit"):
        rotate_ca(_site_kit(kit, "eu"))
    with pytest.raises(ValueError, match="ca_days"):
        rotate_ca(kit, ca_days=0)
    with pytest.raises(ValueError, match="after the new CA"):
        rotate_ca(kit, ca_days=10)
    assert _files(kit) == state
    # A CA that expired has nothing left to carry over.
    with pytest.raises(ValueError, match="expired"):
        rotate_ca(kit, now=NOW + 4000 * DAY)
    assert _files(kit) == state
    # Twice: the first rollover must end first.
    rotate_ca(kit)
    state = _files(kit)
    with pytest.raises(ValueError, match="already under way"):
        rotate_ca(kit)
    assert _files(kit) == state


# ---------------------------------------------------------------------------- retire-ca


@pytest.mark.timeout(30)
def test_retire_ca_revokes_everything_the_old_ca_issued_and_stops_trusting_it(
    federation: Path,
) -> None:
    kit = federation
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    eu_old = registry.authorize(_key(kit, "eu"), NOW)
    rolled = rotate_ca(kit)
    registry.reload()
    # A key certified by the old CA only, as if issued by another tool during the overlap.
    lone = rolled.certificates[0]
    (kit / CERTS_DIR / f"{lone.site_id}-{lone.serial}.pem").unlink()
    with pytest.raises(ValueError, match=f"would lock out {lone.site_id}"):
        retire_ca(kit)
    (kit / CERTS_DIR / f"{lone.site_id}-{lone.serial}.pem").write_bytes(lone.to_pem())
    done = retire_ca(kit)
    old, new = rolled.previous_ca, rolled.ca
    assert done.retired_ca == old and done.ca == new
    assert load_ca_bundle(kit / CA_CERT) == (new,)
    assert not (kit / PREVIOUS_CA_KEY).exists()
    assert done.record_dir == kit / RETIRED_DIR / old.fingerprint
    assert (done.record_dir / CA_CERT).read_bytes() == old.pem
    # The old CA's last CRL revokes every certificate it issued (openssl agrees).
    final = parse_revocation_bundle((done.record_dir / CRL).read_bytes(), [old.public_key])
    old_serials = {
        c.serial
        for c in map(load_certificate, (kit / CERTS_DIR).glob("*.pem"))
        if c.issuer_among([old])
    }
    assert final[old.fingerprint].serials == old_serials and set(done.revoked) <= old_serials
    checked = _openssl_verify(
        "-crl_check",
        "-CAfile",
        done.record_dir / CA_CERT,
        "-CRLfile",
        done.record_dir / CRL,
        _site_kit(kit, "eu") / SITE_CERT,
    )
    assert checked.returncode != 0 and "certificate revoked" in checked.stdout + checked.stderr
    assert parse_revocation_bundle((kit / CRL).read_bytes(), [new.public_key]).keys() == {
        new.fingerprint
    }
    for site, (bundle,) in done.site_files.items():
        assert bundle.read_bytes() == (kit / CA_CERT).read_bytes(), site
    # The running registry: new certificates work; the old ones are revoked, at the handshake
    # and on a connection opened under them, unless the same key holds a new certificate.
    registry.reload()
    assert registry.refused == {}
    assert [c.fingerprint for c in registry.trusted_cas()] == [new.fingerprint]
    assert registry.authorize(_key(kit, "eu"), NOW).issuer_among([new]) == new
    registry.check_peer(user_id="eu", serial=eu_old.serial, claimed_site_id="eu", now=NOW)
    revoke_site(kit, "eu")
    registry.reload()
    with pytest.raises(AuthError) as exc:
        registry.check_peer(user_id="eu", serial=eu_old.serial, claimed_site_id="eu", now=NOW)
    assert auth_reason(exc) == "revoked"


@pytest.mark.timeout(30)
def test_a_key_certified_by_the_retired_ca_only_is_refused_as_revoked(federation: Path) -> None:
    kit = federation
    registry = CertificateRegistry.from_kit(kit, reload_interval_s=0)
    us_old = registry.authorize(_key(kit, "us"), NOW)
    rolled = rotate_ca(kit)
    us_new = next(c for c in rolled.certificates if c.site_id == "us")
    (kit / CERTS_DIR / f"us-{us_new.serial}.pem").unlink()
    registry.reload()
    assert registry.authorize(_key(kit, "us"), NOW).serial == us_old.serial
    retire_ca(kit, force=True)
    registry.reload()
    with pytest.raises(AuthError) as exc:
        registry.authorize(_key(kit, "us"), NOW)
    assert auth_reason(exc) == "revoked" and "is retired" in str(exc.value)
    with pytest.raises(AuthError) as exc:
        registry.check_peer(user_id="us", serial=us_old.serial, claimed_site_id="us", now=NOW)
    assert auth_reason(exc) == "revoked" and "is revoked" in str(exc.value)
    # A coordinator started now refuses it the same way.
    with pytest.raises(AuthError) as exc:
        CertificateRegistry.from_kit(kit).authorize(_key(kit, "us"), NOW)
    assert auth_reason(exc) == "revoked"


@pytest.mark.timeout(30)
def test_retire_ca_refuses_without_a_rollover_and_changes_nothing(federation: Path) -> None:
    kit = federation
    state = _files(kit)
    with pytest.raises(ValueError, match="no CA rollover is under way"):
        retire_ca(kit)
    assert _files(kit) == state
    rotate_ca(kit)
    state = _files(kit)
    (kit / PREVIOUS_CA_KEY).write_bytes((kit / CA_KEY).read_bytes())
    with pytest.raises(ValueError, match="previous-ca.key"):
        retire_ca(kit)
    assert {k: v for k, v in _files(kit).items() if k != PREVIOUS_CA_KEY} == {
        k: v for k, v in state.items() if k != PREVIOUS_CA_KEY
    }


# ------------------------------------------------------------ what a running coordinator refuses


@pytest.mark.timeout(30)
def test_the_registry_refuses_trust_material_that_would_loosen_it_and_keeps_its_own(
    federation: Path, tmp_path: Path
) -> None:
    kit = federation
    refusals: list[str] = []
    registry = CertificateRegistry.from_kit(
        kit, reload_interval_s=0, on_refuse=lambda reason, _detail: refusals.append(reason)
    )
    rolled = rotate_ca(kit)
    registry.reload()
    both = registry.trusted_cas()
    bundle, crl = (kit / CA_CERT).read_bytes(), (kit / CRL).read_bytes()

    def refused(reason: str, *, ca: bytes = bundle, crls: bytes = crl) -> None:
        (kit / CA_CERT).write_bytes(ca)
        (kit / CRL).write_bytes(crls)
        registry.reload()
        assert refusals[-1:] == [reason]
        assert registry.trusted_cas() == both
        assert registry.authorize(_key(kit, "eu"), NOW).issuer_among([rolled.ca]) == rolled.ca

    # A site's old ca.pem put back: it drops the new CA, which is not retired.
    refused("dropped_ca", ca=rolled.previous_ca.pem)
    refused("bad_bundle", ca=b"not a certificate")
    # A CA outside its validity added.
    expired = init_kit(tmp_path / "expired", now=NOW - 20 * DAY, ca_days=10)
    refused("expired_ca", ca=bundle + (expired / CA_CERT).read_bytes())
    # The old CA's revocation list missing (crl.pem lists the new CA's first), older than the
    # loaded one, or a list no CA of the kit signed.
    end = b"-----END X509 CRL-----\n"
    first = crl[: crl.index(end) + len(end)]
    refused("missing_crl", crls=first)
    (kit / CRL).write_bytes(crl)
    revoke_site(kit, "us")
    latest = (kit / CRL).read_bytes()
    registry.reload()
    with pytest.raises(AuthError) as exc:
        registry.authorize(_key(kit, "us"), NOW)
    assert auth_reason(exc) == "revoked"
    refused("stale_crl", crls=crl)
    refused("bad_crl", crls=(expired / CRL).read_bytes())
    with pytest.raises(AuthError) as exc:
        registry.authorize(_key(kit, "us"), NOW)
    assert auth_reason(exc) == "revoked"
    # Both CAs' lists are older: one refusal each.
    assert registry.refused == {
        "dropped_ca": 1,
        "bad_bundle": 1,
        "expired_ca": 1,
        "missing_crl": 1,
        "stale_crl": 2,
        "bad_crl": 1,
    }
    # After retirement the old CA cannot come back.
    (kit / CRL).write_bytes(latest)
    retire_ca(kit)
    registry.reload()
    assert registry.trusted_cas() == (rolled.ca,)
    before = len(refusals)
    (kit / CA_CERT).write_bytes(bundle)
    registry.reload()
    assert refusals[before:] == ["retired_ca"] and registry.trusted_cas() == (rolled.ca,)


@pytest.mark.timeout(30)
def test_a_coordinator_refuses_to_start_on_a_bundle_listing_a_retired_ca(federation: Path) -> None:
    kit = federation
    rolled = rotate_ca(kit)
    bundle = (kit / CA_CERT).read_bytes()
    retire_ca(kit)
    (kit / CA_CERT).write_bytes(bundle)
    with pytest.raises(ValueError, match=f"{rolled.previous_ca.fingerprint}.*retired"):
        CertificateRegistry.from_kit(kit)


# ------------------------------------------------------------------- what a running site does


@pytest.mark.timeout(30)
def test_a_running_site_moves_to_its_new_certificate_and_refuses_what_does_not_fit(
    federation: Path,
) -> None:
    kit = federation
    site = _site_kit(kit, "eu")
    refusals: list[str] = []
    watcher = SiteKitWatcher(
        site,
        load_site_kit(site, site_id="eu"),
        on_refuse=lambda r, _d: refusals.append(r),
        interval_s=0,
    )
    old_serial = watcher.kit.certificate.serial
    assert watcher.poll() is None  # nothing changed
    rolled = rotate_ca(kit)
    bundle, new_pem = rolled.site_files["eu"]
    # site.pem before ca.pem: its CA is not in the site's bundle yet, refused, the old one kept.
    shutil.copy(new_pem, site / SITE_CERT)
    assert watcher.poll() is None and refusals == ["bad_signature"]
    assert watcher.kit.certificate.serial == old_serial
    shutil.copy(bundle, site / CA_CERT)
    moved = watcher.poll()
    assert moved is not None and moved.ca == rolled.ca and len(moved.cas) == 2
    assert watcher.status()["certificate"]["serial"] == moved.certificate.serial
    # Another site's certificate, a garbage file, an expired one: refused, nothing changes.
    current = watcher.kit
    expired = make_site_certificate(
        load_private_key(kit / CA_KEY),
        site_id="eu",
        curve_public=_key(kit, "eu"),
        not_before=int(NOW - 10 * DAY),
        not_after=int(NOW - DAY),
        serial="ab" * 16,
    )
    for pem, reason in [
        (rolled.site_files["us"][1].read_bytes(), "wrong_site"),
        (b"garbage", "bad_signature"),
        (expired.to_pem(), "expired"),
    ]:
        (site / SITE_CERT).write_bytes(pem)
        assert watcher.poll() is None and refusals[-1] == reason
        assert watcher.kit == current
    # A certificate for another key needs a restart: refused while running.
    other = issue_site(kit, "eu", 30, out_dir=kit / "eu-renewed")
    shutil.copy(other.site_kit_dir / SITE_CERT, site / SITE_CERT)
    shutil.copy(other.site_kit_dir / SITE_CURVE_PUB, site / SITE_CURVE_PUB)
    shutil.copy(other.site_kit_dir / SITE_CURVE_KEY, site / SITE_CURVE_KEY)
    assert watcher.poll() is None and refusals[-1] == "unknown_key"
    assert watcher.kit == current
    assert watcher.refused == {"bad_signature": 2, "wrong_site": 1, "expired": 1, "unknown_key": 1}


# ----------------------------------------------------------------------------------- the CLI


@pytest.mark.timeout(60)
def test_cli_rotate_and_retire(federation: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kit = federation
    assert main(["keys", "retire-ca", "--kit", str(kit)]) == 2
    assert "no CA rollover is under way" in capsys.readouterr().err
    assert main(["keys", "rotate-ca", "--kit", str(kit), "--json"]) == 0
    rolled = json.loads(capsys.readouterr().out)
    new, old = load_ca_bundle(kit / CA_CERT)
    assert (rolled["ca_fingerprint"], rolled["previous_ca_fingerprint"]) == (
        new.fingerprint,
        old.fingerprint,
    )
    assert sorted(c["site_id"] for c in rolled["certificates"]) == ["eu", "us"]
    assert sorted(rolled["site_files"]) == ["eu", "us"]
    assert main(["keys", "rotate-ca", "--kit", str(kit)]) == 2
    assert "already under way" in capsys.readouterr().err
    assert main(["keys", "retire-ca", "--kit", str(kit), "--json"]) == 0
    retired = json.loads(capsys.readouterr().out)
    assert retired["retired_ca_fingerprint"] == old.fingerprint
    assert retired["ca_fingerprint"] == new.fingerprint
    assert load_ca_bundle(kit / CA_CERT) == (new,)
    assert zmq.curve_public((_site_kit(kit, "eu") / SITE_CURVE_KEY).read_bytes().strip()) == _key(
        kit, "eu"
    )
