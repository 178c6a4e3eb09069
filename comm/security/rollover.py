"""CA rollover: a federation moves to a new CA while it runs, trusting both for an overlap.

:func:`rotate_ca` starts the overlap. It makes a new CA, puts it first in ``ca.pem`` with the
current CA after it (the trust bundle: both anchors, so a role that knows either verifies
either's certificates), gives the new CA an empty CRL beside the current one in ``crl.pem``,
and re-issues every certificate the current CA vouches for now (not revoked, not expired) under
the new CA, for the same site and the same CURVE key. Site keys are kept: only public files
travel, and a site's open connection stays valid because its key stays certified. The current
CA's key moves to ``previous-ca.key`` (revocations during the overlap need both CAs), and
``rollover/<site>/`` holds what each site installs: the bundle ``ca.pem`` and its new
``site.pem``.

:func:`retire_ca` ends it. The previous CA signs a last CRL revoking every certificate it
issued; that CRL and its CA certificate are kept under ``retired/<fingerprint>/``, which is what
tells a running coordinator that the CA is retired; ``ca.pem`` and ``crl.pem`` keep only the
new CA, and ``previous-ca.key`` is deleted. It refuses while a site's key holds a valid
certificate of the previous CA only, unless forced.

A running coordinator picks each step up from the kit directory
(:class:`~comm.security.registry.CertificateRegistry`), and a running site from its own kit
(:class:`~comm.security.rolekits.SiteKitWatcher`); neither restarts. The coordinator's CURVE and
signing keys are not certificates (sites pin them): a rollover leaves them as they are.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from comm.security.certs import (
    CACertificate,
    Certificate,
    ca_bundle_pem,
    load_ca_bundle,
    make_ca_certificate,
    make_site_certificate,
    parse_ca_certificate,
)
from comm.security.common import (
    _BACKDATE_S,
    _PRIVATE_MODE,
    _PUBLIC_MODE,
    _SECONDS_PER_DAY,
    CA_CERT,
    CA_KEY,
    CERTS_DIR,
    CRL,
    MANIFEST,
    PREVIOUS_CA_KEY,
    RETIRED_DIR,
    ROLLOVER_DIR,
    SITE_CERT,
    _kit_lock,
    _mkdir_private,
    _write,
    curve_raw,
)
from comm.security.crl import Revocation, RevocationList, parse_revocation_bundle
from comm.security.kits import (
    _DEFAULT_CA_DAYS,
    _ca_keys,
    _cert_path,
    _check_days,
    _crl_blocks,
    _new_serial,
    _write_crl,
    _write_crl_blocks,
    _write_manifest,
    issued_certificates,
    require_format,
)
from comm.security.signing import _private_pem, generate_signing_key

log = logging.getLogger(__name__)

_EMPTY = RevocationList(version=0, issued_at=0, entries=())


@dataclass(frozen=True, kw_only=True)
class Rollover:
    """What :func:`rotate_ca` did, and what must now be distributed."""

    kit_dir: Path
    previous_ca: CACertificate
    ca: CACertificate
    """The new CA: issues from now on."""
    certificates: tuple[Certificate, ...]
    """The certificates re-issued under the new CA (recorded in ``certs/``)."""
    site_files: dict[str, tuple[Path, ...]]
    """Per site: ``ca.pem`` then ``site.pem`` to copy into its kit, in that order."""
    coordinator_files: tuple[Path, ...]
    """What a coordinator running from a copy of the kit needs: ``ca.pem``, ``crl.pem``,
    ``certs/``."""


@dataclass(frozen=True, kw_only=True)
class Retirement:
    """What :func:`retire_ca` did, and what must now be distributed."""

    kit_dir: Path
    retired_ca: CACertificate
    ca: CACertificate
    revoked: tuple[str, ...]
    """The serials the retired CA's last CRL revokes that it had not revoked before."""
    record_dir: Path
    """``retired/<fingerprint>/``: the retired CA's certificate and last CRL."""
    site_files: dict[str, tuple[Path, ...]]
    """Per site: the ``ca.pem`` without the retired CA."""
    coordinator_files: tuple[Path, ...]
    """``retired/`` first, then ``ca.pem`` and ``crl.pem``."""


def _manifest(kit: Path) -> dict[str, object]:
    fields = json.loads((kit / MANIFEST).read_text())
    assert isinstance(fields, dict)
    fields.pop("format", None)
    return fields


def _revocations(kit: Path, cas: tuple[CACertificate, ...]) -> dict[str, RevocationList]:
    try:
        return parse_revocation_bundle((kit / CRL).read_bytes(), [c.public_key for c in cas])
    except OSError as exc:
        raise ValueError(f"cannot read the revocation list {str(kit / CRL)!r}: {exc}") from None


