"""X.509 identities: the federation CA, site certificates and the revocation list (a CRL).

Every identity document is standard X.509 so that existing PKI tools issue, inspect and verify
it (``openssl x509 -text``, ``openssl verify -crl_check -CAfile ca.pem -CRLfile crl.pem``):

- The CA certificate is self-signed with the CA's Ed25519 key, ``CN=crossdc federation CA
  <fingerprint>``, ``basicConstraints CA:TRUE, pathlen:0``, key usage ``keyCertSign, cRLSign``.
  ``ca.pem`` is a bundle of such certificates: one, or two during a CA rollover.
- A site certificate is signed by the CA; its subject is ``CN=<site id>``, its subject public key
  is the site's CURVE key (X25519, key usage ``keyAgreement``), the same key is carried in the
  non-critical extension :data:`CURVE_KEY_OID` as its Z85 text (what ZeroMQ configures), its
  validity is ``notBefore``/``notAfter`` and its serial number is what the CRL names.
- The revocation list is a CRL signed by the CA (``comm.security.crl``).

:class:`Certificate` is the parsed, structurally checked form of a site certificate; it proves
nothing until :meth:`Certificate.verify` passes.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq.utils.z85 as z85
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID, SignatureAlgorithmOID

from comm.security.common import AuthError, check_site_id, curve_raw, key_fingerprint
from comm.security.x509base import MAX_SERIAL, parsed, pem, serial_number, serial_text, unix, utc

CURVE_KEY_OID = x509.ObjectIdentifier("2.25.170210122487860488820739161179313113323")
"""The site certificate extension holding the site's CURVE public key as a UTF8String of its
40 Z85 characters (an OID under the UUID arc 2.25, which needs no registration)."""

_NO_USAGE = dict.fromkeys(
    (
        "digital_signature",
        "content_commitment",
        "key_encipherment",
        "data_encipherment",
        "key_agreement",
        "key_cert_sign",
        "crl_sign",
        "encipher_only",
        "decipher_only",
    ),
    False,
)


def _curve_extension(curve_public: bytes) -> x509.UnrecognizedExtension:
    text = z85.encode(curve_raw(curve_public))
    return x509.UnrecognizedExtension(CURVE_KEY_OID, b"\x0c" + bytes([len(text)]) + text)


# ---------------------------------------------------------------------------------------------
# The CA certificate


def ca_name(ca_public_key: Ed25519PublicKey) -> x509.Name:
    """The CA's subject (and every site certificate's issuer): names the CA key's fingerprint."""
    return x509.Name(
        [
            x509.NameAttribute(
                NameOID.COMMON_NAME, f"crossdc federation CA {key_fingerprint(ca_public_key)}"
            )
        ]
    )


def make_ca_certificate(
    ca_key: Ed25519PrivateKey, *, not_before: int, not_after: int, serial: str
) -> bytes:
    """The CA's self-signed certificate (PEM)."""
    public = ca_key.public_key()
    name = ca_name(public)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(serial_number(serial))
        .not_valid_before(utc(not_before))
        .not_valid_after(utc(not_after))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**{**_NO_USAGE, "key_cert_sign": True, "crl_sign": True}),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(ca_key, None)
    )
    return pem(cert)


@dataclass(frozen=True, kw_only=True)
class CACertificate:
    """A federation CA as a running role trusts it: its key, its validity and its certificate."""

    public_key: Ed25519PublicKey
    name: x509.Name
    not_before: int
    not_after: int
    pem: bytes
    """The CA certificate as PEM (what ``ca.pem`` holds for it)."""

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_key)


