"""Sending a round's update: the pseudo-gradient of its fragment, privatized (differential
privacy), then compressed with error feedback or masked for secure aggregation, with the site's
link measurements; and sending again the updates a dropped link may have lost.

:class:`UpdateSender` owns everything that shapes what leaves the site: the error-feedback
residuals, the privacy accountant and its noise, the secure-aggregation session and the unmasked
update kept for a re-run, the tokens trained per fragment since its last send (the update's
weight), and the updates still awaiting their round's result.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from comm.codecs.base import EncodedTensor, NonFiniteError
from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import get_codec
from comm.security.certs import CACertificate
from comm.security.masking import (
    SecAggConfig,
    x25519_from_curve_secret,
    x25519_public_bytes,
)
from comm.security.rolekits import SiteKit
from comm.security.secagg import (
    PeerRefused,
    PeerTrust,
    SecAggSession,
    plan_from_message,
)
from comm.wire.schema import Message, RoundStart, Update
from site_agent.config import SiteConfig
from site_agent.exits import EXIT_FAULT_DRILL
from site_agent.metrics import SiteMetrics
from site_agent.privacy import DPConfig, PrivacyAccountant, new_noise_generator, privatize
from site_agent.trainer import TrainStats

log = logging.getLogger("crossdc.site")

Params = dict[str, np.ndarray]


class UpdateChannel(Protocol):
    """Where updates go (the site's session with its coordinator)."""

    def send(self, msg: Message) -> None: ...

    def link_estimate(self) -> tuple[float, float]: ...


class UpdateSender:
    """Turns a round's pseudo-gradient into the update that goes out (see the module
    docstring). The send methods return whether an update went out."""

    def __init__(
        self,
        *,
        site_id: str,
        channel: UpdateChannel,
        metrics: SiteMetrics,
        feedback: ErrorFeedback,
        secure_aggregation: SecAggConfig | None = None,
        privacy: DPConfig | None = None,
        trust: PeerTrust | None = None,
        fault_exit_round: int = 0,
    ) -> None:
        """``trust``: the site's certified identity and its kit's CAs (CURVE mode), binding
        every mask to certified keys (:class:`PeerTrust`). ``fault_exit_round``: a fault drill,
        the round whose masked update the process dies before sending (0: none)."""
        self.site_id = site_id
        self._channel = channel
        self._metrics = metrics
        self.feedback = feedback
        self._secagg_cfg = secure_aggregation
        self._privacy = privacy
        self.accountant = PrivacyAccountant(privacy) if privacy is not None else None
        self._noise = new_noise_generator()
        # Secure aggregation: one X25519 key per process, announced at join; the masking session
        # is bound to the coordinator's session (every site derives pair keys from the same id).
        self._secagg_key = X25519PrivateKey.generate() if secure_aggregation else None
        self._trust = trust
        self._kit: SiteKit | None = None
        self.secagg: SecAggSession | None = None
        self._unmasked: dict[int, tuple[Params, TrainStats]] = {}  # kept for a re-run
        self._fault_exit_round = fault_exit_round
        self._tokens: dict[int, int] = {}  # per fragment: tokens trained since its last send

    @classmethod
    def for_site(
        cls,
        cfg: SiteConfig,
        *,
        channel: UpdateChannel,
        metrics: SiteMetrics,
        feedback: ErrorFeedback,
        kit: SiteKit | None,
    ) -> UpdateSender:
        sender = cls(
            site_id=cfg.site_id,
            channel=channel,
            metrics=metrics,
            feedback=feedback,
            secure_aggregation=cfg.secure_aggregation,
            privacy=cfg.privacy,
            fault_exit_round=cfg.fault_exit_before_send_round,
        )
        if cfg.secure_aggregation is not None and kit is not None:
            sender.kit_loaded(kit)
        return sender

    def kit_loaded(self, kit: SiteKit) -> None:
        """The site's kit, at start or reloaded (a CA rollover): masks bind to its certified
        CURVE key, and peers' certificates are checked against its CAs."""
        self._kit = kit
        if self._secagg_cfg is not None and self._trust is None:
            # A reloaded kit holds the same CURVE key (SiteKitWatcher refuses another one).
            self._trust = PeerTrust(
                static_key=x25519_from_curve_secret(kit.curve.secret),
                certificate=kit.certificate.to_pem(),
                cas=self._trusted_cas,
            )

    def _trusted_cas(self) -> tuple[CACertificate, ...]:
        return self._kit.cas if self._kit is not None else ()

    # ---- the session -------------------------------------------------------------------------

    def secagg_public(self) -> bytes | None:
        """The masking key this process announces at its join (None without secure
        aggregation)."""
        key = self._secagg_key
        return None if key is None else x25519_public_bytes(key)

    def open_session(self, session_id: str) -> None:
        """The coordinator welcomed us in ``session_id``: masks are bound to it."""
        if self._secagg_cfg is None or self._secagg_key is None:
            return
        self.secagg = SecAggSession(
            site_id=self.site_id,
            session_id=session_id,
            config=self._secagg_cfg,
            session_key=self._secagg_key,
            trust=self._trust,
        )

    def trained(self, num_fragments: int, tokens: int) -> None:
        """A slot trained ``tokens`` tokens, which count for every fragment's next update."""
        for f in range(num_fragments):
            self._tokens[f] = self._tokens.get(f, 0) + tokens

    def tokens_pending(self, fragment: int) -> int:
        """Tokens trained since ``fragment`` was last sent."""
        return self._tokens.get(fragment, 0)

    # ---- sending -------------------------------------------------------------------------------

    def send_update(
        self, rs: RoundStart, stats: TrainStats, delta: Params, *, global_version: int
    ) -> bool:
        """Send round ``rs``'s update of pseudo-gradient ``delta`` (finite), trained on top of
        ``global_version``. False when nothing went out: the progress stays local and goes out
        with the next update."""
        if self._secagg_cfg is not None:
            # Masked sums are plain means: every site's weight is the same (and hidden).
            if not self._send_masked(rs, delta, stats, global_version):
                return False
            self._tokens.pop(rs.fragment, None)
            return True
        delta = self._privatize(rs, delta)
        payload = self._compress(rs, delta)
        if payload is None:
            return False
        weight = float(self._tokens.pop(rs.fragment, 0) or stats.tokens)
        self._send(rs, stats, payload, weight, global_version)
        self._metrics.ef_norm(self.feedback.residual_norm())
        log.info(
            "[site=%s round=%d] sent fragment %d/%d (%s): %d steps loss=%.4f %.1fs compute",
            self.site_id,
            rs.round_id,
            rs.fragment,
            rs.num_fragments,
            rs.codec,
            stats.steps,
            stats.loss_mean,
            stats.compute_seconds,
        )
        return True

    def _privatize(self, rs: RoundStart, delta: Params) -> Params:
        """Differential privacy (when on): clip and noise the pseudo-gradient before anything
        leaves the site; the noise is fresh each round, and the accountant tracks the (epsilon,
        delta) spent."""
        if self._privacy is None or self.accountant is None:
            return delta
        delta, norm = privatize(delta, self._privacy, self._noise)
        self.accountant.step()
        self._metrics.dp_epsilon(self.accountant.epsilon())
        log.info(
            "[site=%s round=%d] DP: norm %.3g clipped to %.3g, epsilon spent %.3f (delta %g)",
            self.site_id,
            rs.round_id,
            norm,
            self._privacy.clip_norm,
            self.accountant.epsilon(),
            self._privacy.delta,
        )
        return delta

    def _compress(self, rs: RoundStart, delta: Params) -> tuple[EncodedTensor, ...] | None:
        """``delta`` encoded with the round's codec and the error feedback; None when it cannot
        be: then every residual owes what it owed before, those of the tensors encoded before
        the failing one included."""
        residuals = self.feedback.state_dict()
        try:
            codec = get_codec(rs.codec)
            return tuple(self.feedback.compress(k, v, codec) for k, v in delta.items())
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
        self.feedback.load_state_dict(residuals)
        return None

    def _send(
        self,
        rs: RoundStart,
        stats: TrainStats,
        payload: tuple[EncodedTensor, ...],
        weight: float,
        global_version: int,
    ) -> None:
        """Send one round's update with this site's measurements; keep it until its result."""
        rtt_s, goodput_bps = self._channel.link_estimate()
        msg = Update(
            site_id=self.site_id,
            round_id=rs.round_id,
            global_version=global_version,
            fragment=rs.fragment,
            weight=weight,
            train_loss=stats.loss_mean,
            compute_seconds=stats.compute_seconds,
            step_seconds=stats.compute_seconds / max(1, stats.steps),
            link_rtt_s=rtt_s,
            link_goodput_bps=goodput_bps,
            payload=payload,
        )
        self._channel.send(msg)  # held by the channel until the coordinator acknowledges it

    # ---- secure aggregation ------------------------------------------------------------------

    def _send_masked(
        self, rs: RoundStart, delta: Params, stats: TrainStats, global_version: int
    ) -> bool:
        """Clip to the fixed-point range, mask, send; keep for a re-run. False when the round's
        masking plan is unusable and nothing was sent."""
        assert self._secagg_cfg is not None
        bound = self._secagg_cfg.clip_bound
        if self._privacy is not None and self.accountant is not None:
            delta, _norm = privatize(delta, self._privacy, self._noise)
            self.accountant.step()
            self._metrics.dp_epsilon(self.accountant.epsilon())
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
        self._unmasked = {rs.round_id: (delta, stats)}
        if self._mask_and_send(rs, delta, stats, global_version):
            return True
        self._unmasked.clear()  # a re-run must not send what stays local
        return False

    def remask(self, rs: RoundStart, *, global_version: int) -> bool:
        """A re-run of round ``rs`` after a dropout: mask the kept update again, for the
        survivors. False when nothing went out."""
        kept = self._unmasked.get(rs.round_id)
        if kept is None:
            log.warning(
                "[site=%s round=%d] re-run for an update I do not hold", self.site_id, rs.round_id
            )
            return False
        log.info(
            "[site=%s round=%d] secure aggregation re-run, attempt %d",
            self.site_id,
            rs.round_id,
            rs.secagg["attempt"],
        )
        delta, stats = kept
        return self._mask_and_send(rs, delta, stats, global_version)

    def _mask_and_send(
        self, rs: RoundStart, delta: Params, stats: TrainStats, global_version: int
    ) -> bool:
        assert self.secagg is not None, "open_session() first"
        try:
            attempt, peers = plan_from_message(rs.secagg)
            masked = self.secagg.mask(
                delta, round_id=rs.round_id, participants=peers, attempt=attempt
            )
        except ValueError as exc:
            # Nothing goes out: to the coordinator this site dropped out of the attempt, which
            # re-runs with the survivors; the update stays local for the next round.
            self._metrics.rejected("secagg_peer" if isinstance(exc, PeerRefused) else "secagg_plan")
            log.error("[site=%s round=%d] not masking: %s", self.site_id, rs.round_id, exc)
            return False
        if rs.round_id == self._fault_exit_round and attempt == 0:
            log.error(
                "[site=%s round=%d] fault drill: exiting after masking", self.site_id, rs.round_id
            )
            logging.shutdown()
            os._exit(EXIT_FAULT_DRILL)
        self._send(rs, stats, masked_payload(masked, attempt), float(stats.tokens), global_version)
        log.info(
            "[site=%s round=%d] sent masked fragment %d (attempt %d)",
            self.site_id,
            rs.round_id,
            rs.fragment,
            attempt,
        )
        return True

    def status(self) -> dict[str, Any]:
        return {"dp_epsilon": self.accountant.epsilon() if self.accountant else None}


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
