"""A federation's key material: the CA, the coordinator's keys, site certificates, revocations.

This module owns every key and signed document crossdc uses (DESIGN.md §3, docs/security.md):

- the federation CA, an Ed25519 key that signs site certificates and the revocation list;
- the coordinator's CURVE keypair (the ROUTER's server key) and its Ed25519 signing key for
  global checkpoints (:func:`sign_blob` / :func:`verify_blob`);
- per site, a CURVE keypair and a :class:`Certificate` binding ``(site_id, CURVE public key,
  validity, serial)``, signed by the CA, shipped to the site as a startup kit directory;
- the signed revocation list, and :class:`CertificateRegistry`, the coordinator's view of which
  CURVE keys belong to which site right now (what the ZAP handler in ``comm.zap`` asks).

A federation kit directory (``init_kit``) holds::

    kit.json                    manifest (public values only)
    ca.key        0600          CA Ed25519 private key (PEM; keep offline once sites are issued)
    ca.pub                      CA Ed25519 public key (PEM)
    coordinator.curve.key 0600  coordinator CURVE secret (Z85)
    coordinator.curve.pub       coordinator CURVE public key (Z85)
    coordinator.sign.key  0600  coordinator Ed25519 checkpoint-signing key (PEM)
    coordinator.sign.pub        its public key (PEM)
    revoked.list                CA-signed revocation list
    certs/<site>-<serial>.cert  every certificate issued (the coordinator trusts these)
    sites/<site>/               each site's startup kit, to ship to that site and then delete here

Signed documents are one line, ``<kind>.<base64url body>.<base64url signature>``; the body is
canonical JSON and the Ed25519 signature covers ``<kind>\\0<body>`` so that a signature made for
one kind of document is never valid for another. No function here logs or prints a key: logs
carry a key's 16-hex-digit fingerprint (:func:`key_fingerprint`) at most.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.utils.z85 as z85
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.channel import CurveKeys

log = logging.getLogger(__name__)

KIT_FORMAT = 1

MANIFEST = "kit.json"
CA_KEY = "ca.key"
CA_PUB = "ca.pub"
COORDINATOR_CURVE_KEY = "coordinator.curve.key"
COORDINATOR_CURVE_PUB = "coordinator.curve.pub"
COORDINATOR_SIGN_KEY = "coordinator.sign.key"
COORDINATOR_SIGN_PUB = "coordinator.sign.pub"
REVOCATIONS = "revoked.list"
CERTS_DIR = "certs"
SITES_DIR = "sites"
SITE_CURVE_KEY = "site.curve.key"
SITE_CURVE_PUB = "site.curve.pub"
SITE_CERT = "site.cert"
SITE_TOML = "site.toml"

CERT_KIND = "crossdc-cert-v1"
REVOCATIONS_KIND = "crossdc-revocations-v1"
BLOB_KIND = "crossdc-blob-v1"

_PRIVATE_MODE = 0o600
_PUBLIC_MODE = 0o644
_DIR_MODE = 0o700
_SITE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SECONDS_PER_DAY = 86400
_BACKDATE_S = 300
"""A new certificate is valid from 5 minutes before it was issued, for clock skew between the
machine that issues it and the coordinator that checks it."""

AuthReason = Literal[
    "unknown_key", "expired", "not_yet_valid", "revoked", "bad_signature", "wrong_site"
]
"""Why a peer or document is refused. ``bad_signature`` also covers a malformed document."""


class AuthError(ValueError):
    """A certificate, revocation list or signature that must not be trusted, with its reason."""

    def __init__(self, reason: AuthReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: AuthReason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Small helpers: encodings, fingerprints, files


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _signed_message(kind: str, body: bytes) -> bytes:
    return kind.encode() + b"\0" + body


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def curve_raw(public_key: bytes) -> bytes:
    """A CURVE public key as its 32 raw bytes, from raw or Z85 (40 characters) form."""
    if len(public_key) == 32:
        return public_key
    if len(public_key) == 40:
        try:
            return z85.decode(public_key)
        except (ValueError, KeyError) as exc:
            raise ValueError("not a Z85-encoded CURVE key") from exc
    raise ValueError(
        f"a CURVE public key has 32 raw bytes or 40 Z85 characters, not {len(public_key)}"
    )


def key_fingerprint(public_key: bytes | Ed25519PublicKey) -> str:
    """16 hex digits naming a public key in logs (SHA-256 of the raw key); never the key itself."""
    raw = _raw_public(public_key) if isinstance(public_key, Ed25519PublicKey) else public_key
    if len(raw) == 40:
        raw = curve_raw(raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def check_site_id(site_id: str) -> str:
    if not _SITE_ID.match(site_id):
        raise ValueError(f"site_id must be 1-64 letters, digits, '-' or '_', got {site_id!r}")
    return site_id


def _write(path: Path, data: bytes, mode: int, *, replace: bool = False) -> None:
    """Write a file with ``mode`` from its first byte on; fsync; atomically replace if asked."""
    target = path.with_name(path.name + ".tmp") if replace else path
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    if replace:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
    fd = os.open(target, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; make it exact
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if replace:
        os.replace(target, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkdir_private(path: Path) -> None:
    path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, _DIR_MODE)


def _read_private(path: Path) -> bytes:
    """Read a private key file, refusing one that others can read (like ssh does)."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(
            f"private key file {str(path)!r} has mode {mode:04o}; it must not be readable by "
            "group or others (chmod 600)"
        )
    return path.read_bytes()


