"""Kit format 1, read only: crossdc's own one-line certificates and revocation lists.

Kits made before identities became X.509 (``kit.json`` ``"format": 1``) hold ``ca.pub``,
``certs/*.cert``, ``revoked.list`` and, in a site kit, ``site.cert``: one-line documents
``<kind>.<base64url canonical JSON>.<base64url Ed25519 signature>``. Nothing runs on them any
more; ``crossdc keys migrate`` (:func:`comm.security.migrate.migrate_kit`) reads them with this
module, checks every signature against the CA and re-issues the same identities as X.509.
Every role refuses such a kit with a message that says what to do (:func:`require_format`,
:func:`role_kit`).
"""

from __future__ import annotations

import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from comm.security.common import (
    CA_CERT,
    KIT_FORMAT,
    MANIFEST,
    AuthError,
    _canonical,
    _signed_message,
    _unb64,
)
from comm.security.common import SITE_CERT as NEW_SITE_CERT

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


# ---------------------------------------------------------------------------------------------
# Refusing format-1 kits clearly (``comm.security.migrate`` converts them)


_MIGRATE_HINT = (
    "run `crossdc keys migrate --kit FEDERATION_KIT` where the CA key is, then give each site "
    "the two files it prints for it"
)


def require_format(kit: Path) -> Path:
    """A federation kit of this format, or ValueError saying what it is and what to do."""
    if not (kit / MANIFEST).exists():
        raise ValueError(f"{str(kit)!r} is not a federation kit (no {MANIFEST})")
    try:
        found = json.loads((kit / MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{str(kit / MANIFEST)!r} is not a kit manifest: {exc}") from None
    if found == FORMAT:
        raise ValueError(
            f"{str(kit)!r} is a format-1 kit (crossdc's own certificates, before X.509); "
            f"{_MIGRATE_HINT}"
        )
    if found != KIT_FORMAT:
        raise ValueError(f"{str(kit)!r} has kit format {found!r}; this crossdc reads {KIT_FORMAT}")
    return kit


def role_kit(kit: Path, role: str) -> Path:
    """A running role's kit directory, unless it still holds format-1 identity files."""
    if (kit / CA_CERT).exists():
        return kit
    if (kit / CA_PUB).exists():
        if role == "site":
            raise ValueError(
                f"{str(kit)!r} is a format-1 site kit ({SITE_CERT}, {CA_PUB}); put "
                f"the {NEW_SITE_CERT} and {CA_CERT} that the federation's `crossdc keys migrate` wrote "
                "for this site into it (its keys stay as they are)"
            )
        raise ValueError(
            f"{str(kit)!r} is a format-1 kit (crossdc's own certificates, before X.509); "
            f"{_MIGRATE_HINT}"
        )
    raise ValueError(f"{str(kit)!r} has no CA certificate {CA_CERT}: is it a crossdc kit?")
