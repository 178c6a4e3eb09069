"""The revocation list: an X.509 CRL signed by the federation CA.

Its ``cRLNumber`` is its version, which only ever grows, so a coordinator refuses an older list
put back in place of a newer one; each entry names a revoked certificate serial
(``comm.security.certs``). ``crl.pem`` holds one CRL per CA of ``ca.pem``: two during a CA
rollover, each signed by its own CA (``openssl verify -CRLfile`` reads them all).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security.certs import ca_name
from comm.security.common import AuthError, key_fingerprint
from comm.security.x509base import parsed, pem, serial_number, serial_text, unix, utc


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
            .last_update(utc(self.issued_at))
            .next_update(utc(max(next_update, self.issued_at)))
            .add_extension(x509.CRLNumber(self.version), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False
            )
        )
        for entry in self.entries:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(serial_number(entry.serial))
                .revocation_date(utc(entry.revoked_at))
                .build()
            )
        return pem(builder.sign(ca_key, None))


_CRL_BEGIN = b"-----BEGIN X509 CRL-----"
_CRL_END = b"-----END X509 CRL-----"


def _crl_blocks(raw: bytes) -> list[bytes]:
    """The PEM CRLs in ``raw``, in order (anything between them is ignored, as openssl does)."""
    blocks: list[bytes] = []
    at = raw.find(_CRL_BEGIN)
    while at >= 0:
        end = raw.find(_CRL_END, at)
        if end < 0:
            raise AuthError("bad_signature", "malformed revocation list (CRL): no END line")
        blocks.append(raw[at : end + len(_CRL_END)] + b"\n")
        at = raw.find(_CRL_BEGIN, end)
    if not blocks:
        raise AuthError("bad_signature", "malformed revocation list (CRL): no PEM CRL in it")
    return blocks


_MALFORMED = "malformed revocation list (CRL)"


def _parse_block(block: bytes) -> tuple[x509.CertificateRevocationList, int]:
    crl = parsed(_MALFORMED, lambda: x509.load_pem_x509_crl(block))
    number = parsed(
        _MALFORMED,
        lambda: crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number,
    )
    return crl, number


def _signed_by(crl: x509.CertificateRevocationList, key: Ed25519PublicKey) -> bool:
    return parsed(_MALFORMED, lambda: crl.is_signature_valid(key))


def _revocation_list(crl: x509.CertificateRevocationList, number: int) -> RevocationList:
    issued_at, revoked = parsed(
        _MALFORMED,
        lambda: (crl.last_update_utc, [(r.serial_number, r.revocation_date_utc) for r in crl]),
    )
    return RevocationList(
        version=number,
        issued_at=unix(issued_at),
        entries=tuple(
            Revocation(serial=serial_text(serial), revoked_at=unix(at)) for serial, at in revoked
        ),
    )


def split_revocations(
    data: bytes | str, ca_public_keys: Iterable[Ed25519PublicKey]
) -> dict[str, bytes]:
    """``crl.pem`` as its PEM CRLs by the fingerprint of the CA that signed each: one CRL per
    CA of ``ca.pem`` (two during a CA rollover). Raises :class:`AuthError` (``bad_signature``)
    for a malformed CRL, one signed by none of ``ca_public_keys``, or two from one CA."""
    raw = data.encode("ascii", "replace") if isinstance(data, str) else data
    keys = list(ca_public_keys)
    out: dict[str, bytes] = {}
    for block in _crl_blocks(raw):
        crl, _number = _parse_block(block)
        signer = next((k for k in keys if _signed_by(crl, k)), None)
        if signer is None:
            names = ", ".join(key_fingerprint(k) for k in keys)
            raise AuthError("bad_signature", f"revocation list is not signed by CA {names}")
        fingerprint = key_fingerprint(signer)
        if fingerprint in out:
            raise AuthError("bad_signature", f"two revocation lists of CA {fingerprint}")
        out[fingerprint] = block
    return out


def parse_revocation_bundle(
    data: bytes | str, ca_public_keys: Iterable[Ed25519PublicKey]
) -> dict[str, RevocationList]:
    """Parse and verify ``crl.pem``: each CA's revocation list by the CA's fingerprint (see
    :func:`split_revocations`)."""
    return {
        fingerprint: _revocation_list(*_parse_block(block))
        for fingerprint, block in split_revocations(data, ca_public_keys).items()
    }


def parse_revocations(data: bytes | str, ca_public_key: Ed25519PublicKey) -> RevocationList:
    """Parse and verify the CRL of one CA; ``data`` may hold the CRLs of other CAs too (a
    rollover's ``crl.pem``). Raises :class:`AuthError` (``bad_signature``)."""
    raw = data.encode("ascii", "replace") if isinstance(data, str) else data
    fingerprint = key_fingerprint(ca_public_key)
    for block in _crl_blocks(raw):
        crl, number = _parse_block(block)
        if _signed_by(crl, ca_public_key):
            return _revocation_list(crl, number)
    raise AuthError("bad_signature", f"revocation list is not signed by CA {fingerprint}")


def load_revocations(path: str | Path, ca_public_key: Ed25519PublicKey) -> RevocationList:
    """Read and verify a CA's CRL from a file (see :func:`parse_revocations`)."""
    return parse_revocations(Path(path).read_bytes(), ca_public_key)
