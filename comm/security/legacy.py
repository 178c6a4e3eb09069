"""Kit format 1, read only: crossdc's own one-line certificates and revocation lists.

Kits made before identities became X.509 (``kit.json`` ``"format": 1``) hold ``ca.pub``,
``certs/*.cert``, ``revoked.list`` and, in a site kit, ``site.cert``: one-line documents
``<kind>.<base64url canonical JSON>.<base64url Ed25519 signature>``. Nothing runs on them any
more; ``crossdc keys migrate`` (:func:`comm.security.kits.migrate_kit`) reads them with this
module, checks every signature against the CA and re-issues the same identities as X.509.
"""

from __future__ import annotations

import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from comm.security.common import AuthError, _canonical, _signed_message, _unb64

FORMAT = 1
CA_PUB = "ca.pub"
REVOCATIONS = "revoked.list"
SITE_CERT = "site.cert"
CERT_SUFFIX = ".cert"
CERT_KIND = "crossdc-cert-v1"
REVOCATIONS_KIND = "crossdc-revocations-v1"


def _unseal(kind: str, text: str) -> tuple[bytes, dict[str, Any], bytes]:
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


def _check(ca_public_key: Ed25519PublicKey, kind: str, raw: bytes, signature: bytes) -> None:
    try:
        ca_public_key.verify(signature, _signed_message(kind, raw))
    except InvalidSignature:
        raise AuthError("bad_signature", f"{kind} document is not signed by this CA") from None


@dataclass(frozen=True, kw_only=True)
class LegacyCertificate:
    site_id: str
    curve_public: bytes
    not_before: int
    not_after: int
    serial: str


def read_certificate(path: Path, ca_public_key: Ed25519PublicKey) -> LegacyCertificate:
    """A format-1 certificate file, verified against the CA; raises :class:`AuthError`."""
    raw, body, signature = _unseal(CERT_KIND, path.read_text(encoding="ascii", errors="replace"))
    if _canonical(body) != raw:
        raise AuthError("bad_signature", "certificate body is not canonical")
    _check(ca_public_key, CERT_KIND, raw, signature)
    what = f"certificate {path.name}"
    return LegacyCertificate(
        site_id=_field(body, "site_id", str, what),
        curve_public=_field(body, "curve_public", str, what).encode("ascii", "replace"),
        not_before=_field(body, "not_before", int, what),
        not_after=_field(body, "not_after", int, what),
        serial=_field(body, "serial", str, what),
    )


def read_revocations(
    path: Path, ca_public_key: Ed25519PublicKey
) -> tuple[int, list[tuple[str, int]]]:
    """A format-1 revocation list, verified: (version, [(serial, revoked_at)])."""
    text = path.read_text(encoding="ascii", errors="replace")
    raw, body, signature = _unseal(REVOCATIONS_KIND, text)
    _check(ca_public_key, REVOCATIONS_KIND, raw, signature)
    items = body.get("revoked")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise AuthError("bad_signature", "malformed revocation list: field 'revoked'")
    what = "revocation list"
    entries = [(_field(i, "serial", str, what), _field(i, "revoked_at", int, what)) for i in items]
    return _field(body, "version", int, what), entries
