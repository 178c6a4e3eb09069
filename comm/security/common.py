"""Names, errors and small helpers every key module shares.

The file names of a federation kit, the kinds of signed documents, file modes, the refusal
reasons (:data:`AuthReason`, :class:`AuthError`), and helpers for encodings, fingerprints and
private files. No function here logs or prints a key: logs carry a key's 16-hex-digit
fingerprint (:func:`key_fingerprint`) at most.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import zmq.utils.z85 as z85
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from comm.durable import atomic_write

KIT_FORMAT = 2
"""2: X.509 certificates and a CRL. Format 1 (crossdc's own one-line documents, before X.509) is
refused with what to do (``comm.security.kits.require_format``)."""

MANIFEST = "kit.json"
CA_KEY = "ca.key"
CA_CERT = "ca.pem"
PREVIOUS_CA_KEY = "previous-ca.key"
COORDINATOR_CURVE_KEY = "coordinator.curve.key"
COORDINATOR_CURVE_PUB = "coordinator.curve.pub"
COORDINATOR_SIGN_KEY = "coordinator.sign.key"
COORDINATOR_SIGN_PUB = "coordinator.sign.pub"
CRL = "crl.pem"
CERTS_DIR = "certs"
SITES_DIR = "sites"
SITE_CURVE_KEY = "site.curve.key"
SITE_CURVE_PUB = "site.curve.pub"
SITE_CERT = "site.pem"
CERT_SUFFIX = ".pem"
SITE_TOML = "site.toml"
ROLLOVER_DIR = "rollover"
RETIRED_DIR = "retired"

BLOB_KIND = "crossdc-blob-v1"

_PRIVATE_MODE = 0o600
_PUBLIC_MODE = 0o644
_DIR_MODE = 0o700
_SITE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A whole site id (``fullmatch``: ``$`` would also take one with a trailing newline)."""
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
        except (ValueError, KeyError, struct.error) as exc:
            # struct.error: Z85 digits whose value overflows 32 bits ("%%%%%" and up)
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
    if not _SITE_ID.fullmatch(site_id):
        raise ValueError(f"site_id must be 1-64 letters, digits, '-' or '_', got {site_id!r}")
    return site_id


def _write(path: Path, data: bytes, mode: int, *, replace: bool = False) -> None:
    """Write a file with ``mode`` from its first byte on, whole or not at all; an existing file
    is replaced only if asked (otherwise ``FileExistsError``)."""
    atomic_write(path, data, mode=mode, replace=replace)


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
