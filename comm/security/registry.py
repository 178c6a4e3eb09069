"""The coordinator's registry of certified keys: which CURVE key belongs to which site now.

:class:`CertificateRegistry` is what the ZAP handler (``comm.security.zap``) and the per-message
check ask. It follows the kit's trust material while the coordinator runs, without a restart:
the CAs of ``ca.pem`` (two during a CA rollover, ``comm.security.rollover``), the CAs retired
under ``retired/``, each CA's revocation list in ``crl.pem``, and the certificates in ``certs/``.
Trust material that would loosen what the loaded material says is refused, counted and logged,
and the loaded material kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from comm.security.certs import CACertificate, Certificate, load_ca_bundle
from comm.security.common import (
    CA_CERT,
    CERTS_DIR,
    CRL,
    RETIRED_DIR,
    AuthError,
    curve_raw,
    key_fingerprint,
)
from comm.security.crl import RevocationList
from comm.security.kits import issued_certificates, role_kit
from comm.security.rolekits import RefuseCallback, file_stamp
from comm.security.trust import (
    Trust,
    TrustRefusal,
    load_retired,
    reload_cas,
    reload_revocations,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Snapshot:
    trust: Trust
    by_key: dict[bytes, tuple[Certificate, ...]]
    by_serial: dict[str, Certificate]
    issuer: dict[str, CACertificate]
    """The trusted CA that signed each certificate of ``by_serial``."""
    retired: dict[str, tuple[Certificate, CACertificate]]
    """Certificates signed by a retired CA, with that CA, by serial."""
    revoked: frozenset[str]
    stamp: tuple[tuple[str | int, ...], ...]


class CertificateRegistry:
    """Which CURVE keys belong to which site now: issued certificates minus revoked ones.

    Built from CAs and certificates in memory, or from a kit directory with :meth:`from_kit`, in
    which case it re-reads ``ca.pem``, ``retired/``, ``crl.pem`` and ``certs/`` when they change
    (checked at most every ``reload_interval_s``) or on :meth:`reload`. A certificate is trusted
    when one of the CAs trusted now signed it; certificates of a retired CA are refused as
    revoked; others are skipped at load with a warning.

    Trust only moves forward in a running registry. A CA joins when ``ca.pem`` lists it (within
    its validity) and leaves only when ``retired/`` records it as retired; it never comes back.
    Revocations only accumulate: a CA's revocation list that is missing, unsigned or older than
    the one loaded is refused and the loaded one kept. Each refusal is counted in ``refused``
    by reason (:data:`TrustRefusal`), reported to ``on_refuse`` and logged. Thread-safe: lookups
    read an immutable snapshot swapped under a lock.
    """

    def __init__(
        self,
        cas: Sequence[CACertificate],
        certificates: Iterable[Certificate] = (),
        revocations: Mapping[str, RevocationList] | None = None,
        *,
        retired: Sequence[CACertificate] = (),
        kit_dir: str | Path | None = None,
        reload_interval_s: float = 1.0,
        on_refuse: RefuseCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not cas:
            raise ValueError("a certificate registry needs at least one CA")
        self.kit_dir = Path(kit_dir) if kit_dir is not None else None
        self.reload_interval_s = reload_interval_s
        self.refused: Counter[str] = Counter()
        self._on_refuse = on_refuse
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._checked_at = clock()
        self._known: dict[str, tuple[str, bytes]] = {}
        """(site, CURVE key) of every certificate trusted at some point in this run, by serial:
        what a connection authenticated under that serial proved it holds."""
        self._moved: set[str] = set()
        trust = Trust(cas=tuple(cas), retired=tuple(retired), revocations=dict(revocations or {}))
        self._snap = self._build(list(certificates), trust, ())

    @classmethod
    def from_kit(
        cls,
        kit_dir: str | Path,
        *,
        reload_interval_s: float = 1.0,
        on_refuse: RefuseCallback | None = None,
    ) -> CertificateRegistry:
        """The registry of a federation kit. Raises (:class:`AuthError` or ValueError, naming
        the file) when ``ca.pem`` or ``retired/`` cannot be trusted at all."""
        kit = role_kit(Path(kit_dir), "coordinator")
        cas = load_ca_bundle(kit / CA_CERT)
        retired = load_retired(kit)
        back = [c.fingerprint for c in cas if c.fingerprint in {r.fingerprint for r in retired}]
        if back:
            raise ValueError(
                f"{str(kit / CA_CERT)!r} holds CA {', '.join(back)}, which {RETIRED_DIR}/ records "
                f"as retired: remove it from {CA_CERT}"
            )
        reg = cls(
            cas,
            retired=retired,
            kit_dir=kit,
            reload_interval_s=reload_interval_s,
            on_refuse=on_refuse,
        )
        reg.reload()
        return reg

    # ---- loading ---------------------------------------------------------------------------

    def _build(
        self,
        certs: list[Certificate],
        trust: Trust,
        stamp: tuple[tuple[str | int, ...], ...],
    ) -> _Snapshot:
        by_key: dict[bytes, list[Certificate]] = {}
        by_serial: dict[str, Certificate] = {}
        issuer: dict[str, CACertificate] = {}
        retired: dict[str, tuple[Certificate, CACertificate]] = {}
        for cert in certs:
            # Validity in time and revocation are checked per lookup; here only the CA.
            try:
                raw = curve_raw(cert.curve_public)
            except ValueError as exc:
                log.warning("skipping certificate serial=%s: %s", cert.serial, exc)
                continue
            ca = cert.issuer_among(trust.cas)
            if ca is None:
                old = cert.issuer_among(trust.retired)
                if old is not None:
                    retired[cert.serial] = (cert, old)
                else:
                    log.warning(
                        "skipping certificate serial=%s of site %r: signed by no CA of %s",
                        cert.serial,
                        cert.site_id,
                        CA_CERT,
                    )
                continue
            by_key.setdefault(raw, []).append(cert)
            by_serial[cert.serial] = cert
            issuer[cert.serial] = ca
            self._known.setdefault(cert.serial, (cert.site_id, raw))
        revoked = frozenset(s for r in trust.revocations.values() for s in r.serials)
        return _Snapshot(
            trust=trust,
            by_key={k: tuple(v) for k, v in by_key.items()},
            by_serial=by_serial,
            issuer=issuer,
            retired=retired,
            revoked=revoked,
            stamp=stamp,
        )

    def _stamp(self) -> tuple[tuple[str | int, ...], ...]:
        assert self.kit_dir is not None
        retired_dir = self.kit_dir / RETIRED_DIR
        paths = [self.kit_dir / CA_CERT, self.kit_dir / CERTS_DIR, self.kit_dir / CRL, retired_dir]
        if retired_dir.is_dir():
            paths += sorted(retired_dir.glob(f"*/{CA_CERT}"))
        return tuple((str(path), *file_stamp(path)) for path in paths)

    def _refuse(self, reason: TrustRefusal, detail: str) -> None:
        self.refused[reason] += 1
        log.error("refused trust material in %s: %s: %s", self.kit_dir, reason, detail)
        if self._on_refuse is not None:
            try:
                self._on_refuse(reason, detail)
            except Exception:
                log.exception("on_refuse callback failed")

    def reload(self) -> None:
        """Re-read the kit directory now (no-op for an in-memory registry)."""
        if self.kit_dir is None:
            return
        with self._lock:
            stamp = self._stamp()
            old = self._snap.trust
            cas, retired = reload_cas(self.kit_dir, old, self._wall_clock(), self._refuse)
            revocations = reload_revocations(self.kit_dir, old, cas, retired, self._refuse)
            trust = Trust(cas=cas, retired=retired, revocations=revocations)
            certs = issued_certificates(self.kit_dir)
            self._snap = self._build(certs, trust, stamp)
            self._checked_at = self._clock()
        before, after = {c.fingerprint for c in old.cas}, {c.fingerprint for c in cas}
        if before != after:
            log.info("trusting CA %s (was %s)", ", ".join(sorted(after)), ", ".join(sorted(before)))

    def _maybe_reload(self) -> None:
        if self.kit_dir is None or self._clock() - self._checked_at < self.reload_interval_s:
            return
        self._checked_at = self._clock()
        if self._stamp() != self._snap.stamp:
            self.reload()

    # ---- questions -------------------------------------------------------------------------

    @property
    def revoked_serials(self) -> frozenset[str]:
        return self._snap.revoked

    def trusted_cas(self) -> tuple[CACertificate, ...]:
        """The CAs trusted now, the current one first (two during a CA rollover)."""
        self._maybe_reload()
        return self._snap.trust.cas

    @staticmethod
    def _verify(snap: _Snapshot, cert: Certificate, now: float) -> None:
        cert.verify(snap.issuer[cert.serial].public_key, now, revoked=snap.revoked)

    @staticmethod
    def _retired_error(cert: Certificate, ca: CACertificate) -> AuthError:
        return AuthError(
            "revoked",
            f"certificate serial={cert.serial} of site {cert.site_id!r} is revoked: its CA "
            f"{ca.fingerprint} is retired",
        )

    def authorize(self, curve_public: bytes, now: float) -> Certificate:
        """The certificate under which this CURVE key (raw or Z85) may connect at ``now``.

        The certificate that expires last, and on a tie the current CA's. Raises
        :class:`AuthError`: ``unknown_key`` when no certificate names the key, else the reason
        the newest certificate for it fails (``revoked``, ``expired``, ...); a key whose only
        certificates are a retired CA's is ``revoked``.
        """
        self._maybe_reload()
        snap = self._snap
        raw = curve_raw(curve_public)
        failure: AuthError | None = None
        rank = {ca.fingerprint: i for i, ca in enumerate(snap.trust.cas)}

        def newest_first(c: Certificate) -> tuple[int, int]:
            # The latest expiry first; on a tie, the current CA's (a rollover's re-issue).
            return (-c.not_after, rank[snap.issuer[c.serial].fingerprint])

        for cert in sorted(snap.by_key.get(raw, ()), key=newest_first):
            try:
                self._verify(snap, cert, now)
                return cert
            except AuthError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        for cert, ca in snap.retired.values():
            if curve_raw(cert.curve_public) == raw:
                raise self._retired_error(cert, ca)
        raise AuthError("unknown_key", f"no certificate for key {key_fingerprint(curve_public)}")

    def trusted_certificates(self) -> list[Certificate]:
        """Every certificate that verifies against a trusted CA and is not revoked, whether valid
        now, expired or not yet valid: what the registry would authorize a key with at some time."""
        self._maybe_reload()
        snap = self._snap
        return [c for c in snap.by_serial.values() if c.serial not in snap.revoked]

    def certificate(self, serial: str) -> Certificate | None:
        """The certificate with this serial, if the kit holds one (a retired CA's included)."""
        self._maybe_reload()
        snap = self._snap
        cert = snap.by_serial.get(serial)
        if cert is None and serial in snap.retired:
            cert = snap.retired[serial][0]
        return cert

    def check_peer(self, *, user_id: str, serial: str, claimed_site_id: str, now: float) -> None:
        """Per-message check on the coordinator: the ZAP-certified identity of the connection
        (``User-Id`` and ``X-Cert-Serial`` of the received frame) must equal the ``site_id``
        the message claims and its key must still hold a valid certificate for that site.

        That is the connection's own certificate, or another one that certifies the same key for
        the same site: the handshake proved the key, and a CA rollover re-issues each key's
        certificate under the new CA, so a connection opened under the old CA keeps working
        after it is retired. Revoking a site revokes all of its certificates, so its connection
        is cut. Raises :class:`AuthError`."""
        self._maybe_reload()
        snap = self._snap
        known = self._known.get(serial)
        if known is None or known[0] != user_id:
            raise AuthError("unknown_key", f"no certificate serial={serial} for site {user_id!r}")
        if claimed_site_id != user_id:
            raise AuthError(
                "wrong_site",
                f"connection certified as site {user_id!r} sent a message as {claimed_site_id!r}",
            )
        cert = snap.by_serial.get(serial)
        try:
            if cert is not None:
                self._verify(snap, cert, now)
                return
            if serial in snap.retired:
                raise self._retired_error(*snap.retired[serial])
            raise AuthError(
                "unknown_key", f"certificate serial={serial} of site {user_id!r} left the kit"
            )
        except AuthError as exc:
            failure = exc
        for other in snap.by_key.get(known[1], ()):
            if other.site_id != user_id:
                continue
            try:
                self._verify(snap, other, now)
            except AuthError:
                continue
            if serial not in self._moved:
                self._moved.add(serial)
                log.info(
                    "[site=%s] connection certified by serial=%s (%s) continues under serial=%s "
                    "of CA %s, which certifies the same key",
                    user_id,
                    serial,
                    failure.reason,
                    other.serial,
                    snap.issuer[other.serial].fingerprint,
                )
            return
        raise failure
