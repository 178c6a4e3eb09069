"""The form a round's update takes on the wire, chosen once when the site is assembled.

:func:`payload_form` picks it from the site's config: :class:`Compressed` (the default) encodes
the pseudo-gradient with the round's codec through the site's error feedback; :class:`Masked`
(``site.secure_aggregation``) clips it to the fixed-point range and masks it pairwise with the
round's peers (``comm.security.secagg``), so the coordinator learns only the sum. Either way the
sender (``site_agent.sender``) hands over a privatized pseudo-gradient and gets back a
:class:`Payload` to send, or None when nothing can go out.

:class:`Masked` holds the site's side of secure aggregation: the X25519 key this process
announces at its join, its masking session bound to the coordinator's session, the certified
identity its peers' certificates are checked against (its kit, reloaded during a CA rollover),
the update kept for a re-run after a dropout, and the fault drill that dies after masking.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from comm.codecs.base import EncodedTensor, NonFiniteError
from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import get_codec
from comm.security.certs import CACertificate
from comm.security.masking import SecAggConfig, x25519_from_curve_secret, x25519_public_bytes
from comm.security.rolekits import SiteKit
from comm.security.secagg import PeerRefused, PeerTrust, SecAggSession, plan_from_message
from comm.wire.schema import RoundStart
from site_agent.config import SiteConfig
from site_agent.exits import EXIT_FAULT_DRILL
from site_agent.metrics import SiteMetrics
from site_agent.trainer import TrainStats

log = logging.getLogger("crossdc.site")

Params = dict[str, np.ndarray]


@dataclass(frozen=True, kw_only=True)
class Payload:
    """An update ready to send: its tensors, its weight, the training it carries, and how the
    log names its form."""

    tensors: tuple[EncodedTensor, ...]
    weight: float
    stats: TrainStats
    label: str


class PayloadForm(Protocol):
    """What the sender needs of an update's wire form (see the module docstring)."""

    def join_capabilities(self) -> dict[str, str]:
        """What the site announces at its join for this form."""
        ...

    def session_opened(self, session_id: str) -> None:
        """The coordinator welcomed the site in ``session_id``."""
        ...

    def kit_loaded(self, kit: SiteKit) -> None:
        """The site's kit, at start or reloaded (a CA rollover)."""
        ...

    def make(self, rs: RoundStart, delta: Params, stats: TrainStats, tokens: int) -> Payload | None:
        """Round ``rs``'s payload of ``delta`` (``tokens``: trained for its fragment since the
        fragment's last send); None when it cannot be made and nothing may go out."""
        ...

    def make_again(self, rs: RoundStart) -> Payload | None:
        """A repeat of round ``rs`` (``rs.attempt`` > 0) from what was kept of its first
        payload; None when nothing is kept or it cannot be made."""
        ...


def payload_form(
    cfg: SiteConfig, *, feedback: ErrorFeedback, metrics: SiteMetrics, kit: SiteKit | None
) -> PayloadForm:
    """The site's payload form, as its config asks."""
    if cfg.secure_aggregation is None:
        return Compressed(site_id=cfg.site_id, feedback=feedback, metrics=metrics)
    masked = Masked(
        site_id=cfg.site_id,
        config=cfg.secure_aggregation,
        metrics=metrics,
        fault_exit_round=cfg.fault_exit_before_send_round,
    )
    if kit is not None:
        masked.kit_loaded(kit)
    return masked


def _not_held(site_id: str, rs: RoundStart) -> None:
    log.warning("[site=%s round=%d] re-run for an update I do not hold", site_id, rs.round_id)


class Compressed:
    """The round's codec through the site's error feedback, weighted by the tokens trained."""

    def __init__(self, *, site_id: str, feedback: ErrorFeedback, metrics: SiteMetrics) -> None:
        self.site_id = site_id
        self.feedback = feedback
        self._metrics = metrics

    def join_capabilities(self) -> dict[str, str]:
        return {}

    def session_opened(self, session_id: str) -> None:
        pass

    def kit_loaded(self, kit: SiteKit) -> None:
        pass

    def make(self, rs: RoundStart, delta: Params, stats: TrainStats, tokens: int) -> Payload | None:
        """``delta`` encoded with the round's codec and the error feedback; None when it cannot
        be: then every residual owes what it owed before, those of the tensors encoded before
        the failing one included."""
        residuals = self.feedback.state_dict()
        try:
            codec = get_codec(rs.codec)
            tensors = tuple(self.feedback.compress(k, v, codec) for k, v in delta.items())
        except NonFiniteError as exc:
            self._metrics.rejected("non_finite_local")
            log.error("[site=%s round=%d] not sending: %s", self.site_id, rs.round_id, exc)
        except ValueError as exc:
            log.error(
                "[site=%s round=%d] cannot encode with %r: %s",
                self.site_id,
                rs.round_id,
                rs.codec,
                exc,
            )
        else:
            self._metrics.ef_norm(self.feedback.residual_norm())
            return Payload(
                tensors=tensors, weight=float(tokens or stats.tokens), stats=stats, label=rs.codec
            )
        self.feedback.load_state_dict(residuals)
        return None

    def make_again(self, rs: RoundStart) -> Payload | None:
        _not_held(self.site_id, rs)  # a compressed update is never repeated
        return None


