"""Secure aggregation by pairwise masking: the coordinator learns the sum, not one site's update.

Bonawitz et al. (CCS 2017) without the secret sharing. Every pair of sites (i, j) in an attempt's
masking set agrees on a key through X25519 and HKDF-SHA256; a ChaCha20 keystream under that key
(per tensor name) is the pair's mask vector. Site i encodes its values in fixed point, adds the
masks shared with every j sorting after it, subtracts those with every j sorting before it, all
modulo 2^k, and sends the result. Summed over the whole masking set, every mask appears once with
each sign and cancels: the coordinator gets the exact fixed-point sum, and any proper subset of
the masked vectors is uniformly random to it.

Fixed point (:class:`SecAggConfig`): a value v becomes ``rint(v * 2^frac_bits)`` in two's
complement modulo 2^k (k = ``word_bits``, 32 or 64). The sum of up to ``max_sites`` values each
bounded by ``clip_bound`` in magnitude (and 1, for the weight) cannot wrap because the config
requires ``max_sites * (max(clip_bound, 1) * 2^frac_bits + 1) <= 2^(k-1) - 1``; a site refuses
(ValueError) to mask any value beyond ``clip_bound``. Rounding makes each encoded value off by at
most 2^-(frac_bits+1); the decoded sum is the exact sum of the encoded values.

Weights: a site masks ``w * x`` together with ``w`` itself (the reserved tensor
:data:`WEIGHT_KEY`), ``w`` in [0, 1] (tokens divided by a public cap, or 1 for a plain mean). The
coordinator recovers ``sum(w x)`` and ``sum(w)`` and divides (:func:`unmask_mean`); single weights
stay hidden too.

Dropouts: if a site of the masking set never delivers, its masks do not cancel and the sum is
garbage. The rule is a re-run: the coordinator announces the survivors as the next attempt's
masking set and every survivor masks again with only survivors (:func:`decide_attempt`). Each
attempt derives fresh masks (the key derivation binds session, round, attempt and the set), a
site masks each (round, attempt) at most once, a re-run's set must be a strict subset of the
previous one and attempts are capped, so a round either completes or is abandoned; it never hangs.
The coordinator must unmask one attempt per round and discard the vectors of abandoned attempts:
see docs/security.md for what a coordinator that keeps them (or lies about dropouts) can learn.

Pair keys mix a per-session X25519 key (fresh each time an agent starts, so a restarted site never
reuses masks) with, in CURVE mode, the sites' static CURVE keys. The coordinator relays each
peer's session key with the peer's certificate; a site masks with a peer only once that
certificate verifies against the site's own kit (:class:`PeerTrust`: signed by one of its CAs,
valid now, naming the site id it is relayed for) and the session key is a usable X25519 key.
A coordinator can then substitute neither key to learn the masks: it holds no site's CURVE
secret, so every pair key with an honest peer stays secret to the pair, whatever session key it
relays. A peer that fails is refused by name (:class:`PeerRefused`) and the site masks with
nobody in that attempt: it drops out, as a site that went silent does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from comm.security.certs import CACertificate, Certificate
from comm.security.common import AuthError
from comm.security.masking import (
    WEIGHT_KEY,
    MaskedArrays,
    Peer,
    SecAggConfig,
    _ordered,
    _pair_key,
    check_x25519_public,
    curve_public_raw,
    encode_fixed,
    mask_stream,
    to_signed,
    x25519_public_bytes,
)

# ---------------------------------------------------------------------------------------------
# What a site checks before it masks with a peer


class PeerRefused(ValueError):
    """A peer of a masking plan whose keys this site will not mask with, and why."""

    def __init__(self, site_id: str, why: str) -> None:
        super().__init__(f"secagg: peer {site_id!r} refused: {why}")
        self.site_id = site_id


@dataclass(frozen=True, kw_only=True)
class PeerTrust:
    """A site's certified identity for masking, and what it checks its peers against.

    ``static_key`` is the site's CURVE secret as X25519 (:func:`x25519_from_curve_secret`);
    ``certificate`` its own certificate (PEM); ``cas`` returns the CAs of its kit's ``ca.pem``
    (called at every plan, so a kit reloaded during a CA rollover counts); ``wall_clock`` is
    what certificate validity is checked at.
    """

    static_key: X25519PrivateKey
    certificate: bytes
    cas: Callable[[], Sequence[CACertificate]]
    wall_clock: Callable[[], float] = time.time

    def certified_key(self, site_id: str, certificate: bytes | None) -> bytes:
        """The raw X25519 key that ``certificate`` certifies for ``site_id``: signed by a CA of
        ``cas()``, naming ``site_id``, valid now. Raises :class:`PeerRefused` otherwise."""
        if not certificate:
            raise PeerRefused(site_id, "the plan relays no certificate for it")
        try:
            cert = Certificate.from_pem(certificate)
            cas = self.cas()
            ca = cert.issuer_among(cas)
            if ca is None:
                fingerprints = ", ".join(c.fingerprint for c in cas)
                raise AuthError(
                    "bad_signature",
                    f"certificate serial={cert.serial} is signed by no CA of this site's kit "
                    f"({fingerprints})",
                )
            cert.verify(ca.public_key, self.wall_clock(), site_id=site_id)
        except AuthError as exc:
            raise PeerRefused(site_id, f"{exc.reason}: {exc.detail}") from None
        return curve_public_raw(cert.curve_public)


def _usable_session_key(site_id: str, peer: Peer) -> None:
    try:
        check_x25519_public(peer.session_public)
    except ValueError as exc:
        raise PeerRefused(site_id, f"session key: {exc}") from None


# ---------------------------------------------------------------------------------------------
# The site's side


class SecAggSession:
    """One site's masking state for the lifetime of its session key (one agent process).

    ``session_key`` is generated fresh unless given; announce :attr:`session_public` to the
    coordinator, which relays every participant's :class:`Peer` in its round plan. With
    ``trust`` (CURVE mode) every participant must come with a certificate that verifies against
    it, and pair keys depend on the certified static keys too.
    """

    def __init__(
        self,
        *,
        site_id: str,
        session_id: str,
        config: SecAggConfig,
        session_key: X25519PrivateKey | None = None,
        trust: PeerTrust | None = None,
    ) -> None:
        self.site_id = site_id
        self.session_id = session_id
        self.config = config
        self._session_key = session_key or X25519PrivateKey.generate()
        self._trust = trust
        self.session_public = x25519_public_bytes(self._session_key)
        self.static_public = x25519_public_bytes(trust.static_key) if trust is not None else None
        self._last: tuple[int, int] | None = None
        self._last_members: dict[str, Peer] = {}

    def peer(self) -> Peer:
        """This site's own entry for a round plan."""
        certificate = self._trust.certificate if self._trust is not None else None
        return Peer(session_public=self.session_public, certificate=certificate)

    def _check_plan(
        self, round_id: int, attempt: int, participants: Mapping[str, Peer]
    ) -> dict[str, bytes]:
        """Refuse a plan this site must not mask for (ValueError; :class:`PeerRefused` naming
        the first peer whose keys fail); the certified static key of every other participant
        (none without ``trust``)."""
        cfg = self.config
        if self.site_id not in participants:
            raise ValueError(f"secagg: site {self.site_id!r} is not in the masking set")
        if not cfg.min_sites <= len(participants) <= cfg.max_sites:
            raise ValueError(
                f"secagg: masking set of {len(participants)} sites is outside "
                f"[{cfg.min_sites}, {cfg.max_sites}]"
            )
        if not 0 <= attempt < cfg.max_attempts:
            raise ValueError(f"secagg: attempt {attempt} is outside [0, {cfg.max_attempts})")
        if not self._is_me(participants[self.site_id]):
            raise ValueError("secagg: the plan lists other keys for this site")
        if self._last is not None and (round_id, attempt) <= self._last:
            raise ValueError(
                f"secagg: already masked round {self._last[0]} attempt {self._last[1]}; "
                f"refusing round {round_id} attempt {attempt} (masks are never reused)"
            )
        if attempt > 0:
            # A re-run masks with survivors of the previous attempt only, under the same keys.
            prev = self._last_members if self._last == (round_id, attempt - 1) else None
            if prev is None:
                raise ValueError(
                    f"secagg: attempt {attempt} of round {round_id} does not follow "
                    "an attempt this site masked"
                )
            if not (set(participants) < set(prev)) or any(
                prev[s] != p for s, p in participants.items()
            ):
                raise ValueError("secagg: a re-run's set must be survivors of the previous one")
        statics: dict[str, bytes] = {}
        for site_id in _ordered(participants):
            if site_id == self.site_id:
                continue
            peer = participants[site_id]
            _usable_session_key(site_id, peer)
            if self._trust is not None:
                statics[site_id] = self._trust.certified_key(site_id, peer.certificate)
        return statics

    def _is_me(self, entry: Peer) -> bool:
        """Whether the plan's entry for this site holds this site's keys: its session key and,
        with ``trust``, a certificate of its own CURVE key."""
        if entry.session_public != self.session_public:
            return False
        if self._trust is None:
            return True
        try:
            cert = Certificate.from_pem(entry.certificate or b"")
        except AuthError:
            return False
        return curve_public_raw(cert.curve_public) == self.static_public

    def mask(
        self,
        arrays: Mapping[str, npt.ArrayLike],
        *,
        round_id: int,
        participants: Mapping[str, Peer],
        attempt: int = 0,
        weight: float = 1.0,
    ) -> MaskedArrays:
        """Masked fixed-point ``weight * x`` per tensor, plus the masked weight.

        ``participants`` is the attempt's whole masking set, this site included, as announced by
        the coordinator. Raises ValueError for an out-of-range value or weight, or a plan this
        site must refuse (see the module docstring); nothing is recorded then.
        """
        cfg = self.config
        if WEIGHT_KEY in arrays:
            raise ValueError(f"secagg: tensor name {WEIGHT_KEY!r} is reserved")
        if not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
            raise ValueError(f"secagg: weight must be in [0, 1], got {weight}")
        statics = self._check_plan(round_id, attempt, participants)
        out: MaskedArrays = {
            name: encode_fixed(name, np.asarray(x, dtype=np.float64) * weight, cfg)
            for name, x in arrays.items()
        }
        out[WEIGHT_KEY] = encode_fixed(WEIGHT_KEY, np.array([weight]), cfg)
        members = _ordered(participants)
        for other in members:
            if other == self.site_id:
                continue
            pair_key = self._pair_key(
                round_id, attempt, members, other, participants, statics.get(other)
            )
            add = self.site_id < other
            for name, enc in out.items():
                m = mask_stream(pair_key, name, enc.size, cfg).reshape(enc.shape)
                # uint arithmetic wraps: this is addition modulo 2^k.
                if add:
                    np.add(enc, m, out=enc)
                else:
                    np.subtract(enc, m, out=enc)
        self._last = (round_id, attempt)
        self._last_members = dict(participants)
        return out

    def _pair_key(
        self,
        round_id: int,
        attempt: int,
        members: list[str],
        other: str,
        participants: Mapping[str, Peer],
        other_static: bytes | None,
    ) -> bytes:
        peer = participants[other]
        shared = self._session_key.exchange(X25519PublicKey.from_public_bytes(peer.session_public))
        if self._trust is not None:
            assert other_static is not None  # certified in _check_plan
            shared += self._trust.static_key.exchange(
                X25519PublicKey.from_public_bytes(other_static)
            )
        lo, hi = sorted((self.site_id, other))
        return _pair_key(
            session_id=self.session_id,
            round_id=round_id,
            attempt=attempt,
            members=members,
            lo=lo,
            hi=hi,
            peers=participants,
            shared=shared,
        )


