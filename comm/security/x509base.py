"""The X.509 plumbing the certificates and the revocation list share: parsing untrusted bytes,
times as Unix seconds, serial numbers as crossdc writes them, PEM."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from comm.security.common import AuthError

MAX_SERIAL = 1 << 128
_T = TypeVar("_T")


def parsed(what: str, parse: Callable[[], _T]) -> _T:
    """``parse()`` reading untrusted bytes with ``cryptography``, which raises several unrelated
    types on malformed input (``ValueError``, ``InvalidVersion``, ``UnsupportedAlgorithm``,
    ``DuplicateExtension``...): any of them is :class:`AuthError` (``bad_signature``) naming
    ``what``. Only library calls go in ``parse``."""
    try:
        return parse()
    except Exception as exc:
        raise AuthError("bad_signature", f"{what}: {exc}") from None


def utc(seconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)


def unix(when: dt.datetime) -> int:
    return int(when.timestamp())


def serial_text(number: int) -> str:
    """A certificate serial number as crossdc writes it: 32 lower-case hex digits."""
    return f"{number:032x}"


def serial_number(serial: str) -> int:
    try:
        number = int(serial, 16)
    except ValueError:
        raise ValueError(f"a certificate serial is hex digits, got {serial!r}") from None
    if not 0 < number < MAX_SERIAL:
        raise ValueError(f"a certificate serial is 1 to 32 hex digits, not zero, got {serial!r}")
    return number


def pem(obj: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return obj.public_bytes(serialization.Encoding.PEM)
