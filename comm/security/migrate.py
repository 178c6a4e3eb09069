"""``crossdc keys migrate``: convert a format-1 kit to X.509 in place, keeping every identity.

Format 1 (``comm.security.legacy``) is read and every signature checked against the CA; the
same identities are re-issued with ``comm.security.certs`` and laid out as ``comm.security.kits``
writes a format-2 kit.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security import legacy
from comm.security.certs import (
    Certificate,
    make_ca_certificate,
    make_site_certificate,
)
from comm.security.common import (
    _BACKDATE_S,
    _PUBLIC_MODE,
    _SECONDS_PER_DAY,
    CA_CERT,
    CA_KEY,
    CERTS_DIR,
    KIT_FORMAT,
    MANIFEST,
    SITE_CERT,
    SITE_CURVE_PUB,
    SITES_DIR,
    AuthError,
    _kit_lock,
    _mkdir_private,
    _write,
    key_fingerprint,
)
from comm.security.crl import Revocation, RevocationList
from comm.security.kits import (
    _DEFAULT_CA_DAYS,
    _cert_path,
    _new_serial,
    _write_crl,
    _write_manifest,
)
from comm.security.signing import load_private_key, load_public_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Migration:
    kit_dir: Path
    certificates: tuple[Certificate, ...]
    """The re-issued certificates (same site, CURVE key, validity and serial)."""
    revoked: tuple[str, ...]
    backup_dir: Path
    """Where the format-1 files went (nothing is deleted)."""
    upgrade_dir: Path
    """``<site>/site.pem`` and ``<site>/ca.pem`` per site: what each site's kit needs."""


def migrate_kit(kit_dir: str | Path, *, now: float | None = None) -> Migration:
    """Convert a format-1 federation kit to X.509 in place, keeping every identity.

    The CA key stays (so its fingerprint does); ``ca.pem`` is made from it. Every format-1
    certificate that verifies against the CA is re-issued as X.509 with the same site, CURVE
    key, validity and serial (ones that do not verify are left behind with a warning); the
    revocation list becomes ``crl.pem`` with the same version and serials. Site kits still in
    ``sites/`` are converted too, and ``upgrade/<site>/`` holds the ``site.pem`` and ``ca.pem``
    of each site's newest certificate, to copy into kits already shipped. The format-1 files
    move to ``format1-backup/``. Refuses a kit that is not format 1.
    """
    kit = Path(kit_dir)
    manifest = _read_format1_manifest(kit)
    ca = load_private_key(kit / CA_KEY)
    at = int(time.time() if now is None else now)
    backup, upgrade = kit / "format1-backup", kit / "upgrade"
    with _kit_lock(kit):
        old_ca = _format1_ca_public(kit, ca)
        old_certs = _read_format1_certificates(kit, old_ca)
        version, entries = legacy.read_revocations(kit / legacy.REVOCATIONS, old_ca)
        ca_pem = _make_ca_pem(ca, [c for _, c in old_certs], at)
        _mkdir_private(backup / CERTS_DIR)
        _write(kit / CA_CERT, ca_pem, _PUBLIC_MODE, replace=True)
        new_certs = _reissue_certificates(kit, ca, old_certs, backup / CERTS_DIR)
        _convert_revocations(kit, ca, version, entries, at, backup)
        _write_upgrade_files(upgrade, new_certs, ca_pem)
        for site_dir in sorted(p for p in (kit / SITES_DIR).iterdir() if p.is_dir()):
            _migrate_site_dir(site_dir, new_certs, ca_pem, backup / SITES_DIR / site_dir.name)
        _write_manifest(kit, {**manifest, "migrated_at": at}, replace=True)
    log.info("migrated %s to kit format %d: %d certificate(s)", kit, KIT_FORMAT, len(new_certs))
    return Migration(
        kit_dir=kit,
        certificates=tuple(new_certs),
        revoked=tuple(s for s, _ in entries),
        backup_dir=backup,
        upgrade_dir=upgrade,
    )


