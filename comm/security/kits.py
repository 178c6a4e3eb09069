"""Federation kits on disk: create, issue a site, revoke a site, load a running role's keys.

A federation kit directory (:func:`init_kit`) holds::

    kit.json                    manifest (public values only; "format": 2)
    ca.key        0600          CA Ed25519 private key (PEM; keep offline once sites are issued)
    ca.pem                      CA certificate (X.509, self-signed)
    coordinator.curve.key 0600  coordinator CURVE secret (Z85)
    coordinator.curve.pub       coordinator CURVE public key (Z85)
    coordinator.sign.key  0600  coordinator Ed25519 checkpoint-signing key (PEM)
    coordinator.sign.pub        its public key (PEM)
    crl.pem                     CA-signed revocation list (X.509 CRL)
    certs/<site>-<serial>.pem   every certificate issued (X.509; the coordinator trusts these)
    sites/<site>/               each site's startup kit, to ship to that site and then delete here
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security import legacy
from comm.security.certs import (
    Certificate,
    load_ca_certificate,
    load_certificate,
    make_ca_certificate,
    make_site_certificate,
)
from comm.security.common import (
    _BACKDATE_S,
    _PRIVATE_MODE,
    _PUBLIC_MODE,
    _SECONDS_PER_DAY,
    CA_CERT,
    CA_KEY,
    CERT_SUFFIX,
    CERTS_DIR,
    COORDINATOR_CURVE_KEY,
    COORDINATOR_CURVE_PUB,
    COORDINATOR_SIGN_KEY,
    COORDINATOR_SIGN_PUB,
    CRL,
    KIT_FORMAT,
    MANIFEST,
    SITE_CERT,
    SITE_CURVE_KEY,
    SITE_CURVE_PUB,
    SITE_TOML,
    SITES_DIR,
    AuthError,
    _kit_lock,
    _mkdir_private,
    _read_private,
    _write,
    check_site_id,
    key_fingerprint,
)
from comm.security.crl import Revocation, RevocationList, load_revocations
from comm.security.identity import CurveKeys
from comm.security.signing import (
    _private_pem,
    _public_pem,
    generate_signing_key,
    load_private_key,
    load_public_key,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Kit lifecycle: init, issue, revoke


def _load_curve(secret_path: Path, public_path: Path) -> tuple[bytes, bytes]:
    secret = _read_private(secret_path).strip()
    public = public_path.read_bytes().strip()
    if len(secret) != 40 or zmq.curve_public(secret) != public:
        raise ValueError(f"CURVE keys {str(secret_path)!r} and {str(public_path)!r} do not match")
    return public, secret


_DEFAULT_CA_DAYS = 3650.0
_MAX_DAYS = 100 * 366


def _check_days(days: float, what: str) -> None:
    if not (isinstance(days, int | float) and 0 < days <= _MAX_DAYS):
        raise ValueError(
            f"{what} must be a positive number of days up to {_MAX_DAYS}, got {days!r}"
        )


def _new_serial() -> str:
    while True:
        serial = secrets.token_hex(16)
        if int(serial, 16):
            return serial


def init_kit(
    kit_dir: str | Path, *, now: float | None = None, ca_days: float = _DEFAULT_CA_DAYS
) -> Path:
    """Create a federation kit in ``kit_dir`` (new or empty): the CA key and its self-signed
    X.509 certificate valid for ``ca_days``, the coordinator's CURVE and signing keys, an empty
    CRL and the manifest. Returns the directory.

    Refuses (ValueError naming the path) to touch a directory that already holds anything.
    """
    _check_days(ca_days, "ca_days")
    kit = Path(kit_dir)
    if kit.exists() and (not kit.is_dir() or any(kit.iterdir())):
        raise ValueError(f"refusing to overwrite {str(kit)!r}: it already exists and is not empty")
    issued_at = int(time.time() if now is None else now)
    _mkdir_private(kit)
    _mkdir_private(kit / CERTS_DIR)
    _mkdir_private(kit / SITES_DIR)
    ca = generate_signing_key()
    signer = generate_signing_key()
    curve_public, curve_secret = zmq.curve_keypair()
    ca_pem = make_ca_certificate(
        ca,
        not_before=issued_at - _BACKDATE_S,
        not_after=issued_at + int(ca_days * _SECONDS_PER_DAY),
        serial=_new_serial(),
    )
    _write(kit / CA_KEY, _private_pem(ca), _PRIVATE_MODE)
    _write(kit / CA_CERT, ca_pem, _PUBLIC_MODE)
    _write(kit / COORDINATOR_CURVE_KEY, curve_secret + b"\n", _PRIVATE_MODE)
    _write(kit / COORDINATOR_CURVE_PUB, curve_public + b"\n", _PUBLIC_MODE)
    _write(kit / COORDINATOR_SIGN_KEY, _private_pem(signer), _PRIVATE_MODE)
    _write(kit / COORDINATOR_SIGN_PUB, _public_pem(signer.public_key()), _PUBLIC_MODE)
    _write_crl(kit, ca, RevocationList(version=0, issued_at=issued_at, entries=()))
    _write_manifest(
        kit,
        {
            "created_at": issued_at,
            "ca_fingerprint": key_fingerprint(ca.public_key()),
            "coordinator_curve_fingerprint": key_fingerprint(curve_public),
            "coordinator_sign_fingerprint": key_fingerprint(signer.public_key()),
        },
    )
    log.info("created federation kit %s (CA %s)", kit, key_fingerprint(ca.public_key()))
    return kit


def _write_manifest(kit: Path, fields: dict[str, object], *, replace: bool = False) -> None:
    body = json.dumps({**fields, "format": KIT_FORMAT}, indent=1, sort_keys=True) + "\n"
    _write(kit / MANIFEST, body.encode(), _PUBLIC_MODE, replace=replace)


def _write_crl(kit: Path, ca: Ed25519PrivateKey, revocations: RevocationList) -> None:
    ca_cert = load_ca_certificate(kit / CA_CERT)
    pem = revocations.to_pem(ca, next_update=ca_cert.not_after)
    _write(kit / CRL, pem, _PUBLIC_MODE, replace=(kit / CRL).exists())


def _cert_path(kit: Path, cert: Certificate) -> Path:
    return kit / CERTS_DIR / f"{cert.site_id}-{cert.serial}{CERT_SUFFIX}"


@dataclass(frozen=True, kw_only=True)
class IssuedSite:
    certificate: Certificate
    site_kit_dir: Path


def _site_toml(site_id: str, endpoint: str) -> str:
    return (
        f"# Starter config for site {site_id!r}. Keep this kit directory private to the site\n"
        "# (site.curve.key is its secret key); point kit_dir at where it lives on the site.\n"
        "[site]\n"
        f'site_id = "{site_id}"\n'
        f'coordinator = "{endpoint}"\n'
        "\n"
        "[site.security]\n"
        f'kit_dir = "./crossdc-kit-{site_id}"\n'
    )


def issue_site(
    kit_dir: str | Path,
    site_id: str,
    days: float,
    *,
    out_dir: str | Path | None = None,
    coordinator_endpoint: str = "tcp://COORDINATOR_HOST:7710",
    now: float | None = None,
) -> IssuedSite:
    """Issue site ``site_id`` a CURVE keypair and an X.509 certificate valid for ``days`` from
    ``now`` (and from 5 minutes before, for clock skew), never past the CA's own expiry.

    The certificate is recorded in ``certs/`` (what the coordinator trusts) and a startup kit is
    written to ``out_dir`` (default ``sites/<site_id>`` in the kit; it must not exist yet): the
    site's CURVE secret (0600) and public key, its certificate ``site.pem``, the CA certificate,
    the coordinator's CURVE and signing public keys and a starter ``site.toml``. Needs
    ``ca.key``.
    """
    check_site_id(site_id)
    _check_days(days, "days")
    kit = legacy.require_format(Path(kit_dir))
    target = Path(out_dir) if out_dir is not None else kit / SITES_DIR / site_id
    if target.exists():
        raise ValueError(f"refusing to overwrite {str(target)!r}: remove it or pass out_dir")
    ca = load_private_key(kit / CA_KEY)
    ca_cert = load_ca_certificate(kit / CA_CERT)
    with _kit_lock(kit):
        start = int(time.time() if now is None else now)
        not_after = start + int(days * _SECONDS_PER_DAY)
        if not_after > ca_cert.not_after:
            raise ValueError(
                f"a certificate for {days} days would outlive the CA certificate {CA_CERT}, which "
                f"expires at {ca_cert.not_after}: issue for fewer days, or renew the CA"
            )
        curve_public, curve_secret = zmq.curve_keypair()
        cert = make_site_certificate(
            ca,
            site_id=site_id,
            curve_public=curve_public,
            not_before=start - _BACKDATE_S,
            not_after=not_after,
            serial=_new_serial(),
        )
        cert_pem = cert.to_pem()
        _write(_cert_path(kit, cert), cert_pem, _PUBLIC_MODE)
        _mkdir_private(target)
        _write(target / SITE_CURVE_KEY, curve_secret + b"\n", _PRIVATE_MODE)
        _write(target / SITE_CURVE_PUB, curve_public + b"\n", _PUBLIC_MODE)
        _write(target / SITE_CERT, cert_pem, _PUBLIC_MODE)
        for name in (CA_CERT, COORDINATOR_CURVE_PUB, COORDINATOR_SIGN_PUB):
            _write(target / name, (kit / name).read_bytes(), _PUBLIC_MODE)
        _write(target / SITE_TOML, _site_toml(site_id, coordinator_endpoint).encode(), _PUBLIC_MODE)
    log.info(
        "[site=%s] issued certificate serial=%s key=%s valid until %d",
        site_id,
        cert.serial,
        cert.fingerprint,
        cert.not_after,
    )
    return IssuedSite(certificate=cert, site_kit_dir=target)


def issued_certificates(kit_dir: str | Path) -> list[Certificate]:
    """Every certificate file in the kit's ``certs/`` that parses (unverified), by file name."""
    out: list[Certificate] = []
    for path in sorted((Path(kit_dir) / CERTS_DIR).glob(f"*{CERT_SUFFIX}")):
        try:
            out.append(load_certificate(path))
        except (OSError, AuthError) as exc:
            log.warning("skipping certificate file %s: %s", path.name, exc)
    return out