# ---------------------------------------------------------------------------------------------
# The coordinator's side: pure functions


@dataclass(frozen=True, kw_only=True)
class MaskingPlan:
    """One attempt of a round: who masks with whom, with which keys."""

    round_id: int
    attempt: int
    participants: Mapping[str, Peer]


def plan_message(plan: MaskingPlan) -> dict[str, Any]:
    """``RoundStart.secagg`` for ``plan``: ``attempt``, and per site ``[session public key as
    hex, certificate PEM or ""]`` (see :func:`plan_from_message`)."""
    return {
        "attempt": plan.attempt,
        "peers": {
            s: [p.session_public.hex(), p.certificate.decode("ascii") if p.certificate else ""]
            for s, p in sorted(plan.participants.items())
        },
    }


def plan_from_message(secagg: Mapping[str, Any]) -> tuple[int, dict[str, Peer]]:
    """The attempt and the peers a ``RoundStart.secagg`` relays, as relayed: nothing is
    verified here (:meth:`SecAggSession.mask` does). ValueError when it is malformed."""
    attempt, peers = secagg.get("attempt"), secagg.get("peers")
    if not isinstance(attempt, int) or isinstance(attempt, bool):
        raise ValueError("secagg: the plan names no attempt")
    if not isinstance(peers, dict):
        raise ValueError("secagg: the plan lists no peers")
    out: dict[str, Peer] = {}
    for site_id, keys in peers.items():
        if not (
            isinstance(site_id, str)
            and isinstance(keys, list)
            and len(keys) == 2
            and all(isinstance(k, str) for k in keys)
        ):
            raise ValueError(f"secagg: the plan's entry for {site_id!r} is not [key, certificate]")
        try:
            session_public = bytes.fromhex(keys[0])
            certificate = keys[1].encode("ascii") if keys[1] else None
        except (ValueError, UnicodeEncodeError):
            raise PeerRefused(str(site_id), "its relayed keys are not hex and PEM") from None
        out[site_id] = Peer(session_public=session_public, certificate=certificate)
    return attempt, out


