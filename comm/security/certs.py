"""Site certificates and the revocation list, both signed by the federation CA.

A :class:`Certificate` binds ``(site_id, CURVE public key, validity, serial)``; the
:class:`RevocationList` names the serials that are no longer trusted.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security.common import (
    CERT_KIND,
    REVOCATIONS_KIND,
    AuthError,
    _b64,
    _canonical,
    _signed_message,
    key_fingerprint,
)
from comm.security.signing import _field, _seal, _unseal

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