def rotate_ca(
    kit_dir: str | Path,
    *,
    ca_days: float = _DEFAULT_CA_DAYS,
    days: float | None = None,
    now: float | None = None,
) -> Rollover:
    """Start a CA rollover in a federation kit (see the module). The new CA is valid for
    ``ca_days``; each re-issued certificate keeps the expiry of the one it replaces, or is
    valid for ``days`` from now when given. Needs ``ca.key``.

    Refuses (ValueError, nothing written) a kit already in a rollover, a ``ca.key`` that is
    not the current CA's, a current CA that has expired (nothing of it is left to carry over:
    make a new kit), and a re-issued certificate that would outlive the new CA.
    """
    _check_days(ca_days, "ca_days")
    if days is not None:
        _check_days(days, "days")
    kit = require_format(Path(kit_dir))
    with _kit_lock(kit):
        if (kit / PREVIOUS_CA_KEY).exists():
            raise ValueError(
                f"a CA rollover is already under way in {str(kit)!r} ({PREVIOUS_CA_KEY} is "
                "there): end it with `crossdc keys retire-ca` first"
            )
        cas = load_ca_bundle(kit / CA_CERT)
        if len(cas) != 1:
            raise ValueError(
                f"{CA_CERT} lists {len(cas)} CAs but there is no {PREVIOUS_CA_KEY}: this kit is "
                "not one `crossdc keys` keeps"
            )
        previous = cas[0]
        previous_key = _ca_keys(kit, cas)[previous.fingerprint]
        at = int(time.time() if now is None else now)
        if at >= previous.not_after:
            raise ValueError(
                f"the CA {previous.fingerprint} expired at {previous.not_after} (now is {at}): no "
                "certificate of it is valid to carry over; create a new federation kit "
                "(`crossdc keys init`) and issue every site"
            )
        not_after = at + int(ca_days * _SECONDS_PER_DAY)
        revoked = _revocations(kit, cas).get(previous.fingerprint, _EMPTY).serials
        carried = [
            c
            for c in issued_certificates(kit)
            if c.issuer_among(cas) is not None and c.serial not in revoked and at < c.not_after
        ]
        key = generate_signing_key()
        ca = parse_ca_certificate(
            make_ca_certificate(
                key, not_before=at - _BACKDATE_S, not_after=not_after, serial=_new_serial()
            )
        )
        reissued = []
        for cert in carried:
            until = cert.not_after if days is None else at + int(days * _SECONDS_PER_DAY)
            if until > ca.not_after:
                raise ValueError(
                    f"the re-issued certificate of site {cert.site_id!r} (serial {cert.serial}) "
                    f"would expire at {until}, after the new CA ({ca.not_after}): pass a longer "
                    "--ca-days, or fewer --days"
                )
            reissued.append(
                make_site_certificate(
                    key,
                    site_id=cert.site_id,
                    curve_public=cert.curve_public,
                    not_before=at - _BACKDATE_S,
                    not_after=until,
                    serial=_new_serial(),
                )
            )
        # A coordinator running on this directory reads it between any two writes: the new
        # CA is in ca.pem before its CRL and its certificates appear.
        _write(kit / PREVIOUS_CA_KEY, _private_pem(previous_key), _PRIVATE_MODE)
        _write(kit / CA_KEY, _private_pem(key), _PRIVATE_MODE, replace=True)
        bundle = ca_bundle_pem((ca, previous))
        _write(kit / CA_CERT, bundle, _PUBLIC_MODE, replace=True)
        _write_crl(kit, key, RevocationList(version=0, issued_at=at, entries=()))
        for cert in reissued:
            _write(_cert_path(kit, cert), cert.to_pem(), _PUBLIC_MODE)
        site_files = _write_site_packages(kit, reissued, bundle)
        _write_manifest(
            kit,
            {
                **_manifest(kit),
                "ca_fingerprint": ca.fingerprint,
                "previous_ca_fingerprint": previous.fingerprint,
                "rollover_started_at": at,
            },
            replace=True,
        )
    log.info(
        "CA rollover: CA %s issues from now on; CA %s trusted until retired; %d certificate(s) "
        "re-issued for %d site(s)",
        ca.fingerprint,
        previous.fingerprint,
        len(reissued),
        len(site_files),
    )
    return Rollover(
        kit_dir=kit,
        previous_ca=previous,
        ca=ca,
        certificates=tuple(reissued),
        site_files=site_files,
        coordinator_files=(kit / CA_CERT, kit / CRL, kit / CERTS_DIR),
    )


def _write_site_packages(
    kit: Path, reissued: list[Certificate], bundle: bytes
) -> dict[str, tuple[Path, ...]]:
    """``rollover/<site>/``: the bundle and the site's newest re-issued certificate. A site
    still running an older key during a renewal finds that key's certificate in ``certs/``."""
    root = kit / ROLLOVER_DIR
    if root.exists():
        shutil.rmtree(root)  # a previous rollover's copies of public files
    newest: dict[str, Certificate] = {}
    for cert in reissued:
        if cert.site_id not in newest or cert.not_after > newest[cert.site_id].not_after:
            newest[cert.site_id] = cert
    out: dict[str, tuple[Path, ...]] = {}
    for site_id in sorted(newest):
        target = root / site_id
        _mkdir_private(target)
        _write(target / CA_CERT, bundle, _PUBLIC_MODE)
        _write(target / SITE_CERT, newest[site_id].to_pem(), _PUBLIC_MODE)
        out[site_id] = (target / CA_CERT, target / SITE_CERT)
    return out