@dataclass(frozen=True, kw_only=True)
class AttemptDecision:
    """``unmask`` the attempt, ``rerun`` with ``plan`` (the survivors), or ``abandon`` the round."""

    action: Literal["unmask", "rerun", "abandon"]
    plan: MaskingPlan | None


def decide_attempt(
    plan: MaskingPlan, received: Collection[str], config: SecAggConfig
) -> tuple[AttemptDecision, str]:
    """What to do when an attempt's deadline passes (or every vector is in).

    ``received`` names the sites whose masked vectors for this attempt arrived; vectors from
    sites outside the plan must have been rejected already and are ignored here.
    """
    survivors = {s: p for s, p in plan.participants.items() if s in received}
    dropped = sorted(set(plan.participants) - set(survivors))
    if not dropped:
        return AttemptDecision(action="unmask", plan=plan), "every masked vector arrived"
    if len(survivors) < config.min_sites:
        return AttemptDecision(action="abandon", plan=None), (
            f"only {len(survivors)} of {len(plan.participants)} sites delivered "
            f"(dropped {dropped}); fewer than min_sites={config.min_sites}"
        )
    if plan.attempt + 1 >= config.max_attempts:
        return AttemptDecision(action="abandon", plan=None), (
            f"dropped {dropped} in the last allowed attempt ({config.max_attempts})"
        )
    rerun = MaskingPlan(round_id=plan.round_id, attempt=plan.attempt + 1, participants=survivors)
    return AttemptDecision(action="rerun", plan=rerun), (
        f"dropped {dropped}: re-run with {len(survivors)} survivors"
    )


