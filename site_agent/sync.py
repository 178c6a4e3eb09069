"""Sending a round's update: the pseudo-gradient of its fragment, privatized, compressed with
error feedback or masked for secure aggregation, with this site's measurements.

Functions of a :class:`~site_agent.agent.SiteAgent`, bound onto it as its methods.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from comm.codecs.base import EncodedTensor, NonFiniteError
from comm.codecs.registry import get_codec
from comm.security.masking import Peer
from comm.wire.schema import RoundStart, Update
from site_agent.exits import EXIT_FAULT_DRILL
from site_agent.privacy import privatize
from site_agent.trainer import TrainStats

if TYPE_CHECKING:
    from site_agent.agent import SiteAgent

log = logging.getLogger("crossdc.site")


@dataclass(frozen=True)
class SentFragment:
    """One fragment's last send: its local values (the reference for merging the result) and the
    inner-step count then (the merge delay is counted from it)."""

    local: dict[str, np.ndarray]
    at_step: int


def send_update(self: SiteAgent, rs: RoundStart, stats: TrainStats) -> None:
    names = self._fragment_names(rs.num_fragments)[rs.fragment]
    local = self.trainer.parameters_numpy()
    delta = {k: self.global_params[k] - local[k] for k in names}
    if not np.isfinite(stats.loss_mean) or not all(np.isfinite(v).all() for v in delta.values()):
        # Never send a corrupt update: drop the local progress and start over from global.
        self.metrics.rejected("non_finite_local")
        log.error(
            "[site=%s round=%d] local training diverged (NaN/Inf): resetting",
            self.site_id,
            rs.round_id,
        )
        self.trainer.load_parameters(self.global_params)
        self._sent.clear()
        return
    if self.cfg.secure_aggregation is not None:
        # Masked sums are plain means: every site's weight is the same (and hidden).
        if self._send_masked(rs, delta, stats):
            self._tokens.pop(rs.fragment, None)
            self._sent[rs.fragment] = SentFragment({k: local[k] for k in names}, self._steps_done)
        # else nothing went out: the progress stays local and goes out with the next update
        return
    delta = privatize_update(self, rs, delta)
    # Nothing goes out unless every tensor encodes: then every residual must owe what it owed
    # before, those of the tensors encoded before the failing one included.
    residuals = self.feedback.state_dict()
    try:
        codec = get_codec(rs.codec)
        payload = tuple(self.feedback.compress(k, v, codec) for k, v in delta.items())
    except NonFiniteError as exc:
        self.metrics.rejected("non_finite_local")
        log.error("[site=%s round=%d] not sending: %s", self.site_id, rs.round_id, exc)
        self.feedback.load_state_dict(residuals)
        return
    except ValueError as exc:
        self.feedback.load_state_dict(residuals)
        log.error(
            "[site=%s round=%d] cannot encode with %r: %s",
            self.site_id,
            rs.round_id,
            rs.codec,
            exc,
        )
        return
    assert self.link is not None
    self._sent[rs.fragment] = SentFragment({k: local[k] for k in names}, self._steps_done)
    weight = float(self._tokens.pop(rs.fragment, 0) or stats.tokens)
    self._send_update_message(rs, stats, payload, weight)
    self.metrics.ef_norm(self.feedback.residual_norm())
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


def privatize_update(
    self: SiteAgent, rs: RoundStart, delta: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Differential privacy (when on): clip and noise the pseudo-gradient before anything leaves
    the site; the noise is fresh each round, and the accountant tracks the (epsilon, delta)
    spent."""
    if self.cfg.privacy is None or self.accountant is None:
        return delta
    delta, norm = privatize(delta, self.cfg.privacy, self._noise)
    self.accountant.step()
    self.metrics.dp_epsilon(self.accountant.epsilon())
    log.info(
        "[site=%s round=%d] DP: norm %.3g clipped to %.3g, epsilon spent %.3f (delta %g)",
        self.site_id,
        rs.round_id,
        norm,
        self.cfg.privacy.clip_norm,
        self.accountant.epsilon(),
        self.cfg.privacy.delta,
    )
    return delta