def _ca_from_x509(cert: x509.Certificate) -> CACertificate:
    malformed = "the CA certificate is malformed"
    public = parsed(malformed, cert.public_key)
    if not isinstance(public, Ed25519PublicKey):
        raise AuthError("bad_signature", "the CA certificate's key is not Ed25519")
    try:
        public.verify(cert.signature, cert.tbs_certificate_bytes)
        constraints = parsed(
            malformed, lambda: cert.extensions.get_extension_for_class(x509.BasicConstraints)
        ).value
    except (InvalidSignature, x509.ExtensionNotFound):
        raise AuthError(
            "bad_signature", "the CA certificate is not a self-signed CA certificate"
        ) from None
    subject, issuer = parsed(malformed, lambda: (cert.subject, cert.issuer))
    if not constraints.ca or subject != issuer:
        raise AuthError("bad_signature", "the CA certificate does not say CA:TRUE")
    not_before, not_after = parsed(
        malformed, lambda: (cert.not_valid_before_utc, cert.not_valid_after_utc)
    )
    return CACertificate(
        public_key=public,
        name=subject,
        not_before=unix(not_before),
        not_after=unix(not_after),
        pem=pem(cert),
    )


def parse_ca_bundle(data: bytes) -> tuple[CACertificate, ...]:
    """Parse and check ``ca.pem``: the CA certificates a federation trusts, the current CA
    (the one that issues) first. One outside a CA rollover; during one, the new CA then the
    old one (``comm.security.rollover``). Each must be a self-signed Ed25519 ``CA:TRUE``
    certificate, and no key may appear twice. Raises :class:`AuthError` (``bad_signature``)
    naming what is wrong."""
    certs = parsed(
        "the CA certificate is not PEM X.509", lambda: x509.load_pem_x509_certificates(data)
    )
    cas: list[CACertificate] = []
    for index, cert in enumerate(certs):
        try:
            ca = _ca_from_x509(cert)
        except AuthError as exc:
            where = f" (certificate {index + 1} of {len(certs)})" if len(certs) > 1 else ""
            raise AuthError(exc.reason, exc.detail + where) from None
        if any(c.fingerprint == ca.fingerprint for c in cas):
            raise AuthError("bad_signature", f"CA {ca.fingerprint} appears twice in the bundle")
        cas.append(ca)
    return tuple(cas)


def parse_ca_certificate(data: bytes) -> CACertificate:
    """The current CA of ``ca.pem``: its first certificate, once every certificate in it
    passed :func:`parse_ca_bundle`."""
    return parse_ca_bundle(data)[0]


def load_ca_bundle(path: str | Path) -> tuple[CACertificate, ...]:
    """Read and check ``ca.pem`` (see :func:`parse_ca_bundle`)."""
    return parse_ca_bundle(Path(path).read_bytes())


def load_ca_certificate(path: str | Path) -> CACertificate:
    """Read and check ``ca.pem``; its current CA (see :func:`parse_ca_certificate`)."""
    return parse_ca_certificate(Path(path).read_bytes())


def ca_bundle_pem(cas: Iterable[CACertificate]) -> bytes:
    """``ca.pem`` for these CAs, in this order (the current CA first)."""
    return b"".join(ca.pem for ca in cas)


# ---------------------------------------------------------------------------------------------
# Site certificates


def make_site_certificate(
    ca_key: Ed25519PrivateKey,
    *,
    site_id: str,
    curve_public: bytes,
    not_before: int,
    not_after: int,
    serial: str,
) -> Certificate:
    """Sign a site certificate for the CURVE key ``curve_public`` (raw or Z85)."""
    check_site_id(site_id)
    raw = curve_raw(curve_public)
    ca_public = ca_key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, site_id)]))
        .issuer_name(ca_name(ca_public))
        .public_key(x25519.X25519PublicKey.from_public_bytes(raw))
        .serial_number(serial_number(serial))
        .not_valid_before(utc(not_before))
        .not_valid_after(utc(not_after))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(**{**_NO_USAGE, "key_agreement": True}), critical=True)
        .add_extension(_curve_extension(raw), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
        )
        .sign(ca_key, None)
    )
    return Certificate.from_x509(cert)


