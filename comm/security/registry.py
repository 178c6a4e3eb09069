"""The coordinator's registry of certified keys: which CURVE key belongs to which site now.

:class:`CertificateRegistry` is what the ZAP handler (``comm.security.zap``) asks; it reloads
the certificates and the revocation list when they change on disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from comm.security.certs import (
    Certificate,
    load_ca_certificate,
)
from comm.security.common import (
    CA_CERT,
    CERTS_DIR,
    CRL,
    AuthError,
    curve_raw,
    key_fingerprint,
)
from comm.security.crl import RevocationList, load_revocations
from comm.security.kits import issued_certificates
from comm.security.legacy import role_kit

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The coordinator's registry of certified keys


@dataclass(frozen=True)
class _Snapshot:
    by_key: dict[bytes, tuple[Certificate, ...]]
    by_serial: dict[str, Certificate]
    revocations: RevocationList
    stamp: tuple[tuple[str, int, int], ...]


class CertificateRegistry:
    """Which CURVE keys belong to which site now: issued certificates minus revoked ones.

    Built from certificates in memory, or from a kit directory with :meth:`from_kit`, in which
    case it re-reads ``certs/`` and ``crl.pem`` when they change (checked at most every
    ``reload_interval_s``) or on :meth:`reload`. Certificates that do not verify against the CA
    are skipped at load with a warning. Revocations only accumulate in a running registry: a
    revocation list that is missing, unsigned or older than the one loaded is refused and the
    loaded one kept. Thread-safe: lookups read an immutable snapshot swapped under a lock.
    """

    def __init__(
        self,
        ca_public_key: Ed25519PublicKey,
        certificates: Iterable[Certificate] = (),
        revocations: RevocationList | None = None,
        *,
        kit_dir: str | Path | None = None,
        reload_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ca_public_key = ca_public_key
        self.kit_dir = Path(kit_dir) if kit_dir is not None else None
        self.reload_interval_s = reload_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at = clock()
        revs = revocations or RevocationList(version=0, issued_at=0, entries=())
        self._snap = self._build(list(certificates), revs, ())

    @classmethod
    def from_kit(
        cls, kit_dir: str | Path, *, reload_interval_s: float = 1.0
    ) -> CertificateRegistry:
        kit = role_kit(Path(kit_dir), "coordinator")
        ca = load_ca_certificate(kit / CA_CERT)
        reg = cls(ca.public_key, kit_dir=kit, reload_interval_s=reload_interval_s)
        reg.reload()
        return reg

    def _build(
        self,
        certs: list[Certificate],
        revocations: RevocationList,
        stamp: tuple[tuple[str, int, int], ...],
    ) -> _Snapshot:
        by_key: dict[bytes, list[Certificate]] = {}
        by_serial: dict[str, Certificate] = {}
        for cert in certs:
            try:
                # Validity in time and revocation are checked per lookup; here only the CA.
                cert.verify_signature(self.ca_public_key)
                raw = curve_raw(cert.curve_public)
            except (AuthError, ValueError) as exc:
                log.warning("skipping certificate serial=%s: %s", cert.serial, exc)
                continue
            by_key.setdefault(raw, []).append(cert)
            by_serial[cert.serial] = cert
        return _Snapshot(
            by_key={k: tuple(v) for k, v in by_key.items()},
            by_serial=by_serial,
            revocations=revocations,
            stamp=stamp,
        )

    def _stamp(self) -> tuple[tuple[str, int, int], ...]:
        assert self.kit_dir is not None
        out = []
        for path in [self.kit_dir / CERTS_DIR, self.kit_dir / CRL]:
            try:
                st = path.stat()
                out.append((path.name, st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append((path.name, -1, -1))
        return tuple(out)

    def reload(self) -> None:
        """Re-read the kit directory now (no-op for an in-memory registry)."""
        if self.kit_dir is None:
            return
        with self._lock:
            stamp = self._stamp()
            certs = issued_certificates(self.kit_dir)
            revs = self._snap.revocations
            try:
                loaded = load_revocations(self.kit_dir / CRL, self.ca_public_key)
                if loaded.version < revs.version:
                    log.error(
                        "refusing revocation list version %d older than loaded version %d",
                        loaded.version,
                        revs.version,
                    )
                else:
                    revs = loaded
            except (OSError, AuthError) as exc:
                log.error("keeping the loaded revocation list: %s", exc)
            self._snap = self._build(certs, revs, stamp)
            self._checked_at = self._clock()

    def _maybe_reload(self) -> None:
        if self.kit_dir is None or self._clock() - self._checked_at < self.reload_interval_s:
            return
        self._checked_at = self._clock()
        if self._stamp() != self._snap.stamp:
            self.reload()

    @property
    def revoked_serials(self) -> frozenset[str]:
        return self._snap.revocations.serials

    def authorize(self, curve_public: bytes, now: float) -> Certificate:
        """The certificate under which this CURVE key (raw or Z85) may connect at ``now``.

        Raises :class:`AuthError`: ``unknown_key`` when no certificate names the key, else the
        reason the newest certificate for it fails (``revoked``, ``expired``, ...).
        """
        self._maybe_reload()
        snap = self._snap
        certs = snap.by_key.get(curve_raw(curve_public))
        if not certs:
            raise AuthError(
                "unknown_key", f"no certificate for key {key_fingerprint(curve_public)}"
            )
        failure: AuthError | None = None
        for cert in sorted(certs, key=lambda c: c.not_after, reverse=True):
            try:
                cert.verify(self.ca_public_key, now, revoked=snap.revocations.serials)
                return cert
            except AuthError as exc:
                failure = failure or exc
        assert failure is not None
        raise failure

    def trusted_certificates(self) -> list[Certificate]:
        """Every certificate that verifies against the CA and is not revoked, whether valid now,
        expired or not yet valid: what the registry would authorize a key with at some time."""
        self._maybe_reload()
        snap = self._snap
        revoked = snap.revocations.serials
        return [c for c in snap.by_serial.values() if c.serial not in revoked]

    def certificate(self, serial: str) -> Certificate | None:
        """The (unverified) certificate with this serial, if the kit holds one."""
        self._maybe_reload()
        return self._snap.by_serial.get(serial)

    def check_peer(self, *, user_id: str, serial: str, claimed_site_id: str, now: float) -> None:
        """Per-message check on the coordinator: the ZAP-certified identity of the connection
        (``User-Id`` and ``X-Cert-Serial`` of the received frame) must still hold a valid
        certificate and equal the ``site_id`` the message claims. Raises :class:`AuthError`."""
        self._maybe_reload()
        snap = self._snap
        cert = snap.by_serial.get(serial)
        if cert is None or cert.site_id != user_id:
            raise AuthError("unknown_key", f"no certificate serial={serial} for site {user_id!r}")
        if claimed_site_id != user_id:
            raise AuthError(
                "wrong_site",
                f"connection certified as site {user_id!r} sent a message as {claimed_site_id!r}",
            )
        cert.verify(self.ca_public_key, now, revoked=snap.revocations.serials)