def revoke_site(kit_dir: str | Path, site_id: str, *, now: float | None = None) -> list[str]:
    """Revoke every certificate issued to ``site_id``; returns the serials newly revoked.

    Rewrites ``crl.pem`` (signed by the CA, cRLNumber + 1). A coordinator picks it up on its
    registry's next reload; connections already authenticated are cut by the per-message check
    (:meth:`CertificateRegistry.check_peer`).
    """
    check_site_id(site_id)
    kit = legacy.require_format(Path(kit_dir))
    ca = load_private_key(kit / CA_KEY)
    with _kit_lock(kit):
        current = load_revocations(kit / CRL, ca.public_key())
        serials = [c.serial for c in issued_certificates(kit) if c.site_id == site_id]
        if not serials:
            raise ValueError(f"no certificate was issued to site {site_id!r} in {str(kit)!r}")
        at = int(time.time() if now is None else now)
        new = [s for s in serials if s not in current.serials]
        if not new:
            return []
        updated = RevocationList(
            version=current.version + 1,
            issued_at=at,
            entries=current.entries + tuple(Revocation(serial=s, revoked_at=at) for s in new),
        )
        _write_crl(kit, ca, updated)
    log.info("[site=%s] revoked %d certificate(s): %s", site_id, len(new), ", ".join(new))
    return new


