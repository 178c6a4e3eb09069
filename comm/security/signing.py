"""Ed25519 keys, blob signatures and signed one-line documents.

Signed documents are one line, ``<kind>.<base64url body>.<base64url signature>``; the body is
canonical JSON and the Ed25519 signature covers ``<kind>\\0<body>`` so that a signature made for
one kind of document is never valid for another. The coordinator signs global checkpoints with
:func:`sign_blob`; sites check them with :func:`verify_blob`.
"""

from __future__ import annotations

import binascii
import hashlib
import json
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security.common import (
    BLOB_KIND,
    AuthError,
    _b64,
    _canonical,
    _read_private,
    _signed_message,
    _unb64,
    key_fingerprint,
)

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