def unmask_sum_fixed(
    masked: Mapping[str, Mapping[str, npt.NDArray[np.unsignedinteger[Any]]]],
    plan: MaskingPlan,
    config: SecAggConfig,
) -> dict[str, npt.NDArray[np.int64]]:
    """The exact fixed-point sums (signed integers) of one attempt's masked vectors.

    ``masked`` maps each site of ``plan`` to its vectors; anything but exactly the plan's sites
    with identical names, shapes and dtype is a ValueError (the masks would not cancel).
    """
    if set(masked) != set(plan.participants):
        raise ValueError(
            f"secagg: vectors from {sorted(masked)} do not match the masking set "
            f"{sorted(plan.participants)} of round {plan.round_id} attempt {plan.attempt}"
        )
    if len(masked) > config.max_sites:
        raise ValueError(f"secagg: {len(masked)} sites exceed max_sites={config.max_sites}")
    sites = sorted(masked)
    first = masked[sites[0]]
    if WEIGHT_KEY not in first:
        raise ValueError(f"secagg: vectors lack the weight entry {WEIGHT_KEY!r}")
    layout = {name: arr.shape for name, arr in first.items()}
    totals = {name: np.zeros(shape, dtype=config.dtype) for name, shape in layout.items()}
    for site in sites:
        vectors = masked[site]
        if {n: a.shape for n, a in vectors.items()} != layout:
            raise ValueError(f"secagg: site {site!r} sent other tensor names or shapes")
        for name, arr in vectors.items():
            if arr.dtype != config.dtype:
                raise ValueError(
                    f"secagg: site {site!r} tensor {name!r} is {arr.dtype}, not {config.dtype}"
                )
            np.add(totals[name], arr, out=totals[name])
    return {name: to_signed(total, config) for name, total in totals.items()}


def unmask_sum(
    masked: Mapping[str, Mapping[str, npt.NDArray[np.unsignedinteger[Any]]]],
    plan: MaskingPlan,
    config: SecAggConfig,
    *,
    dtype: type[np.floating[Any]] = np.float32,
) -> dict[str, npt.NDArray[np.floating[Any]]]:
    """The decoded sums ``sum_s w_s x_s`` per tensor, and ``sum_s w_s`` under :data:`WEIGHT_KEY`."""
    return {
        name: np.ldexp(total.astype(np.float64), -config.frac_bits).astype(dtype)
        for name, total in unmask_sum_fixed(masked, plan, config).items()
    }


def unmask_mean(
    masked: Mapping[str, Mapping[str, npt.NDArray[np.unsignedinteger[Any]]]],
    plan: MaskingPlan,
    config: SecAggConfig,
) -> tuple[dict[str, npt.NDArray[np.float32]], float]:
    """The weighted mean ``sum(w x) / sum(w)`` per tensor and the total weight ``sum(w)``."""
    sums = unmask_sum(masked, plan, config, dtype=np.float64)
    total_weight = float(sums.pop(WEIGHT_KEY)[0])
    if total_weight <= 0:
        raise ValueError("secagg: the total weight is 0: no site contributed")
    return {n: (s / total_weight).astype(np.float32) for n, s in sums.items()}, total_weight