# ---------------------------------------------------------------------------------------------
# Loading kits for the running roles


@dataclass(frozen=True, kw_only=True)
class SecurityConfig:
    """How a role finds its keys. Embedded as ``[coordinator.security]`` / ``[site.security]``."""

    kit_dir: str = ""
    """The federation kit (coordinator) or the site's startup kit (site)."""
    insecure: bool = False
    """Run without CURVE and certificates: loopback demos and tests only, never over a WAN."""

    def __post_init__(self) -> None:
        if self.insecure and self.kit_dir:
            raise ValueError("security.insecure = true cannot be combined with security.kit_dir")

    def require(self) -> None:
        """Secure by default: a role without keys refuses to start unless ``insecure``."""
        if not self.insecure and not self.kit_dir:
            raise ValueError(
                "security.kit_dir is required (create one with `crossdc keys`), "
                "or set security.insecure = true for a loopback-only run"
            )


@dataclass(frozen=True, kw_only=True)
class CoordinatorKit:
    """What a running coordinator needs from the federation kit (not the CA private key)."""

    kit_dir: Path
    curve: CurveKeys
    """Server keys for the ROUTER (``ChannelConfig.curve``)."""
    signing_key: Ed25519PrivateKey
    """Signs global checkpoints (:func:`sign_blob`)."""
    ca_public_key: Ed25519PublicKey
    ca_not_after: int
    """When the CA certificate expires (unix seconds): no site certificate verifies after it."""


