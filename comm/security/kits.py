"""Federation kits on disk: create, issue a site, revoke a site, load a running role's keys.

A federation kit directory (:func:`init_kit`) holds::

    kit.json                    manifest (public values only; "format": 2)
    ca.key        0600          the current CA's Ed25519 private key (PEM; keep offline once
                                sites are issued)
    ca.pem                      the CA certificates trusted (X.509, self-signed): the current
                                CA's, and during a CA rollover the previous CA's after it
    coordinator.curve.key 0600  coordinator CURVE secret (Z85)
    coordinator.curve.pub       coordinator CURVE public key (Z85)
    coordinator.sign.key  0600  coordinator Ed25519 checkpoint-signing key (PEM)
    coordinator.sign.pub        its public key (PEM)
    crl.pem                     each CA's signed revocation list (X.509 CRL)
    certs/<site>-<serial>.pem   every certificate issued (X.509; the coordinator trusts these)
    sites/<site>/               each site's startup kit, to ship to that site and then delete here

and during and after a CA rollover (``comm.security.rollover``) ``previous-ca.key``,
``rollover/<site>/`` and ``retired/<fingerprint>/``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.security.certs import (
    CACertificate,
    Certificate,
    load_ca_bundle,
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
    PREVIOUS_CA_KEY,
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
from comm.security.crl import (
    Revocation,
    RevocationList,
    parse_revocation_bundle,
    split_revocations,
)
from comm.security.signing import (
    _private_pem,
    _public_pem,
    generate_signing_key,
    load_private_key,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Which kits this crossdc reads

_FORMAT1_CA_PUB = "ca.pub"
"""A kit of format 1 (crossdc's own one-line certificates, before X.509) held its CA key here."""

_REISSUE_HINT = (
    "this crossdc no longer reads it: make a new federation kit with `crossdc keys init` and "
    "re-issue every site with `crossdc keys issue --kit KIT --site SITE`"
)


def require_format(kit: Path) -> Path:
    """A federation kit of this format, or ValueError saying what it is and what to do."""
    if not (kit / MANIFEST).exists():
        raise ValueError(f"{str(kit)!r} is not a federation kit (no {MANIFEST})")
    try:
        found = json.loads((kit / MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{str(kit / MANIFEST)!r} is not a kit manifest: {exc}") from None
    if found == 1:
        raise ValueError(
            f"{str(kit)!r} is a format-1 kit (crossdc's own certificates, before X.509); "
            f"{_REISSUE_HINT}"
        )
    if found != KIT_FORMAT:
        raise ValueError(f"{str(kit)!r} has kit format {found!r}; this crossdc reads {KIT_FORMAT}")
    return kit


def role_kit(kit: Path, role: str) -> Path:
    """A running role's kit directory, unless it is a format-1 kit or holds no CA certificate."""
    if (kit / CA_CERT).exists():
        return kit
    if (kit / _FORMAT1_CA_PUB).exists():
        what = "site kit" if role == "site" else "kit"
        raise ValueError(
            f"{str(kit)!r} is a format-1 {what} (crossdc's own certificates, before X.509); "
            f"{_REISSUE_HINT}"
        )
    raise ValueError(f"{str(kit)!r} has no CA certificate {CA_CERT}: is it a crossdc kit?")


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


def _crl_blocks(kit: Path, cas: Sequence[CACertificate]) -> dict[str, bytes]:
    """The CRLs in ``crl.pem`` by the fingerprint of their CA (none when there is no file)."""
    if not (kit / CRL).exists():
        return {}
    return split_revocations((kit / CRL).read_bytes(), [c.public_key for c in cas])


def _write_crl_blocks(kit: Path, cas: Sequence[CACertificate], blocks: dict[str, bytes]) -> None:
    """Write ``crl.pem``: the CRL of each CA of ``cas`` that ``blocks`` holds, in that order."""
    pem = b"".join(blocks[c.fingerprint] for c in cas if c.fingerprint in blocks)
    _write(kit / CRL, pem, _PUBLIC_MODE, replace=(kit / CRL).exists())


def _write_crl(kit: Path, ca: Ed25519PrivateKey, revocations: RevocationList) -> None:
    """Sign ``revocations`` as the CRL of ``ca`` (a CA of ``ca.pem``) and put it in ``crl.pem``
    in place of that CA's previous one, keeping the other CA's (during a rollover)."""
    cas = load_ca_bundle(kit / CA_CERT)
    fingerprint = key_fingerprint(ca.public_key())
    ca_cert = next((c for c in cas if c.fingerprint == fingerprint), None)
    if ca_cert is None:
        raise ValueError(f"CA {fingerprint} is not in {str(kit / CA_CERT)!r}")
    blocks = _crl_blocks(kit, cas)
    blocks[fingerprint] = revocations.to_pem(ca, next_update=ca_cert.not_after)
    _write_crl_blocks(kit, cas, blocks)


def _ca_keys(kit: Path, cas: Sequence[CACertificate]) -> dict[str, Ed25519PrivateKey]:
    """The CA private keys the kit holds, by fingerprint: ``ca.key`` (the current CA, first in
    ``ca.pem``) and, during a CA rollover, ``previous-ca.key``. ValueError when a key file is
    not the key of the CA it stands for."""
    current = load_private_key(kit / CA_KEY)
    if key_fingerprint(current.public_key()) != cas[0].fingerprint:
        raise ValueError(
            f"{CA_KEY} (CA {key_fingerprint(current.public_key())}) is not the key of the "
            f"current CA {cas[0].fingerprint}, the first certificate of {CA_CERT}"
        )
    keys = {cas[0].fingerprint: current}
    if (kit / PREVIOUS_CA_KEY).exists():
        previous = load_private_key(kit / PREVIOUS_CA_KEY)
        fingerprint = key_fingerprint(previous.public_key())
        if fingerprint not in {c.fingerprint for c in cas[1:]}:
            raise ValueError(
                f"{PREVIOUS_CA_KEY} (CA {fingerprint}) is the key of no other CA in {CA_CERT}"
            )
        keys[fingerprint] = previous
    return keys


def _cert_path(kit: Path, cert: Certificate) -> Path:
    return kit / CERTS_DIR / f"{cert.site_id}-{cert.serial}{CERT_SUFFIX}"


@dataclass(frozen=True, kw_only=True)
class IssuedSite:
    certificate: Certificate
    site_kit_dir: Path


def _site_toml(site_id: str, endpoints: Sequence[str], kit_name: str) -> str:
    """The starter config: the coordinator's endpoint, or with several (a coordinator of
    several shards, shard 0's first) shard 0's and every shard's."""
    shards = ""
    if len(endpoints) > 1:
        shards = "coordinator_shards = [" + ", ".join(f'"{e}"' for e in endpoints) + "]\n"
    return (
        f"# Starter config for site {site_id!r}. Keep this kit directory private to the site\n"
        "# (site.curve.key is its secret key); point kit_dir at where it lives on the site.\n"
        "[site]\n"
        f'site_id = "{site_id}"\n'
        f'coordinator = "{endpoints[0]}"\n'
        f"{shards}"
        "\n"
        "[site.security]\n"
        f'kit_dir = "./{kit_name}"\n'
    )


def issue_site(
    kit_dir: str | Path,
    site_id: str,
    days: float,
    *,
    out_dir: str | Path | None = None,
    coordinator_endpoint: str | Sequence[str] = "tcp://COORDINATOR_HOST:7710",
    now: float | None = None,
) -> IssuedSite:
    """Issue site ``site_id`` a CURVE keypair and an X.509 certificate valid for ``days`` from
    ``now`` (and from 5 minutes before, for clock skew), never past the CA's own expiry.

    The certificate is recorded in ``certs/`` (what the coordinator trusts) and a startup kit is
    written to ``out_dir`` (default ``sites/<site_id>`` in the kit; it must not exist yet): the
    site's CURVE secret (0600) and public key, its certificate ``site.pem``, the CA certificate,
    the coordinator's CURVE and signing public keys and a starter ``site.toml`` naming the
    coordinator's endpoint (several: every shard's of a sharded coordinator, shard 0's first).
    Needs ``ca.key``.
    """
    endpoints = (
        (coordinator_endpoint,)
        if isinstance(coordinator_endpoint, str)
        else tuple(coordinator_endpoint)
    )
    if not endpoints or len(set(endpoints)) != len(endpoints):
        raise ValueError(f"the coordinator's endpoints must be distinct, got {endpoints!r}")
    check_site_id(site_id)
    _check_days(days, "days")
    kit = require_format(Path(kit_dir))
    target = Path(out_dir) if out_dir is not None else kit / SITES_DIR / site_id
    if target.exists():
        raise ValueError(f"refusing to overwrite {str(target)!r}: remove it or pass out_dir")
    with _kit_lock(kit):
        cas = load_ca_bundle(kit / CA_CERT)
        ca_cert = cas[0]
        ca = _ca_keys(kit, cas)[ca_cert.fingerprint]
        start = int(time.time() if now is None else now)
        not_after = start + int(days * _SECONDS_PER_DAY)
        if not_after > ca_cert.not_after:
            raise ValueError(
                f"a certificate for {days} days would outlive the CA certificate {CA_CERT}, which "
                f"expires at {ca_cert.not_after}: issue for fewer days, or roll the CA over "
                "(crossdc keys rotate-ca)"
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
        _write(
            target / SITE_TOML,
            _site_toml(site_id, endpoints, target.name).encode(),
            _PUBLIC_MODE,
        )
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

    Rewrites ``crl.pem``: the CRL of each CA that issued one of them, signed by that CA with
    cRLNumber + 1 (during a CA rollover both CAs', which needs ``previous-ca.key`` too). A
    coordinator picks it up on its registry's next reload; connections already authenticated
    are cut by the per-message check (:meth:`CertificateRegistry.check_peer`).
    """
    check_site_id(site_id)
    kit = require_format(Path(kit_dir))
    with _kit_lock(kit):
        cas = load_ca_bundle(kit / CA_CERT)
        keys = _ca_keys(kit, cas)
        certs = [c for c in issued_certificates(kit) if c.site_id == site_id]
        if not certs:
            raise ValueError(f"no certificate was issued to site {site_id!r} in {str(kit)!r}")
        at = int(time.time() if now is None else now)
        lists = parse_revocation_bundle((kit / CRL).read_bytes(), [c.public_key for c in cas])
        new: list[str] = []
        changed: dict[str, RevocationList] = {}
        for ca in cas:
            current = lists.get(ca.fingerprint)
            if current is None:
                raise ValueError(
                    f"{str(kit / CRL)!r} holds no revocation list of CA {ca.fingerprint}: put "
                    "back the kit's crl.pem (a list rebuilt empty would un-revoke)"
                )
            serials = [
                c.serial
                for c in certs
                if c.issuer_among([ca]) is not None and c.serial not in current.serials
            ]
            if not serials:
                continue
            if ca.fingerprint not in keys:
                raise ValueError(
                    f"site {site_id!r} holds certificates of CA {ca.fingerprint}, whose key "
                    f"{PREVIOUS_CA_KEY} is not in {str(kit)!r}: put it back to revoke them"
                )
            changed[ca.fingerprint] = RevocationList(
                version=current.version + 1,
                issued_at=at,
                entries=current.entries
                + tuple(Revocation(serial=s, revoked_at=at) for s in serials),
            )
            new += serials
        for fingerprint, updated in changed.items():
            _write_crl(kit, keys[fingerprint], updated)
    if new:
        log.info("[site=%s] revoked %d certificate(s): %s", site_id, len(new), ", ".join(new))
    return new
