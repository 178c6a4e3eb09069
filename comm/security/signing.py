"""Ed25519 keys and blob signatures.

The coordinator signs global checkpoints with :func:`sign_blob`; sites check them with
:func:`verify_blob`. A signature covers ``crossdc-blob-v1\\0<context>\\0<SHA-256>``, so one made
for one context never verifies for another.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security.common import (
    BLOB_KIND,
    AuthError,
    _read_private,
    _signed_message,
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