def retire_ca(kit_dir: str | Path, *, force: bool = False, now: float | None = None) -> Retirement:
    """End a CA rollover (see the module): the previous CA revokes everything it issued and is
    trusted no more. Needs ``ca.key`` and ``previous-ca.key``.

    Refuses (ValueError, nothing written) a kit with no rollover under way, key files that are
    not the CAs' of ``ca.pem``, and, unless ``force``, a kit where a site's key holds a valid
    certificate of the previous CA and none of the new one (it would be locked out).
    """
    kit = require_format(Path(kit_dir))
    with _kit_lock(kit):
        if not (kit / PREVIOUS_CA_KEY).exists():
            raise ValueError(
                f"no CA rollover is under way in {str(kit)!r} (no {PREVIOUS_CA_KEY}): "
                "`crossdc keys rotate-ca` starts one"
            )
        cas = load_ca_bundle(kit / CA_CERT)
        keys = _ca_keys(kit, cas)
        if len(cas) != 2:
            raise ValueError(f"{CA_CERT} lists {len(cas)} CAs; during a rollover it lists two")
        ca = cas[0]
        (previous,) = (c for c in cas[1:] if c.fingerprint in keys)
        at = int(time.time() if now is None else now)
        lists = _revocations(kit, cas)
        previous_list = lists.get(previous.fingerprint, _EMPTY)
        new_list = lists.get(ca.fingerprint, _EMPTY)
        certs = issued_certificates(kit)
        covered = {
            (c.site_id, curve_raw(c.curve_public))
            for c in certs
            if c.issuer_among([ca]) is not None
            and c.serial not in new_list.serials
            and c.not_before <= at < c.not_after
        }
        previous_certs = [c for c in certs if c.issuer_among([previous]) is not None]
        stranded = [
            c
            for c in previous_certs
            if c.serial not in previous_list.serials
            and at < c.not_after
            and (c.site_id, curve_raw(c.curve_public)) not in covered
        ]
        if stranded and not force:
            named = ", ".join(f"{c.site_id} (serial {c.serial})" for c in stranded)
            raise ValueError(
                f"retiring CA {previous.fingerprint} would lock out {named}: no valid "
                f"certificate of CA {ca.fingerprint} certifies the same key. Issue one "
                "(`crossdc keys issue`), or pass --force to lock them out"
            )
        revoked = tuple(c.serial for c in previous_certs if c.serial not in previous_list.serials)
        final = RevocationList(
            version=previous_list.version + 1,
            issued_at=at,
            entries=previous_list.entries
            + tuple(Revocation(serial=s, revoked_at=at) for s in revoked),
        )
        blocks = _crl_blocks(kit, cas)
        # retired/ first: a coordinator that sees it stops trusting the CA at once, and only
        # then sees ca.pem without it (a CA that leaves ca.pem unretired is refused).
        record = kit / RETIRED_DIR / previous.fingerprint
        _mkdir_private(record)
        _write(
            record / CRL,
            final.to_pem(keys[previous.fingerprint], next_update=previous.not_after),
            _PUBLIC_MODE,
            replace=True,
        )
        _write(record / CA_CERT, previous.pem, _PUBLIC_MODE, replace=True)
        bundle = ca_bundle_pem((ca,))
        _write(kit / CA_CERT, bundle, _PUBLIC_MODE, replace=True)
        _write_crl_blocks(kit, (ca,), blocks)
        site_files: dict[str, tuple[Path, ...]] = {}
        root = kit / ROLLOVER_DIR
        for target in sorted(root.iterdir()) if root.is_dir() else []:
            _write(target / CA_CERT, bundle, _PUBLIC_MODE, replace=True)
            site_files[target.name] = (target / CA_CERT,)
        (kit / PREVIOUS_CA_KEY).unlink()
        fields = _manifest(kit)
        fields.pop("previous_ca_fingerprint", None)
        fields.pop("rollover_started_at", None)
        history = fields.get("retired_cas")
        retired = list(history) if isinstance(history, list) else []
        retired.append({"fingerprint": previous.fingerprint, "retired_at": at})
        _write_manifest(kit, {**fields, "retired_cas": retired}, replace=True)
    log.info(
        "CA rollover done: CA %s retired (%d certificate(s) revoked by its last CRL); CA %s "
        "alone is trusted",
        previous.fingerprint,
        len(revoked),
        ca.fingerprint,
    )
    return Retirement(
        kit_dir=kit,
        retired_ca=previous,
        ca=ca,
        revoked=revoked,
        record_dir=record,
        site_files=site_files,
        coordinator_files=(kit / RETIRED_DIR, kit / CA_CERT, kit / CRL),
    )
