"""The site agent daemon: one per data center, the site's only WAN endpoint.

It owns the site's side of each round: join, receive the global model, train H inner steps,
send the pseudo-gradient Δ = θ_global − θ_local, apply the global delta the coordinator
broadcasts, check the state hash, and checkpoint. Training runs on the main thread; the
coordinator link (``comm.transport.dealer.SiteLink``) runs on its own thread, so heartbeats continue while
the site computes. The trainer is a seam (:class:`SiteTrainer`): a single process here, a
pipeline of stages x replicas under torchrun where the site spans several devices.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from comm.codecs.feedback import ErrorFeedback
from comm.codecs.registry import get_codec
from comm.durable import atomic_write
from comm.ops.observe import ObserveServer
from comm.security.kits import SiteKit, load_site_kit
from comm.security.masking import x25519_from_curve_secret
from comm.security.secagg import SecAggSession
from comm.transport.dealer import SiteLink
from comm.wire.schema import (
    ERROR_MEANINGS,
    Error,
    ErrorCode,
    Global,
    Heartbeat,
    InitParams,
    Leave,
    Message,
    RoundCancel,
    RoundStart,
    Shutdown,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors
from site_agent import catchup, driver, sync
from site_agent.authwatch import AuthWatch
from site_agent.config import SiteConfig
from site_agent.exits import EXIT_AUTH_REFUSED, EXIT_FATAL, EXIT_OK
from site_agent.launch import SiteTrainer, read_endpoint_file
from site_agent.metrics import SiteMetrics
from site_agent.privacy import PrivacyAccountant, new_noise_generator
from site_agent.rounds import SiteRounds
from site_agent.sync import SentFragment
from site_agent.trainer import TrainStats

log = logging.getLogger("crossdc.site")


class SiteAgent:
    """One site. ``start``, ``run`` (returns an exit code), ``close``.

    The loop trains one slot of inner steps per planned round, then sends the pseudo-gradient of
    the round's fragment. With ``overlap`` it starts the next slot at once and merges the global
    fragment whenever it lands (between inner steps), keeping the local progress made since the
    send: θ_local[f] ← θ_local[f] + (θ_global_new[f] − θ_local_at_send[f]). It blocks on the WAN
    only when the plan says so: no overlap, or a fragment's previous result not yet applied.
    """

    def __init__(
        self,
        cfg: SiteConfig,
        *,
        trainer: SiteTrainer,
        metrics: SiteMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.auth = AuthWatch()
        self._echoes_seen, self._last_echo_at = 0, clock()
        self._disconnects_seen = 0
        self._unanswered: dict[int, Update] = {}  # sent, no result yet: resent after a gap
        self.trainer = trainer
        self.metrics = metrics or SiteMetrics(cfg.site_id)
        # What the coordinator compares at the join: the job's factory and its federated state.
        self.state_spec = trainer.state_spec()
        self.fingerprint = trainer.fingerprint(cfg.job.factory)
        self.site_id = cfg.site_id
        self.global_params: dict[str, np.ndarray] = {
            k: v.copy() for k, v in trainer.parameters_numpy().items()
        }
        self.rounds = SiteRounds()
        self.session_id = ""
        self.link: SiteLink | None = None
        self.http: ObserveServer | None = None
        self.feedback = ErrorFeedback()
        self.kit: SiteKit | None = (
            load_site_kit(cfg.security.kit_dir, site_id=cfg.site_id)
            if cfg.security.kit_dir
            else None
        )
        if self.kit is not None:
            self.metrics.certificate_expiry(self.kit.certificate.not_after)
        # Built (its TLS and password files read) here, so a bad one fails before the start.
        if cfg.metrics_port:
            self.http = ObserveServer(
                registry=self.metrics.registry,
                status=self.status,
                host=cfg.metrics_host,
                port=cfg.metrics_port,
                security=cfg.http,
                on_refused=self.metrics.refused,
            )
        self.accountant = PrivacyAccountant(cfg.privacy) if cfg.privacy is not None else None
        # Secure aggregation: one X25519 key per process, announced at join; the masking session
        # is bound to the coordinator's session (every site derives pair keys from the same id).
        self._secagg_key = X25519PrivateKey.generate() if cfg.secure_aggregation else None
        self.secagg: SecAggSession | None = None
        # Secure aggregation: the unmasked update of each round, kept for a re-run.
        self._unmasked: dict[int, tuple[int, dict[str, np.ndarray], float, TrainStats]] = {}
        self._noise = new_noise_generator()
        # Per fragment: our last send, and the tokens trained since that fragment was last sent.
        self._sent: dict[int, SentFragment] = {}
        self._steps_done = 0  # inner steps taken so far
        self._tokens: dict[int, int] = {}
        self._layout: tuple[int, list[list[str]]] = (0, [])
        self._last_join = 0.0
        self._sync_asked = -1  # the newest version the whole model was asked for (catch-up)
        self._first_round_at: float | None = None
        self._compute_s = 0.0
        self._stall_s = 0.0
        self._eval_s = 0.0
        self._bytes_seen = (0, 0)
        self._last_val: float | None = None
        self._last_metrics: dict[str, float] = {}
        self._rounds_sent = 0
        self._last_send_at: float | None = None
        self._steps_at_last_send = 0
        # Inner steps trained while none of this site's syncs was in flight, and their wall
        # seconds: the site's rate with no sync running, measured in the same run.
        self._free_steps = 0
        self._free_s = 0.0
        self.stop_reason: str | None = None  # set by request_stop

    @property
    def global_version(self) -> int:
        """The global version this site holds (the round state machine's)."""
        return self.rounds.global_version

    @global_version.setter
    def global_version(self, version: int) -> None:
        self.rounds.global_applied(version)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.cfg.state_path / "checkpoint.pt"

    def start(self) -> None:
        self.cfg.state_path.mkdir(parents=True, exist_ok=True)
        self._load_checkpoint()
        if self.global_version < 0:
            # A fresh site holds θ0 as the federation's seed and model config build it; it says
            # so at its join with the state hash, and downloads nothing when the hash matches.
            self.global_version = 0
        endpoint = self.cfg.coordinator or read_endpoint_file(
            self.cfg.coordinator_endpoint_file, timeout_s=120
        )
        channel_cfg = self.cfg.channel
        if self.kit is not None:
            channel_cfg = dc_replace(channel_cfg, curve=self.kit.curve)
        else:
            log.warning(
                "[site=%s] INSECURE MODE: no encryption, no authentication. "
                "For loopback experiments only.",
                self.site_id,
            )
        self.link = SiteLink(
            channel_cfg,
            identity=self.site_id,
            endpoint=endpoint,
            heartbeat=lambda: Heartbeat(
                site_id=self.site_id, global_version=self.global_version, sent_at=time.monotonic()
            ),
            on_reject=lambda _p, code, _d: self.metrics.rejected(code.name.lower()),
        )
        self.link.start()
        if self.http is not None:
            self.http.start()
        log.info(
            "[site=%s] connecting to %s; v%d; %d parameters",
            self.site_id,
            endpoint,
            self.global_version,
            sum(v.size for v in self.global_params.values()),
        )

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.http is not None:
            self.http.close()
            self.http = None

    # ---- messages ----------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        assert self.link is not None
        self.link.send(msg)

    def _dispatch(self, msg: Message) -> int | None:
        if not isinstance(msg, Error):
            self.auth.accepted()
        if isinstance(msg, Welcome):
            self.session_id = msg.session_id
            if self.cfg.secure_aggregation is not None and self._secagg_key is not None:
                self.secagg = SecAggSession(
                    site_id=self.site_id,
                    session_id=msg.session_id,
                    config=self.cfg.secure_aggregation,
                    session_key=self._secagg_key,
                    static_key=x25519_from_curve_secret(self.kit.curve.secret)
                    if self.kit
                    else None,
                )
            log.info(
                "[site=%s] welcomed by session %s (v%d)",
                self.site_id,
                msg.session_id,
                msg.global_version,
            )
            if msg.need_init:
                self._send(
                    InitParams(
                        site_id=self.site_id,
                        model_fingerprint=self.fingerprint,
                        payload=encode_tensors(self.global_params, get_codec("fp32")),
                    )
                )
                self.global_version = 0
                self._evaluate()  # θ_0's loss, measured before any round can wait on it
        elif isinstance(msg, Global):
            self._on_global(msg)
        elif isinstance(msg, RoundStart):
            self._catch_up_to(msg.global_version)
            if msg.secagg.get("attempt", 0) > 0:
                self._remask(msg)  # a re-run after a dropout: no training, mask again
            else:
                self.rounds.round_start(msg)
        elif isinstance(msg, RoundCancel):
            self.rounds.round_cancel(msg.round_ids)
            log.warning(
                "[site=%s] rounds %s cancelled: %s", self.site_id, msg.round_ids, msg.reason
            )
        elif isinstance(msg, Error):
            return self._on_error(msg)
        elif isinstance(msg, Shutdown):
            log.info("[site=%s] shutdown: %s", self.site_id, msg.reason)
            self.rounds.shutdown()
            self.save_checkpoint()
            self._write_site_status()
            return EXIT_OK
        else:
            log.warning("[site=%s] ignoring unexpected %s", self.site_id, type(msg).__name__)
        return None

    def _on_error(self, msg: Error) -> int | None:
        try:
            code = ErrorCode(msg.code)
        except ValueError:
            log.warning("[site=%s] coordinator error %d: %s", self.site_id, msg.code, msg.detail)
            return None
        self.metrics.rejected(f"remote_{code.name.lower()}")
        if code is ErrorCode.NOT_JOINED:
            if time.monotonic() - self._last_join > 1.0:
                log.info("[site=%s] coordinator does not know us: joining again", self.site_id)
                # The rounds planned by a coordinator that forgot us (it restarted, or timed us
                # out) are void, the one being trained included: its result will never come.
                self.rounds.rejoin()
                self._unanswered.clear()  # their rounds are void too: nothing to send again
                self._join()
            return None
        if code is ErrorCode.MODEL_MISMATCH:
            log.error("[site=%s] %s", self.site_id, msg.detail)
            return EXIT_FATAL
        if code is ErrorCode.UNAUTHENTICATED:
            return self._on_refused(msg.detail)
        log.warning(
            "[site=%s] coordinator rejected: %s (%s)",
            self.site_id,
            msg.detail,
            ERROR_MEANINGS[code],
        )
        return None

    def _on_refused(self, detail: str) -> int | None:
        """The coordinator refused our credentials: exit when that is final (revoked, expired,
        or refusals that persisted); otherwise warn once per run of refusals."""
        why = self.auth.refused(detail, self.clock())
        if why is not None:
            log.error(
                "[site=%s] the coordinator refuses this site's credentials (%s): %s; exiting "
                "with status %d (not restarted: renew or re-issue the site's kit)",
                self.site_id,
                why,
                detail,
                EXIT_AUTH_REFUSED,
            )
            return EXIT_AUTH_REFUSED
        if self.auth.refusals == 1:
            log.warning("[site=%s] coordinator refused our credentials: %s", self.site_id, detail)
        return None

    # ---- bound from site_agent.catchup (join, catch-up), .driver (the loop), .sync (updates)

    _load_checkpoint = catchup.load_checkpoint
    save_checkpoint = catchup.save_checkpoint
    _join = catchup.join
    _drain = driver.drain
    _wait = driver.wait
    _fragment_names = catchup.fragment_names
    _signature_ok = catchup.signature_ok
    _on_global = catchup.on_global
    _catch_up_to = catchup.catch_up_to
    _evaluate = catchup.evaluate
    run = driver.run
    _round = driver.play_round
    _train_slot = driver.train_slot
    _send_update = sync.send_update
    _send_update_message = sync.send_update_message
    _send_masked = sync.send_masked
    _remask = sync.remask
    _mask_and_send = sync.mask_and_send
    _resend_unanswered = sync.resend_unanswered

    def _publish_link_metrics(self) -> None:
        if self.link is None:
            return
        if self.link.stats.echoes_received != self._echoes_seen:
            self._echoes_seen = self.link.stats.echoes_received
            self.auth.accepted()  # the coordinator echoes only a member's heartbeats
            now = self.clock()
            # Only a dropped connection (reset, or given up after a silence as long as the
            # heartbeat timeout) can have lost what was in flight; a coordinator slow to echo
            # for a few seconds (busy, or starved of CPU) lost nothing, and resending would only
            # add bytes.
            silent_s = now - self._last_echo_at
            dropped = self.link.stats.disconnects != self._disconnects_seen
            self._disconnects_seen = self.link.stats.disconnects
            if dropped:
                self._resend_unanswered("the connection dropped")
            elif silent_s >= self.cfg.channel.heartbeat_timeout_s:
                self._resend_unanswered(f"{silent_s:.1f}s of silence")
            self._last_echo_at = now
        sent, received = self.link.stats.bytes_sent, self.link.stats.bytes_received
        self.metrics.wire(sent - self._bytes_seen[0], received - self._bytes_seen[1])
        self._bytes_seen = (sent, received)
        # The channel's averages stay 0 until their first sample: not a measurement yet.
        rtt_s, goodput_bps = self.link.stats.rtt_s, self.link.stats.goodput_bps
        self.metrics.link(
            rtt_s=rtt_s,
            goodput_bytes_per_s=goodput_bps / 8.0,
            measured=rtt_s > 0 and goodput_bps > 0,
        )

    def request_stop(self, reason: str) -> None:
        """Leave at the next point between inner steps (safe to call from a signal handler)."""
        self.stop_reason = reason

    def leave(self, reason: str) -> None:
        self._send(Leave(site_id=self.site_id, reason=reason))

    def status(self) -> dict[str, Any]:
        # The training period: the first round's start to the last send.
        end = self._last_send_at if self._last_send_at is not None else self.clock()
        wall = end - self._first_round_at if self._first_round_at is not None else 0.0
        steps = self._steps_at_last_send if self._last_send_at is not None else self._steps_done
        rate = steps / wall if wall > 0 else None
        free_rate = self._free_steps / self._free_s if self._free_s > 0 else None
        return {
            "site_id": self.site_id,
            "session_id": self.session_id,
            "global_version": self.global_version,
            "rounds_sent": self._rounds_sent,
            "inner_steps": self._steps_done,
            "compute_seconds": self._compute_s,
            "stall_seconds": self._stall_s,
            "eval_seconds": self._eval_s,
            "wall_seconds": wall,
            "compute_fraction": self._compute_s / wall if wall else 0.0,
            "steps_per_second": rate,
            "sync_free_steps_per_second": free_rate,
            # Inner steps per second over the training period against the same site's rate
            # while no sync of its was in flight; null until both are measured.
            "compute_utilization": rate / free_rate if rate and free_rate else None,
            "val_loss": self._last_val,
            "val_metrics": dict(self._last_metrics),
            "nonfinite_steps": getattr(self.trainer, "skipped_steps", 0),
            "dp_epsilon": self.accountant.epsilon() if self.accountant else None,
            "link_rtt_s": self.link.stats.rtt_s if self.link else 0.0,
            "link_goodput_bps": self.link.stats.goodput_bps if self.link else 0.0,
            "wire_bytes_sent": self.link.stats.bytes_sent if self.link else 0,
            "wire_bytes_received": self.link.stats.bytes_received if self.link else 0,
        }

    def _write_site_status(self) -> None:
        body = json.dumps(self.status(), sort_keys=True).encode()
        atomic_write(self.cfg.state_path / "status.json", body, mode=0o644)
