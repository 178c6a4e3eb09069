"""Sending a round's update: the pseudo-gradient of its fragment, privatized (differential
privacy), then put in the form the site sends updates in (``site_agent.payload``), with the
site's link measurements; and sending again the updates a dropped link may have lost.

:class:`UpdateSender` owns everything that shapes what leaves the site: the privacy accountant
and its noise, the payload form (which holds the error-feedback residuals or what a repeat of a
round needs), the tokens trained per fragment since its last send (the update's weight), and the
updates still awaiting their round's result.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from comm.codecs.feedback import ErrorFeedback
from comm.security.rolekits import SiteKit
from comm.wire.schema import Message, RoundStart, Update
from site_agent.config import SiteConfig
from site_agent.metrics import SiteMetrics
from site_agent.payload import Compressed, Payload, PayloadForm, payload_form
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
        form: PayloadForm | None = None,
        privacy: DPConfig | None = None,
    ) -> None:
        """``form``: the payload form (default: :class:`Compressed` through ``feedback``)."""
        self.site_id = site_id
        self._channel = channel
        self._metrics = metrics
        self.feedback = feedback
        self._form = form or Compressed(site_id=site_id, feedback=feedback, metrics=metrics)
        self._privacy = privacy
        self.accountant = PrivacyAccountant(privacy) if privacy is not None else None
        self._noise = new_noise_generator()
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
        return cls(
            site_id=cfg.site_id,
            channel=channel,
            metrics=metrics,
            feedback=feedback,
            form=payload_form(cfg, feedback=feedback, metrics=metrics, kit=kit),
            privacy=cfg.privacy,
        )

    def kit_loaded(self, kit: SiteKit) -> None:
        """The site's kit, at start or reloaded (a CA rollover)."""
        self._form.kit_loaded(kit)

    # ---- the session -------------------------------------------------------------------------

    def join_capabilities(self) -> dict[str, str]:
        """What the payload form announces at the site's join."""
        return self._form.join_capabilities()

    def open_session(self, session_id: str) -> None:
        """The coordinator welcomed us in ``session_id``."""
        self._form.session_opened(session_id)

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
        delta = self._privatize(rs, delta)
        payload = self._form.make(rs, delta, stats, self._tokens.get(rs.fragment, 0))
        if payload is None:
            return False
        self._tokens.pop(rs.fragment, None)
        self._send(rs, payload, global_version)
        return True

    def send_payload(self, rs: RoundStart, payload: Payload, *, global_version: int) -> None:
        """Send round ``rs``'s update made elsewhere (a sharded site's ranks encode their own
        slices, ``site_agent.shardreplica``): no privacy step, the site has none."""
        self._tokens.pop(rs.fragment, None)
        self._send(rs, payload, global_version)

    def send_again(self, rs: RoundStart, *, global_version: int) -> bool:
        """A repeat of round ``rs`` (``rs.attempt`` > 0), for an update already made: no
        training, the payload form makes it again. False when nothing went out."""
        payload = self._form.make_again(rs)
        if payload is None:
            return False
        self._send(rs, payload, global_version)
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

    def _send(self, rs: RoundStart, payload: Payload, global_version: int) -> None:
        """Send one round's update with this site's measurements; keep it until its result."""
        rtt_s, goodput_bps = self._channel.link_estimate()
        stats = payload.stats
        msg = Update(
            site_id=self.site_id,
            round_id=rs.round_id,
            global_version=global_version,
            fragment=rs.fragment,
            weight=payload.weight,
            train_loss=stats.loss_mean,
            compute_seconds=stats.compute_seconds,
            step_seconds=stats.compute_seconds / max(1, stats.steps),
            link_rtt_s=rtt_s,
            link_goodput_bps=goodput_bps,
            payload=payload.tensors,
        )
        self._channel.send(msg)  # held by the channel until the coordinator acknowledges it
        log.info(
            "[site=%s round=%d] sent fragment %d/%d (%s): %d steps loss=%.4f %.1fs compute",
            self.site_id,
            rs.round_id,
            rs.fragment,
            rs.num_fragments,
            payload.label,
            stats.steps,
            stats.loss_mean,
            stats.compute_seconds,
        )

    def status(self) -> dict[str, Any]:
        return {"dp_epsilon": self.accountant.epsilon() if self.accountant else None}
