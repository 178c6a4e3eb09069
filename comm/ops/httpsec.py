"""TLS and HTTP basic auth for a role's ``/metrics`` and ``/status`` port.

:class:`HttpSecurityConfig` is what a role's config holds (``[coordinator.http]``,
``[site.http]``): file paths only, never a secret itself. :func:`load_http_security` reads the
files once, when the role starts, into an :class:`HttpSecurity` that :class:`ObserveServer
<comm.ops.observe.ObserveServer>` serves with; a file that cannot be read or parsed is a
:class:`ValueError` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Why a request was refused: the ``reason`` label of the roles' refusal counters.
REFUSED_MISSING = "missing_credentials"
"""No ``Authorization: Basic`` header."""
REFUSED_MALFORMED = "malformed_credentials"
"""An ``Authorization`` header that is not valid basic auth."""
REFUSED_WRONG = "wrong_credentials"
"""A user name or password that does not match."""
REFUSED_TLS = "tls_handshake"
"""The TLS handshake failed or timed out (plain HTTP on the TLS port, a bad client, a scanner)."""
REFUSED_REASONS = (REFUSED_MISSING, REFUSED_MALFORMED, REFUSED_WRONG, REFUSED_TLS)


@dataclass(frozen=True, kw_only=True)
class HttpSecurityConfig:
    """TLS and basic auth of the HTTP port. Embedded as ``[coordinator.http]`` /
    ``[site.http]``; everything off by default (plain HTTP, no auth)."""

    tls_cert_file: str = ""
    """PEM server certificate (chain) for HTTPS; set together with ``tls_key_file``."""
    tls_key_file: str = ""
    """PEM private key of ``tls_cert_file`` (unencrypted; keep it 0600)."""
    basic_auth_user: str = ""
    """User name every request must present (HTTP basic auth); set together with
    ``basic_auth_password_file``."""
    basic_auth_password_file: str = ""
    """File holding the password (surrounding whitespace ignored, as Prometheus's
    ``password_file``); the password itself never goes into a config file."""
    handshake_timeout_s: float = 10.0
    """A client that has not finished its TLS handshake (or its request) within this many
    seconds is disconnected."""

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "http.tls_key_file" if self.tls_cert_file else "http.tls_cert_file"
            given = "http.tls_cert_file" if self.tls_cert_file else "http.tls_key_file"
            raise ValueError(f"{missing} is required with {given}")
        if self.basic_auth_user and not self.basic_auth_password_file:
            raise ValueError("http.basic_auth_password_file is required with http.basic_auth_user")
        if self.basic_auth_password_file and not self.basic_auth_user:
            raise ValueError("http.basic_auth_user is required with http.basic_auth_password_file")
        if ":" in self.basic_auth_user or not self.basic_auth_user.isprintable():
            raise ValueError(
                "http.basic_auth_user must be printable and must not contain ':', "
                f"got {self.basic_auth_user!r}"
            )
        timeout = self.handshake_timeout_s
        if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"http.handshake_timeout_s must be > 0, got {timeout!r}")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def basic_auth(self) -> bool:
        return bool(self.basic_auth_user)


@dataclass(frozen=True)
class HttpSecurity:
    """What the server holds after loading the files: a TLS context and the expected
    credentials (as digests: a comparison never depends on where the inputs differ)."""

    ssl_context: ssl.SSLContext | None
    user_digest: bytes | None
    password_digest: bytes | None
    handshake_timeout_s: float

    @property
    def basic_auth(self) -> bool:
        return self.user_digest is not None

    def check_authorization(self, header: str | None) -> str | None:
        """None when ``header`` (the request's ``Authorization``) carries the right user and
        password, else the refusal reason (``REFUSED_*``). Constant time in the secret."""
        if self.user_digest is None or self.password_digest is None:
            return None
        if not header:
            return REFUSED_MISSING
        scheme, _, encoded = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return REFUSED_MALFORMED
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return REFUSED_MALFORMED
        user, sep, password = decoded.partition(b":")
        if not sep:
            return REFUSED_MALFORMED
        # Both comparisons always run (no short circuit) over fixed-length digests.
        user_ok = hmac.compare_digest(_digest(user), self.user_digest)
        password_ok = hmac.compare_digest(_digest(password), self.password_digest)
        return None if user_ok & password_ok else REFUSED_WRONG


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _read_password(path: str) -> bytes:
    p = Path(path)
    try:
        raw = p.read_bytes()
        mode = p.stat().st_mode
    except OSError as exc:
        raise ValueError(
            f"http.basic_auth_password_file {path!r} cannot be read: {exc.strerror or exc}"
        ) from None
    password = raw.strip()
    if not password:
        raise ValueError(f"http.basic_auth_password_file {path!r} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "http.basic_auth_password_file %s is readable by group or others (mode %o); "
            "chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return password


def _ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    for field, path in (("http.tls_cert_file", cert_file), ("http.tls_key_file", key_file)):
        if not os.access(path, os.R_OK):
            reason = "does not exist" if not os.path.exists(path) else "is not readable"
            raise ValueError(f"{field} {path!r} {reason}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"http.tls_cert_file {cert_file!r} and http.tls_key_file {key_file!r} do not load "
            f"as a PEM certificate and its key: {exc}"
        ) from None
    return ctx


def load_http_security(cfg: HttpSecurityConfig) -> HttpSecurity:
    """Read the certificate, key and password files of ``cfg``. Raises :class:`ValueError`
    naming the field when one cannot be read or used."""
    ctx = _ssl_context(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls else None
    user_digest = password_digest = None
    if cfg.basic_auth:
        password_digest = _digest(_read_password(cfg.basic_auth_password_file))
        user_digest = _digest(cfg.basic_auth_user.encode())
        if ctx is None:
            log.warning(
                "http: basic auth without TLS sends the password in clear text; "
                "set http.tls_cert_file and http.tls_key_file"
            )
    return HttpSecurity(ctx, user_digest, password_digest, float(cfg.handshake_timeout_s))