class Masked:
    """Pairwise masking with the round's peers (see the module docstring)."""

    def __init__(
        self,
        *,
        site_id: str,
        config: SecAggConfig,
        metrics: SiteMetrics,
        fault_exit_round: int = 0,
    ) -> None:
        """``fault_exit_round``: a fault drill, the round whose masked update the process dies
        before sending (0: none)."""
        self.site_id = site_id
        self._config = config
        self._metrics = metrics
        # One X25519 key per process, announced at join; the masking session is bound to the
        # coordinator's session (every site derives pair keys from the same id).
        self._session_key = X25519PrivateKey.generate()
        self._trust: PeerTrust | None = None
        self._kit: SiteKit | None = None
        self.session: SecAggSession | None = None
        self._kept: dict[int, tuple[Params, TrainStats]] = {}  # unmasked, for a re-run
        self._fault_exit_round = fault_exit_round

    def join_capabilities(self) -> dict[str, str]:
        return {"secagg_session_public": x25519_public_bytes(self._session_key).hex()}

    def session_opened(self, session_id: str) -> None:
        """Masks are bound to the coordinator's session."""
        self.session = SecAggSession(
            site_id=self.site_id,
            session_id=session_id,
            config=self._config,
            session_key=self._session_key,
            trust=self._trust,
        )

    def kit_loaded(self, kit: SiteKit) -> None:
        """Masks bind to the kit's certified CURVE key, and peers' certificates are checked
        against its CAs."""
        self._kit = kit
        if self._trust is None:
            # A reloaded kit holds the same CURVE key (SiteKitWatcher refuses another one).
            self._trust = PeerTrust(
                static_key=x25519_from_curve_secret(kit.curve.secret),
                certificate=kit.certificate.to_pem(),
                cas=self._trusted_cas,
            )

    def _trusted_cas(self) -> tuple[CACertificate, ...]:
        return self._kit.cas if self._kit is not None else ()

    def make(self, rs: RoundStart, delta: Params, stats: TrainStats, tokens: int) -> Payload | None:
        """Clip to the fixed-point range and mask; keep the clipped update for a re-run."""
        bound = self._config.clip_bound
        clipped = sum(int((np.abs(v) > bound).sum()) for v in delta.values())
        if clipped:
            log.warning(
                "[site=%s round=%d] %d values clipped to +-%g for masking",
                self.site_id,
                rs.round_id,
                clipped,
                bound,
            )
        delta = {k: np.clip(v, -bound, bound) for k, v in delta.items()}
        self._kept = {rs.round_id: (delta, stats)}
        payload = self._mask(rs, delta, stats)
        if payload is None:
            self._kept.clear()  # a re-run must not send what stays local
        return payload

    def make_again(self, rs: RoundStart) -> Payload | None:
        """A re-run of round ``rs`` after a dropout: mask the kept update again, for the
        survivors."""
        kept = self._kept.get(rs.round_id)
        if kept is None:
            _not_held(self.site_id, rs)
            return None
        log.info(
            "[site=%s round=%d] secure aggregation re-run, attempt %d",
            self.site_id,
            rs.round_id,
            rs.secagg["attempt"],
        )
        return self._mask(rs, *kept)

    def _mask(self, rs: RoundStart, delta: Params, stats: TrainStats) -> Payload | None:
        assert self.session is not None, "session_opened() first"
        try:
            attempt, peers = plan_from_message(rs.secagg)
            masked = self.session.mask(
                delta, round_id=rs.round_id, participants=peers, attempt=attempt
            )
        except ValueError as exc:
            # Nothing goes out: to the coordinator this site dropped out of the attempt, which
            # re-runs with the survivors; the update stays local for the next round.
            self._metrics.rejected("secagg_peer" if isinstance(exc, PeerRefused) else "secagg_plan")
            log.error("[site=%s round=%d] not masking: %s", self.site_id, rs.round_id, exc)
            return None
        if rs.round_id == self._fault_exit_round and attempt == 0:
            log.error(
                "[site=%s round=%d] fault drill: exiting after masking", self.site_id, rs.round_id
            )
            logging.shutdown()
            os._exit(EXIT_FAULT_DRILL)
        # Masked sums are plain means: every site's weight is the same (and hidden).
        return Payload(
            tensors=masked_payload(masked, attempt),
            weight=float(stats.tokens),
            stats=stats,
            label=f"masked, attempt {attempt}",
        )


def masked_payload(masked: Mapping[str, np.ndarray], attempt: int) -> tuple[EncodedTensor, ...]:
    """A masked update as it travels: each tensor flat, codec ``secagg``, naming its attempt."""
    return tuple(
        EncodedTensor(
            name=name,
            shape=tuple(arr.shape),
            codec="secagg",
            meta={"attempt": attempt},
            buffers=(arr.reshape(-1),),
        )
        for name, arr in masked.items()
    )