def _read_format1_manifest(kit: Path) -> dict[str, Any]:
    """The kit's manifest; a kit that is not format 1 is refused."""
    try:
        manifest: dict[str, Any] = json.loads((kit / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(kit)!r} is not a federation kit: {exc}") from None
    if manifest.get("format") != legacy.FORMAT:
        raise ValueError(
            f"{str(kit)!r} has kit format {manifest.get('format')!r}; only format-1 kits migrate"
        )
    return manifest


def _format1_ca_public(kit: Path, ca: Ed25519PrivateKey) -> Ed25519PublicKey:
    """The format-1 CA public key, which must be the CA key's (or nothing verifies)."""
    old_ca = load_public_key(kit / legacy.CA_PUB)
    if key_fingerprint(old_ca) != key_fingerprint(ca.public_key()):
        raise ValueError(f"{legacy.CA_PUB} and {CA_KEY} in {str(kit)!r} do not match")
    return old_ca


def _read_format1_certificates(
    kit: Path, old_ca: Ed25519PublicKey
) -> list[tuple[Path, legacy.LegacyCertificate]]:
    """Every format-1 certificate file that verifies against the CA, with its path; the others
    are left behind with a warning."""
    old_certs: list[tuple[Path, legacy.LegacyCertificate]] = []
    for path in sorted((kit / CERTS_DIR).glob(f"*{legacy.CERT_SUFFIX}")):
        try:
            old_certs.append((path, legacy.read_certificate(path, old_ca)))
        except (OSError, AuthError) as exc:
            log.warning("not migrating certificate file %s: %s", path.name, exc)
    return old_certs


def _make_ca_pem(
    ca: Ed25519PrivateKey, old_certs: list[legacy.LegacyCertificate], at: int
) -> bytes:
    """A CA certificate for the existing CA key, valid over every certificate it signed."""
    latest = max([at, *(c.not_after for c in old_certs)])
    return make_ca_certificate(
        ca,
        not_before=min([at, *(c.not_before for c in old_certs)]) - _BACKDATE_S,
        not_after=max(latest, at + int(_DEFAULT_CA_DAYS * _SECONDS_PER_DAY)),
        serial=_new_serial(),
    )


def _reissue_certificates(
    kit: Path,
    ca: Ed25519PrivateKey,
    old_certs: list[tuple[Path, legacy.LegacyCertificate]],
    backup: Path,
) -> list[Certificate]:
    """Re-issue each format-1 certificate as X.509 (same site, CURVE key, validity and serial)
    and move its format-1 file into ``backup``."""
    new_certs = []
    for path, old in old_certs:
        cert = make_site_certificate(
            ca,
            site_id=old.site_id,
            curve_public=old.curve_public,
            not_before=old.not_before,
            not_after=old.not_after,
            serial=old.serial,
        )
        _write(_cert_path(kit, cert), cert.to_pem(), _PUBLIC_MODE, replace=True)
        path.replace(backup / path.name)
        new_certs.append(cert)
    return new_certs


def _convert_revocations(
    kit: Path,
    ca: Ed25519PrivateKey,
    version: int,
    entries: list[tuple[str, int]],
    at: int,
    backup: Path,
) -> None:
    """Write the format-1 revocations as ``crl.pem`` (same version and serials) and move the
    format-1 revocation list and CA public key into ``backup``."""
    revocations = RevocationList(
        version=version,
        issued_at=at,
        entries=tuple(Revocation(serial=s, revoked_at=t) for s, t in entries),
    )
    _write_crl(kit, ca, revocations)
    (kit / legacy.REVOCATIONS).replace(backup / legacy.REVOCATIONS)
    (kit / legacy.CA_PUB).replace(backup / legacy.CA_PUB)


def _write_upgrade_files(upgrade: Path, certs: list[Certificate], ca_pem: bytes) -> None:
    """``<site>/site.pem`` (its newest certificate) and ``<site>/ca.pem`` per site, for the
    kits already shipped."""
    newest: dict[str, Certificate] = {}
    for cert in sorted(certs, key=lambda c: c.not_after):
        newest[cert.site_id] = cert
    for site_id, cert in newest.items():
        _mkdir_private(upgrade / site_id)
        _write(upgrade / site_id / SITE_CERT, cert.to_pem(), _PUBLIC_MODE, replace=True)
        _write(upgrade / site_id / CA_CERT, ca_pem, _PUBLIC_MODE, replace=True)


def _migrate_site_dir(
    site_dir: Path, certs: list[Certificate], ca_pem: bytes, backup: Path
) -> None:
    """Give a format-1 startup kit still in ``sites/`` its X.509 certificate and the CA's."""
    if not (site_dir / legacy.SITE_CERT).exists():
        return
    try:
        public = (site_dir / SITE_CURVE_PUB).read_bytes().strip()
    except OSError:
        return
    mine = [c for c in certs if c.curve_public == public]
    if not mine:
        log.warning("site kit %s: no migrated certificate names its key; left as it was", site_dir)
        return
    cert = max(mine, key=lambda c: c.not_after)
    _mkdir_private(backup)
    _write(site_dir / SITE_CERT, cert.to_pem(), _PUBLIC_MODE, replace=True)
    _write(site_dir / CA_CERT, ca_pem, _PUBLIC_MODE, replace=True)
    for name in (legacy.SITE_CERT, legacy.CA_PUB):
        if (site_dir / name).exists():
            (site_dir / name).replace(backup / name)