@contextlib.contextmanager
def _kit_lock(kit_dir: Path) -> Iterator[None]:
    """Serialize issue/revoke on one kit (two operators, or a CLI and a script)."""
    fd = os.open(kit_dir / ".lock", os.O_WRONLY | os.O_CREAT, _PRIVATE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Ed25519 keys and blob signatures


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file that only its owner can read."""
    key = serialization.load_pem_private_key(_read_private(Path(path)), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{str(path)!r} does not hold an Ed25519 private key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file."""
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{str(path)!r} does not hold an Ed25519 public key")
    return key


def blob_digest(data: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of a blob: what :func:`sign_digest` signs (hash a file piecewise the same way)."""
    return hashlib.sha256(data).digest()


def _digest_message(digest: bytes, context: str) -> bytes:
    if len(digest) != 32:
        raise ValueError(f"a blob digest is 32 bytes of SHA-256, got {len(digest)}")
    return _signed_message(BLOB_KIND, context.encode() + b"\0" + bytes(digest))


def sign_digest(
    private_key: Ed25519PrivateKey, digest: bytes, *, context: str = "checkpoint"
) -> bytes:
    """Sign a blob by its SHA-256 ``digest``, so a multi-GB checkpoint can be hashed streaming."""
    return private_key.sign(_digest_message(digest, context))


def verify_digest(
    public_key: Ed25519PublicKey, digest: bytes, signature: bytes, *, context: str = "checkpoint"
) -> None:
    """Raise :class:`AuthError` (``bad_signature``) unless ``signature`` signs ``digest``."""
    try:
        public_key.verify(bytes(signature), _digest_message(digest, context))
    except InvalidSignature:
        raise AuthError(
            "bad_signature",
            f"{context} signature does not verify with key {key_fingerprint(public_key)}",
        ) from None


def sign_blob(
    private_key: Ed25519PrivateKey,
    data: bytes | bytearray | memoryview,
    *,
    context: str = "checkpoint",
) -> bytes:
    """A 64-byte Ed25519 signature over ``data`` for ``context``.

    ``context`` names what the blob is (``checkpoint``, ``global``): a signature made for one
    context does not verify for another. Equal to ``sign_digest(key, blob_digest(data))``.
    """
    return sign_digest(private_key, blob_digest(data), context=context)


def verify_blob(
    public_key: Ed25519PublicKey,
    data: bytes | bytearray | memoryview,
    signature: bytes,
    *,
    context: str = "checkpoint",
) -> None:
    """Raise :class:`AuthError` (``bad_signature``) unless ``signature`` signs ``data``."""
    verify_digest(public_key, blob_digest(data), signature, context=context)


# ---------------------------------------------------------------------------------------------
# Signed one-line documents


def _seal(kind: str, body: dict[str, Any], key: Ed25519PrivateKey) -> str:
    raw = _canonical(body)
    return f"{kind}.{_b64(raw)}.{_b64(key.sign(_signed_message(kind, raw)))}"


def _unseal(kind: str, text: str) -> tuple[bytes, dict[str, Any], bytes]:
    """Split a document into (body bytes, parsed body, signature); nothing is verified yet."""
    parts = text.strip().split(".")
    if len(parts) != 3 or parts[0] != kind:
        raise AuthError("bad_signature", f"not a {kind} document")
    try:
        raw = _unb64(parts[1])
        signature = _unb64(parts[2])
        body = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise AuthError("bad_signature", f"malformed {kind} document: {exc}") from None
    if not isinstance(body, dict) or body.get("v") != 1 or len(signature) != 64:
        raise AuthError("bad_signature", f"malformed {kind} document")
    return raw, body, signature


def _field(body: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise AuthError("bad_signature", f"malformed {what}: field {name!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Certificates


@dataclass(frozen=True, kw_only=True)
class Certificate:
    """A CA's statement "CURVE key ``curve_public`` is site ``site_id`` from ``not_before`` to
    ``not_after`` (unix seconds)", with a unique ``serial``. Build with :func:`issue_site` or
    :meth:`from_text`; a Certificate proves nothing until :meth:`verify` passes."""

    site_id: str
    curve_public: bytes
    """The site's CURVE public key, Z85 (40 bytes)."""
    not_before: int
    not_after: int
    serial: str
    """32 hex digits, random; what the revocation list names."""
    issuer: str
    """Fingerprint of the CA key that signed it."""
    signature: bytes = b""

    def body(self) -> bytes:
        """The canonical bytes the signature covers."""
        return _canonical(
            {
                "v": 1,
                "site_id": self.site_id,
                "curve_public": self.curve_public.decode("ascii"),
                "not_before": self.not_before,
                "not_after": self.not_after,
                "serial": self.serial,
                "issuer": self.issuer,
            }
        )

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the certified CURVE key (for logs)."""
        return key_fingerprint(self.curve_public)

    def to_text(self) -> str:
        return f"{CERT_KIND}.{_b64(self.body())}.{_b64(self.signature)}"

    @classmethod
    def from_text(cls, text: str) -> Certificate:
        """Parse a certificate; raises :class:`AuthError` (``bad_signature``) if malformed."""
        raw, body, signature = _unseal(CERT_KIND, text)
        what = "certificate"
        cert = cls(
            site_id=_field(body, "site_id", str, what),
            curve_public=_field(body, "curve_public", str, what).encode("ascii", "replace"),
            not_before=_field(body, "not_before", int, what),
            not_after=_field(body, "not_after", int, what),
            serial=_field(body, "serial", str, what),
            issuer=_field(body, "issuer", str, what),
            signature=signature,
        )
        if cert.body() != raw:
            # Signing covers the canonical body; anything else was not made by issue_site.
            raise AuthError("bad_signature", "certificate body is not canonical")
        return cert

    def verify_signature(self, ca_public_key: Ed25519PublicKey) -> None:
        """Raise :class:`AuthError` (``bad_signature``) unless the CA signed this certificate."""
        try:
            ca_public_key.verify(self.signature, _signed_message(CERT_KIND, self.body()))
        except InvalidSignature:
            raise AuthError(
                "bad_signature",
                f"certificate serial={self.serial} of site {self.site_id!r} is not signed by "
                f"CA {key_fingerprint(ca_public_key)}",
            ) from None

    def verify(
        self,
        ca_public_key: Ed25519PublicKey,
        now: float,
        *,
        site_id: str | None = None,
        revoked: Collection[str] = (),
    ) -> None:
        """Raise :class:`AuthError` unless this certificate is signed by the CA, names
        ``site_id`` (when given), is not revoked and is valid at ``now`` (unix seconds).
        Checked in that order, so the reason is the most fundamental failure."""
        self.verify_signature(ca_public_key)
        if site_id is not None and site_id != self.site_id:
            raise AuthError(
                "wrong_site", f"certificate is for site {self.site_id!r}, not {site_id!r}"
            )
        if self.serial in revoked:
            raise AuthError(
                "revoked", f"certificate serial={self.serial} of site {self.site_id!r} is revoked"
            )
        if now < self.not_before:
            raise AuthError(
                "not_yet_valid",
                f"certificate serial={self.serial} of site {self.site_id!r} is valid from "
                f"{self.not_before}, now is {int(now)}",
            )
        if now >= self.not_after:
            raise AuthError(
                "expired",
                f"certificate serial={self.serial} of site {self.site_id!r} expired at "
                f"{self.not_after}, now is {int(now)}",
            )


def load_certificate(path: str | Path) -> Certificate:
    """Read a certificate file (unverified: call :meth:`Certificate.verify`)."""
    return Certificate.from_text(Path(path).read_text(encoding="ascii", errors="replace"))


# ---------------------------------------------------------------------------------------------
# Revocation list


@dataclass(frozen=True, kw_only=True)
class Revocation:
    serial: str
    site_id: str
    revoked_at: int


@dataclass(frozen=True, kw_only=True)
class RevocationList:
    """The CA-signed list of revoked certificate serials. ``version`` only ever grows, so a
    coordinator can refuse an older list put back in place of a newer one."""

    version: int
    issued_at: int
    entries: tuple[Revocation, ...]

    @property
    def serials(self) -> frozenset[str]:
        return frozenset(e.serial for e in self.entries)

    def _body(self) -> dict[str, Any]:
        return {
            "v": 1,
            "version": self.version,
            "issued_at": self.issued_at,
            "revoked": [
                {"serial": e.serial, "site_id": e.site_id, "revoked_at": e.revoked_at}
                for e in self.entries
            ],
        }

    def seal(self, ca_key: Ed25519PrivateKey) -> str:
        return _seal(REVOCATIONS_KIND, self._body(), ca_key)


def parse_revocations(text: str, ca_public_key: Ed25519PublicKey) -> RevocationList:
    """Parse and verify a revocation list; raises :class:`AuthError` (``bad_signature``)."""
    raw, body, signature = _unseal(REVOCATIONS_KIND, text)
    try:
        ca_public_key.verify(signature, _signed_message(REVOCATIONS_KIND, raw))
    except InvalidSignature:
        raise AuthError(
            "bad_signature",
            f"revocation list is not signed by CA {key_fingerprint(ca_public_key)}",
        ) from None
    what = "revocation list"
    items = body.get("revoked")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise AuthError("bad_signature", f"malformed {what}: field 'revoked'")
    return RevocationList(
        version=_field(body, "version", int, what),
        issued_at=_field(body, "issued_at", int, what),
        entries=tuple(
            Revocation(
                serial=_field(i, "serial", str, what),
                site_id=_field(i, "site_id", str, what),
                revoked_at=_field(i, "revoked_at", int, what),
            )
            for i in items
        ),
    )


def load_revocations(path: str | Path, ca_public_key: Ed25519PublicKey) -> RevocationList:
    """Read and verify a revocation list file (see :func:`parse_revocations`)."""
    return parse_revocations(
        Path(path).read_text(encoding="ascii", errors="replace"), ca_public_key
    )


# ---------------------------------------------------------------------------------------------
# Kit lifecycle: init, issue, revoke


def _load_curve(secret_path: Path, public_path: Path) -> tuple[bytes, bytes]:
    secret = _read_private(secret_path).strip()
    public = public_path.read_bytes().strip()
    if len(secret) != 40 or zmq.curve_public(secret) != public:
        raise ValueError(f"CURVE keys {str(secret_path)!r} and {str(public_path)!r} do not match")
    return public, secret


def init_kit(kit_dir: str | Path, *, now: float | None = None) -> Path:
    """Create a federation kit in ``kit_dir`` (new or empty): the CA, the coordinator's CURVE
    and signing keys, an empty signed revocation list and the manifest. Returns the directory.

    Refuses (ValueError naming the path) to touch a directory that already holds anything.
    """
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
    _write(kit / CA_KEY, _private_pem(ca), _PRIVATE_MODE)
    _write(kit / CA_PUB, _public_pem(ca.public_key()), _PUBLIC_MODE)
    _write(kit / COORDINATOR_CURVE_KEY, curve_secret + b"\n", _PRIVATE_MODE)
    _write(kit / COORDINATOR_CURVE_PUB, curve_public + b"\n", _PUBLIC_MODE)
    _write(kit / COORDINATOR_SIGN_KEY, _private_pem(signer), _PRIVATE_MODE)
    _write(kit / COORDINATOR_SIGN_PUB, _public_pem(signer.public_key()), _PUBLIC_MODE)
    empty = RevocationList(version=0, issued_at=issued_at, entries=())
    _write(kit / REVOCATIONS, (empty.seal(ca) + "\n").encode(), _PUBLIC_MODE)
    manifest = {
        "format": KIT_FORMAT,
        "created_at": issued_at,
        "ca_fingerprint": key_fingerprint(ca.public_key()),
        "coordinator_curve_fingerprint": key_fingerprint(curve_public),
        "coordinator_sign_fingerprint": key_fingerprint(signer.public_key()),
    }
    body = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    _write(kit / MANIFEST, body.encode(), _PUBLIC_MODE)
    log.info("created federation kit %s (CA %s)", kit, manifest["ca_fingerprint"])
    return kit


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
    """Issue site ``site_id`` a CURVE keypair and a certificate valid for ``days`` from ``now``
    (and from 5 minutes before, for clock skew).

    The certificate is recorded in ``certs/`` (what the coordinator trusts) and a startup kit is
    written to ``out_dir`` (default ``sites/<site_id>`` in the kit; it must not exist yet): the
    site's CURVE secret (0600) and public key, its certificate, the coordinator's CURVE and
    signing public keys, the CA public key and a starter ``site.toml``. Needs ``ca.key``.
    """
    check_site_id(site_id)
    if not (days > 0 and days * _SECONDS_PER_DAY < 2**40):
        raise ValueError(f"days must be a positive number of days, got {days!r}")
    kit = Path(kit_dir)
    target = Path(out_dir) if out_dir is not None else kit / SITES_DIR / site_id
    if target.exists():
        raise ValueError(f"refusing to overwrite {str(target)!r}: remove it or pass out_dir")
    ca = load_private_key(kit / CA_KEY)
    with _kit_lock(kit):
        start = int(time.time() if now is None else now)
        curve_public, curve_secret = zmq.curve_keypair()
        unsigned = Certificate(
            site_id=site_id,
            curve_public=curve_public,
            not_before=start - _BACKDATE_S,
            not_after=start + int(days * _SECONDS_PER_DAY),
            serial=secrets.token_hex(16),
            issuer=key_fingerprint(ca.public_key()),
        )
        signature = ca.sign(_signed_message(CERT_KIND, unsigned.body()))
        cert = dataclasses.replace(unsigned, signature=signature)
        cert_text = (cert.to_text() + "\n").encode()
        _write(kit / CERTS_DIR / f"{site_id}-{cert.serial}.cert", cert_text, _PUBLIC_MODE)
        _mkdir_private(target)
        _write(target / SITE_CURVE_KEY, curve_secret + b"\n", _PRIVATE_MODE)
        _write(target / SITE_CURVE_PUB, curve_public + b"\n", _PUBLIC_MODE)
        _write(target / SITE_CERT, cert_text, _PUBLIC_MODE)
        for name in (CA_PUB, COORDINATOR_CURVE_PUB, COORDINATOR_SIGN_PUB):
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
    for path in sorted((Path(kit_dir) / CERTS_DIR).glob("*.cert")):
        try:
            out.append(load_certificate(path))
        except (OSError, AuthError) as exc:
            log.warning("skipping certificate file %s: %s", path.name, exc)
    return out


def revoke_site(kit_dir: str | Path, site_id: str, *, now: float | None = None) -> list[str]:
    """Revoke every certificate issued to ``site_id``; returns the serials newly revoked.

    Rewrites ``revoked.list`` (signed by the CA, version + 1). A coordinator picks it up on its
    registry's next reload; connections already authenticated are cut by the per-message check
    (:meth:`CertificateRegistry.check_peer`).
    """
    check_site_id(site_id)
    kit = Path(kit_dir)
    ca = load_private_key(kit / CA_KEY)
    with _kit_lock(kit):
        current = load_revocations(kit / REVOCATIONS, ca.public_key())
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
            entries=current.entries
            + tuple(Revocation(serial=s, site_id=site_id, revoked_at=at) for s in new),
        )
        _write(kit / REVOCATIONS, (updated.seal(ca) + "\n").encode(), _PUBLIC_MODE, replace=True)
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


def load_coordinator_kit(kit_dir: str | Path) -> CoordinatorKit:
    kit = Path(kit_dir)
    public, secret = _load_curve(kit / COORDINATOR_CURVE_KEY, kit / COORDINATOR_CURVE_PUB)
    return CoordinatorKit(
        kit_dir=kit,
        curve=CurveKeys(public=public, secret=secret),
        signing_key=load_private_key(kit / COORDINATOR_SIGN_KEY),
        ca_public_key=load_public_key(kit / CA_PUB),
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
    kit = Path(site_kit_dir)
    at = time.time() if now is None else now
    public, secret = _load_curve(kit / SITE_CURVE_KEY, kit / SITE_CURVE_PUB)
    cert = load_certificate(kit / SITE_CERT)
    ca_public = load_public_key(kit / CA_PUB)
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


# ---------------------------------------------------------------------------------------------
# The coordinator's registry of certified keys


@dataclass(frozen=True)
class _Snapshot:
    by_key: dict[bytes, tuple[Certificate, ...]]
    by_serial: dict[str, Certificate]
    revocations: RevocationList
    stamp: tuple[tuple[str, int, int], ...]


class CertificateRegistry:
    """Which CURVE keys belong to which site now: issued certificates minus revoked ones.

    Built from certificates in memory, or from a kit directory with :meth:`from_kit`, in which
    case it re-reads ``certs/`` and ``revoked.list`` when they change (checked at most every
    ``reload_interval_s``) or on :meth:`reload`. Certificates that do not verify against the CA
    are skipped at load with a warning. Revocations only accumulate in a running registry: a
    revocation list that is missing, unsigned or older than the one loaded is refused and the
    loaded one kept. Thread-safe: lookups read an immutable snapshot swapped under a lock.
    """

    def __init__(
        self,
        ca_public_key: Ed25519PublicKey,
        certificates: Iterable[Certificate] = (),
        revocations: RevocationList | None = None,
        *,
        kit_dir: str | Path | None = None,
        reload_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ca_public_key = ca_public_key
        self.kit_dir = Path(kit_dir) if kit_dir is not None else None
        self.reload_interval_s = reload_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at = clock()
        revs = revocations or RevocationList(version=0, issued_at=0, entries=())
        self._snap = self._build(list(certificates), revs, ())

    @classmethod
    def from_kit(
        cls, kit_dir: str | Path, *, reload_interval_s: float = 1.0
    ) -> CertificateRegistry:
        kit = Path(kit_dir)
        reg = cls(load_public_key(kit / CA_PUB), kit_dir=kit, reload_interval_s=reload_interval_s)
        reg.reload()
        return reg

    def _build(
        self,
        certs: list[Certificate],
        revocations: RevocationList,
        stamp: tuple[tuple[str, int, int], ...],
    ) -> _Snapshot:
        by_key: dict[bytes, list[Certificate]] = {}
        by_serial: dict[str, Certificate] = {}
        for cert in certs:
            try:
                # Validity in time and revocation are checked per lookup; here only the CA.
                cert.verify_signature(self.ca_public_key)
                raw = curve_raw(cert.curve_public)
            except (AuthError, ValueError) as exc:
                log.warning("skipping certificate serial=%s: %s", cert.serial, exc)
                continue
            by_key.setdefault(raw, []).append(cert)
            by_serial[cert.serial] = cert
        return _Snapshot(
            by_key={k: tuple(v) for k, v in by_key.items()},
            by_serial=by_serial,
            revocations=revocations,
            stamp=stamp,
        )

    def _stamp(self) -> tuple[tuple[str, int, int], ...]:
        assert self.kit_dir is not None
        out = []
        for path in [self.kit_dir / CERTS_DIR, self.kit_dir / REVOCATIONS]:
            try:
                st = path.stat()
                out.append((path.name, st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append((path.name, -1, -1))
        return tuple(out)

    def reload(self) -> None:
        """Re-read the kit directory now (no-op for an in-memory registry)."""
        if self.kit_dir is None:
            return
        with self._lock:
            stamp = self._stamp()
            certs = issued_certificates(self.kit_dir)
            revs = self._snap.revocations
            try:
                loaded = load_revocations(self.kit_dir / REVOCATIONS, self.ca_public_key)
                if loaded.version < revs.version:
                    log.error(
                        "refusing revocation list version %d older than loaded version %d",
                        loaded.version,
                        revs.version,
                    )
                else:
                    revs = loaded
            except (OSError, AuthError) as exc:
                log.error("keeping the loaded revocation list: %s", exc)
            self._snap = self._build(certs, revs, stamp)
            self._checked_at = self._clock()

    def _maybe_reload(self) -> None:
        if self.kit_dir is None or self._clock() - self._checked_at < self.reload_interval_s:
            return
        self._checked_at = self._clock()
        if self._stamp() != self._snap.stamp:
            self.reload()

    @property
    def revoked_serials(self) -> frozenset[str]:
        return self._snap.revocations.serials

    def authorize(self, curve_public: bytes, now: float) -> Certificate:
        """The certificate under which this CURVE key (raw or Z85) may connect at ``now``.

        Raises :class:`AuthError`: ``unknown_key`` when no certificate names the key, else the
        reason the newest certificate for it fails (``revoked``, ``expired``, ...).
        """
        self._maybe_reload()
        snap = self._snap
        certs = snap.by_key.get(curve_raw(curve_public))
        if not certs:
            raise AuthError(
                "unknown_key", f"no certificate for key {key_fingerprint(curve_public)}"
            )
        failure: AuthError | None = None
        for cert in sorted(certs, key=lambda c: c.not_after, reverse=True):
            try:
                cert.verify(self.ca_public_key, now, revoked=snap.revocations.serials)
                return cert
            except AuthError as exc:
                failure = failure or exc
        assert failure is not None
        raise failure

    def certificate(self, serial: str) -> Certificate | None:
        """The (unverified) certificate with this serial, if the kit holds one."""
        self._maybe_reload()
        return self._snap.by_serial.get(serial)

    def check_peer(self, *, user_id: str, serial: str, claimed_site_id: str, now: float) -> None:
        """Per-message check on the coordinator: the ZAP-certified identity of the connection
        (``User-Id`` and ``X-Cert-Serial`` of the received frame) must still hold a valid
        certificate and equal the ``site_id`` the message claims. Raises :class:`AuthError`."""
        self._maybe_reload()
        snap = self._snap
        cert = snap.by_serial.get(serial)
        if cert is None or cert.site_id != user_id:
            raise AuthError("unknown_key", f"no certificate serial={serial} for site {user_id!r}")
        if claimed_site_id != user_id:
            raise AuthError(
                "wrong_site",
                f"connection certified as site {user_id!r} sent a message as {claimed_site_id!r}",
            )
        cert.verify(self.ca_public_key, now, revoked=snap.revocations.serials)