def send_update_message(
    self: SiteAgent,
    rs: RoundStart,
    stats: TrainStats,
    payload: tuple[EncodedTensor, ...],
    weight: float,
) -> None:
    """Send one round's update with this site's measurements, and account for it."""
    assert self.link is not None
    msg = Update(
        site_id=self.site_id,
        round_id=rs.round_id,
        global_version=self.global_version,
        fragment=rs.fragment,
        weight=weight,
        train_loss=stats.loss_mean,
        compute_seconds=stats.compute_seconds,
        step_seconds=stats.compute_seconds / max(1, stats.steps),
        link_rtt_s=self.link.stats.rtt_s,
        link_goodput_bps=self.link.stats.goodput_bps,
        payload=payload,
    )
    self._send(msg)
    # Kept until the round's result arrives (bounded: at most a few rounds are in flight).
    self._unanswered[rs.round_id] = msg
    while len(self._unanswered) > 4:
        del self._unanswered[min(self._unanswered)]
    self._rounds_sent += 1
    self.metrics.round_sent()
    self._last_send_at = self.clock()
    self._steps_at_last_send = self._steps_done
    utilization = self.status()["compute_utilization"]
    if utilization is not None:
        self.metrics.utilization(utilization)
    self._write_site_status()


def send_masked(
    self: SiteAgent, rs: RoundStart, delta: dict[str, np.ndarray], stats: TrainStats
) -> bool:
    """Secure aggregation: clip to the fixed-point range, mask, send; keep for a re-run.
    False when the round's masking plan is unusable and nothing was sent."""
    assert self.cfg.secure_aggregation is not None
    bound = self.cfg.secure_aggregation.clip_bound
    if self.cfg.privacy is not None and self.accountant is not None:
        delta, _norm = privatize(delta, self.cfg.privacy, self._noise)
        self.accountant.step()
        self.metrics.dp_epsilon(self.accountant.epsilon())
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
    self._unmasked = {rs.round_id: (rs.fragment, delta, 1.0, stats)}
    if self._mask_and_send(rs, delta, stats):
        return True
    self._unmasked.clear()  # a re-run must not send what stays local
    return False


def remask(self: SiteAgent, rs: RoundStart) -> None:
    kept = self._unmasked.get(rs.round_id)
    if kept is None:
        log.warning(
            "[site=%s round=%d] re-run for an update I do not hold", self.site_id, rs.round_id
        )
        return
    log.info(
        "[site=%s round=%d] secure aggregation re-run, attempt %d",
        self.site_id,
        rs.round_id,
        rs.secagg["attempt"],
    )
    self._mask_and_send(rs, kept[1], kept[3])


def mask_and_send(
    self: SiteAgent, rs: RoundStart, delta: dict[str, np.ndarray], stats: TrainStats
) -> bool:
    assert self.secagg is not None and self.link is not None
    attempt = int(rs.secagg.get("attempt", 0))
    try:
        peers = {
            site: Peer(
                session_public=bytes.fromhex(keys[0]),
                static_public=keys[1].encode() if keys[1] else None,
            )
            for site, keys in rs.secagg["peers"].items()
        }
        masked = self.secagg.mask(delta, round_id=rs.round_id, participants=peers, attempt=attempt)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        self.metrics.rejected("secagg_plan")
        log.error("[site=%s round=%d] not masking: %s", self.site_id, rs.round_id, exc)
        return False
    if rs.round_id == self.cfg.fault_exit_before_send_round and attempt == 0:
        log.error(
            "[site=%s round=%d] fault drill: exiting after masking", self.site_id, rs.round_id
        )
        logging.shutdown()
        os._exit(EXIT_FAULT_DRILL)
    payload = tuple(
        EncodedTensor(
            name=name,
            shape=tuple(arr.shape),
            codec="secagg",
            meta={"attempt": attempt},
            buffers=(arr.reshape(-1),),
        )
        for name, arr in masked.items()
    )
    self._send_update_message(rs, stats, payload, float(stats.tokens))
    log.info(
        "[site=%s round=%d] sent masked fragment %d (attempt %d)",
        self.site_id,
        rs.round_id,
        rs.fragment,
        attempt,
    )
    return True


def resend_unanswered(self: SiteAgent, why: str) -> None:
    """The link dropped (reset, or silent for the heartbeat timeout) and is back: what was in flight
    may be lost, and a lost update would hold its round until the deadline. Send again the
    updates whose round has no result yet (a copy that did arrive is refused as a
    duplicate, harmlessly)."""
    done = self.global_version
    self._unanswered = {
        r: m for r, m in self._unanswered.items() if r > done and r not in self.rounds.cancelled
    }
    for round_id, msg in sorted(self._unanswered.items()):
        log.warning(
            "[site=%s round=%d] link back after %s: sending the update again",
            self.site_id,
            round_id,
            why,
        )
        self._send(msg)