@dataclass(frozen=True, kw_only=True)
class Certificate:
    """A site certificate: the CA's statement "CURVE key ``curve_public`` is site ``site_id``
    from ``not_before`` to ``not_after`` (unix seconds)", with a unique ``serial``. Build with
    :func:`make_site_certificate` or :meth:`from_pem`; it proves nothing until :meth:`verify`."""

    site_id: str
    curve_public: bytes
    """The site's CURVE public key, Z85 (40 bytes)."""
    not_before: int
    not_after: int
    serial: str
    """32 hex digits, random; what the revocation list names."""
    der: bytes
    """The certificate as DER (what the signature covers is inside)."""

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the certified CURVE key (for logs)."""
        return key_fingerprint(self.curve_public)

    @functools.cached_property
    def _x509(self) -> x509.Certificate:
        """The parsed certificate, once (the coordinator checks a peer's at every message)."""
        return x509.load_der_x509_certificate(self.der)

    def to_pem(self) -> bytes:
        return pem(self._x509)

    @classmethod
    def from_pem(cls, data: bytes | str) -> Certificate:
        """Parse a PEM site certificate; raises :class:`AuthError` (``bad_signature``) if it
        is not one (malformed, or not in the shape :func:`make_site_certificate` gives)."""
        raw = data.encode("ascii", "replace") if isinstance(data, str) else data
        cert = parsed("not a PEM X.509 certificate", lambda: x509.load_pem_x509_certificate(raw))
        return cls.from_x509(cert)

    @classmethod
    def from_x509(cls, cert: x509.Certificate) -> Certificate:
        def bad(what: str) -> AuthError:
            return AuthError(
                "bad_signature",
                f"certificate serial={serial_text(cert.serial_number)} is not a crossdc site "
                f"certificate: {what}",
            )

        try:
            names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            extension = cert.extensions.get_extension_for_oid(CURVE_KEY_OID).value
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
            subject_key = cert.public_key()
            not_before, not_after = cert.not_valid_before_utc, cert.not_valid_after_utc
            der = cert.public_bytes(serialization.Encoding.DER)
        except Exception as exc:  # cryptography raises several unrelated types (see parsed)
            raise bad(str(exc)) from None
        if len(names) != 1 or not isinstance(names[0].value, str):
            raise bad("its subject needs exactly one CN, the site id")
        site_id = names[0].value
        try:
            check_site_id(site_id)
        except ValueError as exc:
            raise bad(str(exc)) from None
        if constraints.ca:
            raise bad("it says CA:TRUE")
        value = getattr(extension, "value", b"")
        if len(value) != 42 or value[:2] != b"\x0c\x28":
            raise bad("its CURVE key extension is not 40 Z85 characters")
        curve_public = bytes(value[2:])
        if not isinstance(subject_key, x25519.X25519PublicKey):
            raise bad("its subject public key is not X25519")
        spki = subject_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        try:
            extension_key = curve_raw(curve_public)
        except ValueError as exc:
            raise bad(str(exc)) from None
        if extension_key != spki:
            raise bad("its CURVE key extension and subject public key differ")
        if not 0 < cert.serial_number < MAX_SERIAL:
            raise bad("its serial number is not 1 to 128 bits")
        return cls(
            site_id=site_id,
            curve_public=curve_public,
            not_before=unix(not_before),
            not_after=unix(not_after),
            serial=serial_text(cert.serial_number),
            der=der,
        )

    def verify_signature(self, ca_public_key: Ed25519PublicKey) -> None:
        """Raise :class:`AuthError` (``bad_signature``) unless the CA signed this certificate."""
        cert = self._x509
        try:
            # The CA key's signature is what binds; the issuer name is not compared, so a CA
            # certificate re-made from ca.key under another name (another PKI's) still serves.
            if cert.signature_algorithm_oid != SignatureAlgorithmOID.ED25519:
                raise InvalidSignature
            ca_public_key.verify(cert.signature, cert.tbs_certificate_bytes)
        except InvalidSignature:
            raise AuthError(
                "bad_signature",
                f"certificate serial={self.serial} of site {self.site_id!r} is not signed by "
                f"CA {key_fingerprint(ca_public_key)}",
            ) from None

    def issuer_among(self, cas: Iterable[CACertificate]) -> CACertificate | None:
        """The CA of ``cas`` whose key signed this certificate, or None."""
        for ca in cas:
            try:
                self.verify_signature(ca.public_key)
            except AuthError:
                continue
            return ca
        return None

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
    """Read a PEM site certificate file (unverified: call :meth:`Certificate.verify`)."""
    return Certificate.from_pem(Path(path).read_bytes())
