"""Loading a federation's keys for the running roles: the ``[*.security]`` config, the
coordinator's and a site's kit as they start, and ``SiteKitWatcher``, which reloads a site's
certificate and trust bundle while the agent runs. ``comm.security.kits`` makes the kits.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from comm.security.certs import (
    CACertificate,
    Certificate,
    load_ca_bundle,
    load_certificate,
)
from comm.security.common import (
    _SECONDS_PER_DAY,
    CA_CERT,
    COORDINATOR_CURVE_KEY,
    COORDINATOR_CURVE_PUB,
    COORDINATOR_SIGN_KEY,
    COORDINATOR_SIGN_PUB,
    SITE_CERT,
    SITE_CURVE_KEY,
    SITE_CURVE_PUB,
    AuthError,
    key_fingerprint,
)
from comm.security.identity import CurveKeys
from comm.security.kits import _load_curve, role_kit
from comm.security.signing import (
    load_private_key,
    load_public_key,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SecurityConfig:
    """How a role finds its keys. Embedded as ``[coordinator.security]`` / ``[site.security]``."""

    kit_dir: str = ""
    """The federation kit (coordinator) or the site's startup kit (site)."""
    insecure: bool = False
    """Run without CURVE and certificates: loopback demos and tests only, never over a WAN."""

    def __post_init__(self) -> None:
        if self.insecure and self.kit_dir:
            raise ValueError("security.insecure = true cannot be combined with security.kit_dir")

    def require(self) -> None:
        """Secure by default: a role without keys refuses to start unless ``insecure``."""
        if not self.insecure and not self.kit_dir:
            raise ValueError(
                "security.kit_dir is required (create one with `crossdc keys`), "
                "or set security.insecure = true for a loopback-only run"
            )


@dataclass(frozen=True, kw_only=True)
class CoordinatorKit:
    """What a running coordinator needs from the federation kit (not the CA private key)."""

    kit_dir: Path
    curve: CurveKeys
    """Server keys for the ROUTER (``ChannelConfig.curve``)."""
    signing_key: Ed25519PrivateKey
    """Signs global checkpoints (:func:`sign_blob`)."""
    cas: tuple[CACertificate, ...]
    """The CAs of ``ca.pem`` at startup, the current one first (two during a CA rollover). The
    running coordinator follows ``ca.pem`` through its registry
    (:class:`~comm.security.registry.CertificateRegistry`)."""


def load_coordinator_kit(kit_dir: str | Path) -> CoordinatorKit:
    kit = role_kit(Path(kit_dir), "coordinator")
    public, secret = _load_curve(kit / COORDINATOR_CURVE_KEY, kit / COORDINATOR_CURVE_PUB)
    return CoordinatorKit(
        kit_dir=kit,
        curve=CurveKeys(public=public, secret=secret),
        signing_key=load_private_key(kit / COORDINATOR_SIGN_KEY),
        cas=load_ca_bundle(kit / CA_CERT),
    )


@dataclass(frozen=True, kw_only=True)
class SiteKit:
    """What a running site agent needs from its startup kit."""

    site_id: str
    curve: CurveKeys
    """Client keys for the DEALER (``ChannelConfig.curve``, with the coordinator's key)."""
    certificate: Certificate
    ca: CACertificate
    """The CA of the kit's ``ca.pem`` that signed ``certificate``."""
    cas: tuple[CACertificate, ...]
    """Every CA of the kit's ``ca.pem`` (two during a CA rollover)."""
    coordinator_sign_public: Ed25519PublicKey
    """Verifies the coordinator's signed checkpoints (:func:`verify_blob`)."""


_EXPIRY_WARNING_S = 7 * _SECONDS_PER_DAY


def load_site_kit(
    site_kit_dir: str | Path, *, site_id: str | None = None, now: float | None = None
) -> SiteKit:
    """Load and check a site's startup kit: its certificate must be signed by a CA of the kit's
    ``ca.pem``, certify the kit's own CURVE key (and ``site_id`` when given) and be valid now;
    otherwise :class:`AuthError` explains why, before any connection is refused for it."""
    kit = role_kit(Path(site_kit_dir), "site")
    at = time.time() if now is None else now
    public, secret = _load_curve(kit / SITE_CURVE_KEY, kit / SITE_CURVE_PUB)
    cert = load_certificate(kit / SITE_CERT)
    cas = load_ca_bundle(kit / CA_CERT)
    ca = cert.issuer_among(cas)
    if ca is None:
        raise AuthError(
            "bad_signature",
            f"{SITE_CERT} (serial={cert.serial}, site {cert.site_id!r}) in {str(kit)!r} is "
            f"signed by no CA of its {CA_CERT} ({', '.join(c.fingerprint for c in cas)}); during "
            f"a CA rollover, install the new {CA_CERT} before the new {SITE_CERT}",
        )
    cert.verify(ca.public_key, at, site_id=site_id)
    if cert.curve_public != public:
        raise AuthError("unknown_key", f"{SITE_CERT} in {str(kit)!r} certifies another CURVE key")
    if cert.not_after - at < _EXPIRY_WARNING_S:
        log.warning(
            "[site=%s] certificate serial=%s expires in %.1f days: ask for a new kit",
            cert.site_id,
            cert.serial,
            (cert.not_after - at) / _SECONDS_PER_DAY,
        )
    server_public = (kit / COORDINATOR_CURVE_PUB).read_bytes().strip()
    return SiteKit(
        site_id=cert.site_id,
        curve=CurveKeys(public=public, secret=secret, server_public=server_public),
        certificate=cert,
        ca=ca,
        cas=cas,
        coordinator_sign_public=load_public_key(kit / COORDINATOR_SIGN_PUB),
    )


