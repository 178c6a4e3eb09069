"""What a coordinator trusts, and the rules by which a reload of the kit may change it.

:class:`Trust` is the CAs and revocation lists a registry (``comm.security.registry``) trusts.
:func:`reload_cas` and :func:`reload_revocations` read the kit again and refuse, through a
callback, trust material that would loosen what is loaded: a retired CA brought back, a CA
dropped without being retired, a CA added outside its validity, a revocation list gone or older.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from comm.security.certs import CACertificate, load_ca_bundle, load_ca_certificate
from comm.security.common import CA_CERT, CRL, RETIRED_DIR, AuthError
from comm.security.crl import RevocationList, parse_revocation_bundle

TrustRefusal = str
"""Why a reload refused trust material (``crossdc_trust_reload_refused_total{reason}``):
``bad_bundle`` (``ca.pem`` does not parse, or would leave no CA), ``retired_ca`` (it brings
back a retired CA), ``dropped_ca`` (it drops a CA that is not retired), ``expired_ca`` (it adds a
CA outside its validity), ``bad_retired`` (a ``retired/`` entry does not parse), ``bad_crl``
(``crl.pem`` is missing, does not parse, or holds a list no known CA signed), ``missing_crl``
(a CA's list that was loaded is gone), ``stale_crl`` (a CA's list is older than the loaded one).
"""


Refuse = Callable[[TrustRefusal, str], None]
"""Told each refusal: why, and a line naming what was refused."""


@dataclass(frozen=True)
class Trust:
    """The CAs and revocation lists a registry trusts; only a reload that passes changes them."""

    cas: tuple[CACertificate, ...]
    """Trusted now, the current CA first."""
    retired: tuple[CACertificate, ...] = ()
    """Retired: every certificate they signed is refused as revoked."""
    revocations: Mapping[str, RevocationList] = field(default_factory=dict)
    """Each trusted CA's list, by its fingerprint."""


def reload_cas(
    kit: Path, old: Trust, now: float, refuse: Refuse
) -> tuple[tuple[CACertificate, ...], tuple[CACertificate, ...]]:
    """The CAs trusted and retired after reading ``ca.pem`` and ``retired/`` of ``kit`` at
    wall-clock ``now``; what would loosen ``old`` is refused through ``refuse``."""
    retired = {c.fingerprint: c for c in old.retired}
    try:
        for ca in load_retired(kit):
            retired.setdefault(ca.fingerprint, ca)
    except (OSError, ValueError) as exc:
        refuse("bad_retired", str(exc))
    loaded = {c.fingerprint for c in old.cas}
    # A CA retired now, while ca.pem still lists it, leaves: retirement wins.
    kept = tuple(c for c in old.cas if c.fingerprint not in retired)
    try:
        bundle = load_ca_bundle(kit / CA_CERT)
    except (OSError, ValueError) as exc:
        refuse("bad_bundle", f"{CA_CERT}: {exc}")
        return kept or old.cas, tuple(retired.values())
    listed = {c.fingerprint for c in bundle}
    back = [c for c in bundle if c.fingerprint in retired and c.fingerprint not in loaded]
    dropped = [c for c in old.cas if c.fingerprint not in listed | retired.keys()]
    dead = [
        c for c in bundle if c.fingerprint not in loaded and not c.not_before <= now < c.not_after
    ]
    cas = tuple(c for c in bundle if c.fingerprint not in retired)
    if back:
        refuse(
            "retired_ca",
            f"{CA_CERT} lists CA {', '.join(c.fingerprint for c in back)}, which is retired",
        )
    elif dropped:
        refuse(
            "dropped_ca",
            f"{CA_CERT} no longer lists CA {', '.join(c.fingerprint for c in dropped)}, which "
            f"{RETIRED_DIR}/ does not record as retired (crossdc keys retire-ca retires a CA)",
        )
    elif dead:
        refuse(
            "expired_ca",
            f"{CA_CERT} adds CA {', '.join(c.fingerprint for c in dead)} outside its validity "
            f"(now is {int(now)})",
        )
    elif not cas:
        refuse("bad_bundle", f"{CA_CERT} lists no CA that is not retired")
    else:
        return cas, tuple(retired.values())
    return kept or old.cas, tuple(retired.values())


def reload_revocations(
    kit: Path,
    old: Trust,
    cas: tuple[CACertificate, ...],
    retired: tuple[CACertificate, ...],
    refuse: Refuse,
) -> dict[str, RevocationList]:
    """Each trusted CA's revocation list after reading ``crl.pem`` of ``kit``."""
    kept = {
        c.fingerprint: old.revocations[c.fingerprint]
        for c in cas
        if c.fingerprint in old.revocations
    }
    try:
        lists = parse_revocation_bundle(
            (kit / CRL).read_bytes(), [c.public_key for c in cas + retired]
        )
    except (OSError, AuthError) as exc:
        refuse("bad_crl", f"{CRL}: {exc}")
        return kept
    out: dict[str, RevocationList] = {}
    for ca in cas:
        loaded = kept.get(ca.fingerprint)
        new = lists.get(ca.fingerprint)
        if new is None:
            if loaded is not None:
                refuse(
                    "missing_crl",
                    f"{CRL} holds no revocation list of CA {ca.fingerprint}; keeping "
                    f"version {loaded.version}",
                )
                out[ca.fingerprint] = loaded
            # else a CA just added: nothing it signed was revoked yet
        elif loaded is not None and new.version < loaded.version:
            refuse(
                "stale_crl",
                f"revocation list version {new.version} of CA {ca.fingerprint} is older "
                f"than the loaded version {loaded.version}",
            )
            out[ca.fingerprint] = loaded
        else:
            out[ca.fingerprint] = new
    return out


def load_retired(kit: Path) -> tuple[CACertificate, ...]:
    """The CAs ``retired/<fingerprint>/ca.pem`` records as retired (``crossdc keys retire-ca``);
    ValueError naming a file that does not hold the CA its directory names."""
    out = []
    root = kit / RETIRED_DIR
    if not root.is_dir():
        return ()
    for path in sorted(root.glob(f"*/{CA_CERT}")):
        ca = load_ca_certificate(path)
        if ca.fingerprint != path.parent.name:
            raise ValueError(f"{str(path)!r} holds CA {ca.fingerprint}, not {path.parent.name}")
        out.append(ca)
    return tuple(out)
