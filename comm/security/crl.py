"""The revocation list: an X.509 CRL signed by the federation CA.

Its ``cRLNumber`` is its version, which only ever grows, so a coordinator refuses an older list
put back in place of a newer one; each entry names a revoked certificate serial
(``comm.security.certs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security.certs import _pem, _serial_number, _unix, _utc, ca_name, parsed, serial_text
from comm.security.common import AuthError, key_fingerprint


@dataclass(frozen=True, kw_only=True)
class Revocation:
    serial: str
    revoked_at: int


@dataclass(frozen=True, kw_only=True)
class RevocationList:
    """The CA-signed list of revoked certificate serials (a CRL; ``version`` is its
    ``cRLNumber``). ``version`` only ever grows."""

    version: int
    issued_at: int
    entries: tuple[Revocation, ...]

    @property
    def serials(self) -> frozenset[str]:
        return frozenset(e.serial for e in self.entries)

    def to_pem(self, ca_key: Ed25519PrivateKey, *, next_update: int) -> bytes:
        """Sign as a CRL. ``next_update`` is when ``openssl verify -crl_check`` starts calling
        the list stale; the kit sets it to the CA's own expiry (a coordinator never does)."""
        public = ca_key.public_key()
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(ca_name(public))
            .last_update(_utc(self.issued_at))
            .next_update(_utc(max(next_update, self.issued_at)))
            .add_extension(x509.CRLNumber(self.version), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False
            )
        )
        for entry in self.entries:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(_serial_number(entry.serial))
                .revocation_date(_utc(entry.revoked_at))
                .build()
            )
        return _pem(builder.sign(ca_key, None))


def parse_revocations(data: bytes | str, ca_public_key: Ed25519PublicKey) -> RevocationList:
    """Parse and verify a CRL; raises :class:`AuthError` (``bad_signature``)."""
    raw = data.encode("ascii", "replace") if isinstance(data, str) else data
    malformed = "malformed revocation list (CRL)"
    crl = parsed(malformed, lambda: x509.load_pem_x509_crl(raw))
    number = parsed(
        malformed, lambda: crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    )
    fingerprint = key_fingerprint(ca_public_key)
    if not parsed(malformed, lambda: crl.is_signature_valid(ca_public_key)):
        raise AuthError("bad_signature", f"revocation list is not signed by CA {fingerprint}")
    issued_at, revoked = parsed(
        malformed,
        lambda: (
            crl.last_update_utc,
            [(r.serial_number, r.revocation_date_utc) for r in crl],
        ),
    )
    return RevocationList(
        version=number,
        issued_at=_unix(issued_at),
        entries=tuple(
            Revocation(serial=serial_text(serial), revoked_at=_unix(at)) for serial, at in revoked
        ),
    )


def load_revocations(path: str | Path, ca_public_key: Ed25519PublicKey) -> RevocationList:
    """Read and verify a CRL file (see :func:`parse_revocations`)."""
    return parse_revocations(Path(path).read_bytes(), ca_public_key)