def file_stamp(path: Path) -> tuple[int, ...]:
    """What changes when a file is written or replaced, however it is copied (``cp -p`` keeps the
    modification time, not the inode or the change time); all -1 when it is missing."""
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1, -1)
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size)


RefuseCallback = Callable[[str, str], None]
"""``on_refuse(reason, detail)``: trust material on disk that a running role refused to load."""


class SiteKitWatcher:
    """A running site's certificate and trust bundle, re-read when they change on disk.

    :meth:`poll` (called from the agent's loop) looks at ``site.pem`` and ``ca.pem`` at most
    every ``interval_s``; when either changed it loads the kit again as :func:`load_site_kit`
    does. A kit that passes and certifies the CURVE key the agent runs with replaces the loaded
    one: that is how a site moves to a certificate of a new CA during a CA rollover, without a
    restart. Anything else (a file that does not parse, a certificate of no CA in ``ca.pem``,
    expired, for another site or another key) is refused: counted in ``refused`` by reason,
    reported to ``on_refuse`` and logged, and the loaded kit stays. Copy ``ca.pem`` before
    ``site.pem``: a new certificate needs its CA in the bundle.
    """

    def __init__(
        self,
        kit_dir: str | Path,
        kit: SiteKit,
        *,
        on_refuse: RefuseCallback | None = None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.kit_dir = Path(kit_dir)
        self.kit = kit
        self.refused: Counter[str] = Counter()
        self._on_refuse = on_refuse
        self._interval_s = interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._checked_at = clock()
        self._stamp = self._read_stamp()

    def _read_stamp(self) -> tuple[tuple[int, ...], ...]:
        return tuple(file_stamp(self.kit_dir / name) for name in (SITE_CERT, CA_CERT))

    def poll(self) -> SiteKit | None:
        """The new kit when one was loaded now; None when nothing changed or it was refused."""
        if self._clock() - self._checked_at < self._interval_s:
            return None
        self._checked_at = self._clock()
        stamp = self._read_stamp()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        return self.reload()

    def reload(self) -> SiteKit | None:
        """Load the kit again now (see the class); the new kit, or None."""
        site_id = self.kit.site_id
        try:
            kit = load_site_kit(self.kit_dir, site_id=site_id, now=self._wall_clock())
            if kit.curve != self.kit.curve:
                raise AuthError(
                    "unknown_key",
                    f"the kit now holds another CURVE key {key_fingerprint(kit.curve.public)}; "
                    f"the agent runs with {key_fingerprint(self.kit.curve.public)}: restart it "
                    "to use the new key",
                )
        except (OSError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, AuthError) else "unreadable"
            detail = exc.detail if isinstance(exc, AuthError) else str(exc)
            self.refused[reason] += 1
            log.error(
                "[site=%s] refused the kit in %s: %s: %s; keeping certificate serial=%s of CA %s",
                site_id,
                self.kit_dir,
                reason,
                detail,
                self.kit.certificate.serial,
                self.kit.ca.fingerprint,
            )
            if self._on_refuse is not None:
                self._on_refuse(reason, detail)
            return None
        if kit.certificate.serial == self.kit.certificate.serial and kit.cas == self.kit.cas:
            return None
        self.kit = kit
        log.info(
            "[site=%s] loaded certificate serial=%s of CA %s (trusting CA %s) valid until %d, "
            "without a restart",
            site_id,
            kit.certificate.serial,
            kit.ca.fingerprint,
            ", ".join(c.fingerprint for c in kit.cas),
            kit.certificate.not_after,
        )
        return kit

    def status(self) -> dict[str, Any]:
        """The loaded certificate, for the site's status document."""
        cert = self.kit.certificate
        return {
            "certificate": {
                "serial": cert.serial,
                "not_after": cert.not_after,
                "ca": self.kit.ca.fingerprint,
                "trusted_cas": [c.fingerprint for c in self.kit.cas],
            }
        }