def load_coordinator_kit(kit_dir: str | Path) -> CoordinatorKit:
    kit = legacy.role_kit(Path(kit_dir), "coordinator")
    public, secret = _load_curve(kit / COORDINATOR_CURVE_KEY, kit / COORDINATOR_CURVE_PUB)
    ca = load_ca_certificate(kit / CA_CERT)
    return CoordinatorKit(
        kit_dir=kit,
        curve=CurveKeys(public=public, secret=secret),
        signing_key=load_private_key(kit / COORDINATOR_SIGN_KEY),
        ca_public_key=ca.public_key,
        ca_not_after=ca.not_after,
    )


@dataclass(frozen=True, kw_only=True)
class SiteKit:
    """What a running site agent needs from its startup kit."""

    site_id: str
    curve: CurveKeys
    """Client keys for the DEALER (``ChannelConfig.curve``, with the coordinator's key)."""
    certificate: Certificate
    ca_public_key: Ed25519PublicKey
    coordinator_sign_public: Ed25519PublicKey
    """Verifies the coordinator's signed checkpoints (:func:`verify_blob`)."""


_EXPIRY_WARNING_S = 7 * _SECONDS_PER_DAY


def load_site_kit(
    site_kit_dir: str | Path, *, site_id: str | None = None, now: float | None = None
) -> SiteKit:
    """Load and check a site's startup kit: its certificate must be signed by the kit's CA,
    certify the kit's own CURVE key (and ``site_id`` when given) and be valid now; otherwise
    :class:`AuthError` explains why, before any connection is refused for it."""
    kit = legacy.role_kit(Path(site_kit_dir), "site")
    at = time.time() if now is None else now
    public, secret = _load_curve(kit / SITE_CURVE_KEY, kit / SITE_CURVE_PUB)
    cert = load_certificate(kit / SITE_CERT)
    ca_public = load_ca_certificate(kit / CA_CERT).public_key
    cert.verify(ca_public, at, site_id=site_id)
    if cert.curve_public != public:
        raise AuthError("unknown_key", f"{SITE_CERT} in {str(kit)!r} certifies another CURVE key")
    if cert.not_after - at < _EXPIRY_WARNING_S:
        log.warning(
            "[site=%s] certificate serial=%s expires in %.1f days: ask for a new kit",
            cert.site_id,
            cert.serial,
            (cert.not_after - at) / _SECONDS_PER_DAY,
        )
    server_public = (kit / COORDINATOR_CURVE_PUB).read_bytes().strip()
    return SiteKit(
        site_id=cert.site_id,
        curve=CurveKeys(public=public, secret=secret, server_public=server_public),
        certificate=cert,
        ca_public_key=ca_public,
        coordinator_sign_public=load_public_key(kit / COORDINATOR_SIGN_PUB),
    )
