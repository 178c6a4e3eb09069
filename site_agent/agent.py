"""The site agent daemon: one per data center, the site's only WAN endpoint.

:class:`SiteAgent` is the composition root: it assembles the site's components, runs the loop
(train a slot of inner steps per planned round, send the pseudo-gradient, apply the results that
land between steps) and routes each message and each action of the round lifecycle
(``site_agent.rounds``) to the component that acts on it. The components own their state: the
``session`` (link, join, what the link tells), the ``replica`` (the global model held, merging
results, checkpoints), the ``sender`` (what leaves the site), the ``evaluator``, the
``throughput`` counts, and the ``status_doc``. The link runs on its own thread, so heartbeats
continue while the site computes. The trainer is a seam (``site_agent.trainer.SiteTrainer``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import astuple
from dataclasses import replace as dc_replace
from typing import Any

from comm.codecs.feedback import ErrorFeedback
from comm.security.rolekits import SiteKit, SiteKitWatcher, load_site_kit
from comm.wire.schema import (
    Error,
    Global,
    Message,
    RoundCancel,
    RoundStart,
    Shutdown,
    SyncRequest,
    Welcome,
)
from site_agent.config import SiteConfig
from site_agent.evaluation import Evaluator
from site_agent.exits import EXIT_AUTH_REFUSED, EXIT_FATAL, EXIT_OK
from site_agent.metrics import SiteMetrics
from site_agent.replica import GlobalOutcome, Replica
from site_agent.rounds import Drop, Send, SiteRounds, Stop, Train, Wait
from site_agent.sender import UpdateSender
from site_agent.session import CoordinatorLink, ErrorResponse, Session
from site_agent.shardreplica import ShardedReplica
from site_agent.status import SiteStatus, status_server
from site_agent.throughput import SlotTally, Throughput
from site_agent.trainer import NonFiniteLossError, SiteTrainer, TrainStats

log = logging.getLogger("crossdc.site")


class SiteAgent:
    """One site. ``start``, ``run`` (returns an exit code from ``site_agent.exits``), ``close``.

    The loop trains one slot of inner steps per planned round, then sends the pseudo-gradient of
    the round's fragment. With ``overlap`` it starts the next slot at once and merges the global
    fragment whenever it lands (between inner steps), keeping the local progress made since the
    send. It blocks on the WAN only when the plan says so: no overlap, or a fragment's previous
    result not yet applied. ``link`` replaces the coordinator link ``start`` would open.
    """

    def __init__(
        self,
        cfg: SiteConfig,
        *,
        trainer: SiteTrainer,
        metrics: SiteMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        link: CoordinatorLink | None = None,
    ) -> None:
        self.cfg, self.site_id, self.clock = cfg, cfg.site_id, clock
        self.trainer = trainer
        self.metrics = metrics = metrics or SiteMetrics(cfg.site_id)
        kit = _load_kit(cfg, metrics)
        self.kit_watch = _kit_watcher(cfg, kit, metrics)
        self.rounds = SiteRounds()
        # The uplink's residuals: the sender's, checkpointed.
        feedback = ErrorFeedback(decay=cfg.error_feedback_decay)
        # A trainer whose model is sharded over its ranks syncs shard by shard: the replica
        # holds no parameters, the ranks do (site_agent.shardsync).
        sync = trainer.sharded_sync
        self.replica: Replica | ShardedReplica
        if sync is not None:
            self.replica = ShardedReplica.for_site(
                cfg, sync=sync, rounds=self.rounds, metrics=metrics, kit=kit
            )
        else:
            self.replica = Replica.for_site(
                cfg,
                trainer=trainer,
                rounds=self.rounds,
                feedback=feedback,
                metrics=metrics,
                kit=kit,
            )
        replica = self.replica
        self.session = Session.for_site(
            cfg,
            trainer=trainer,
            metrics=metrics,
            kit=kit,
            clock=clock,
            heartbeat_version=lambda: replica.global_version,
            link=link,
        )
        self.sender = UpdateSender.for_site(
            cfg, channel=self.session, metrics=metrics, feedback=feedback, kit=kit
        )
        self.evaluator = Evaluator(
            site_id=cfg.site_id,
            trainer=trainer,
            metrics=metrics,
            send=self.session.send,
            clock=clock,
        )
        self.throughput = Throughput(metrics=metrics, clock=clock)
        self.status_doc = SiteStatus(
            site_id=cfg.site_id,
            path=cfg.state_path / "status.json",
            sections=[
                self.session.status,
                self.replica.status,
                self.throughput.status,
                self.evaluator.status,
                self.sender.status,
                self._trainer_status,
                *([self.kit_watch.status] if self.kit_watch is not None else []),
            ],
        )
        self.http = status_server(cfg, metrics, self.status_doc)
        self.stop_reason: str | None = None  # set by request_stop

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.cfg.state_path.mkdir(parents=True, exist_ok=True)
        self.replica.load_checkpoint()
        if self.replica.global_version < 0:
            # A fresh site holds θ0 as the federation's seed and model config build it; it says
            # so at its join with the state hash, and downloads nothing when the hash matches.
            self.replica.adopt(0)
        endpoint = self.session.start()
        if self.http is not None:
            self.http.start()
        log.info(
            "[site=%s] connecting to %s; v%d; %d parameters",
            self.site_id,
            endpoint,
            self.replica.global_version,
            self.replica.num_parameters(),
        )

    def close(self) -> None:
        self.session.close()
        if self.http is not None:
            self.http.close()
            self.http = None

    def request_stop(self, reason: str) -> None:
        """Leave at the next point between inner steps (safe to call from a signal handler)."""
        self.stop_reason = reason

    def leave(self, reason: str) -> None:
        self.session.leave(reason)

    def save_checkpoint(self) -> None:
        self.replica.save_checkpoint()

    def status(self) -> dict[str, Any]:
        return self.status_doc.snapshot()

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        """Serve rounds until the coordinator says Shutdown; return the process exit code."""
        self._join()
        while True:
            code = self._drain()
            if code is not None:
                return code
            action = self.rounds.next_action()
            if isinstance(action, Stop):
                return EXIT_OK
            if isinstance(action, Drop):
                # A plan that can no longer be met on time (cancelled, or its round closed
                # without us). Progress is not lost: it goes out with the next update.
                log.debug("[site=%s round=%d] dropped: %s", self.site_id, *astuple(action))
            elif isinstance(action, Wait):
                code = self._wait(0.5)
            else:
                assert isinstance(action, Train)
                try:
                    code = self._play_round(action.plan)
                except NonFiniteLossError as exc:
                    # Nothing of the diverged training is sent; the checkpoint keeps the last
                    # global model, so a restart resumes from it.
                    log.error("[site=%s] %s", self.site_id, exc)
                    self.leave(f"training diverged at inner step {exc.step}")
                    self.status_doc.write()
                    return EXIT_FATAL
            if code is not None:
                return code

    def _play_round(self, rs: RoundStart) -> int | None:
        self.throughput.round_started()
        if rs.evaluate and self.replica.global_version == rs.global_version:
            self._evaluate()
        stats, code = self._train_slot(rs.num_inner_steps)
        if code is not None:
            return code
        self.sender.trained(rs.num_fragments, stats.tokens)
        # The plan: this fragment's previous result must be applied before we send on top of it.
        while isinstance(action := self.rounds.slot_done(), Wait):
            code = self._wait(0.5)
            if code is not None:
                return code
        if isinstance(action, Send):
            self._send_update(rs, stats)
        # else dropped (cancelled): the progress stays local and goes out with the next update
        return None

    def _train_slot(self, num_steps: int) -> tuple[TrainStats, int | None]:
        """Train ``num_steps`` inner steps, handling the messages that land in between."""
        tally = SlotTally()
        while tally.steps < num_steps:
            n = min(self.cfg.steps_per_poll, num_steps - tally.steps)
            # Nothing of ours on the wire or waiting for its result; the run's first call is
            # warm-up (allocations, first kernels), no measure of the steady rate.
            sync_free = not self.replica.in_flight and self.throughput.steps_done > 0
            t0 = self.clock()
            s = self.trainer.train_steps(n)
            if self.cfg.fault_slow_step_s:
                # A deliberately slow accelerator: its extra time counts as compute.
                extra_s = self.cfg.fault_slow_step_s * s.steps
                time.sleep(extra_s)
                s = dc_replace(s, compute_seconds=s.compute_seconds + extra_s)
            wall_s = self.clock() - t0 if sync_free else 0.0
            self.throughput.stepped(s, wall_s=wall_s, sync_free=sync_free)
            tally.add(s)
            code = self._drain()
            if code is not None:
                return tally.stats(), code
        stats = tally.stats()
        self.throughput.slot_trained(stats)
        return stats, None

    def _send_update(self, rs: RoundStart, stats: TrainStats) -> None:
        if isinstance(self.replica, ShardedReplica):
            payload = self.replica.take_update(
                rs,
                stats,
                tokens=self.sender.tokens_pending(rs.fragment),
                at_step=self.throughput.steps_done,
            )
            if payload is not None:
                gv = self.replica.global_version
                self.sender.send_payload(rs, payload, global_version=gv)
                self._update_sent()
            return
        taken = self.replica.take_pseudo_gradient(rs, stats)
        if taken is None:
            return  # it diverged: the replica starts over from the global model
        delta, local = taken
        at_step = self.throughput.steps_done
        if self.sender.send_update(rs, stats, delta, global_version=self.replica.global_version):
            self.replica.sent(rs.fragment, local, at_step)
            self._update_sent()
        # else nothing went out: the progress stays local and goes out with the next update

    def _update_sent(self) -> None:
        self.throughput.update_sent()
        self.status_doc.write()

    def _evaluate(self) -> None:
        if isinstance(self.replica, ShardedReplica):
            self.evaluator.evaluate_with(self.replica.validate_global, self.replica.global_version)
            return
        self.evaluator.evaluate(self.replica.global_params, self.replica.global_version)

    def _trainer_status(self) -> dict[str, Any]:
        return {"nonfinite_steps": getattr(self.trainer, "skipped_steps", 0)}

    # ---- messages ----------------------------------------------------------------------------

    def _join(self) -> None:
        self.session.join(
            global_version=self.replica.global_version,
            state_hash=self.replica.state_hash(),
            announce=self.sender.join_capabilities(),
        )

    def _stop_if_requested(self) -> int | None:
        """A stop asked for from outside (a signal to a pipelined site's leader): leave the
        federation between two inner steps, so the other ranks are never left inside a step."""
        if self.stop_reason is None:
            return None
        log.info("[site=%s] stopping: %s", self.site_id, self.stop_reason)
        self.leave(self.stop_reason)
        self.save_checkpoint()
        self.status_doc.write()
        return EXIT_OK

    def _drain(self) -> int | None:
        """Handle every queued message without waiting; an exit code ends the run."""
        if (code := self._stop_if_requested()) is not None:
            return code
        while (msg := self.session.recv(0.0)) is not None:
            code = self._dispatch(msg)
            if code is not None:
                return code
        self._check_link()
        return None

    def _wait(self, timeout_s: float) -> int | None:
        """Block for the next message (time counted as stalled on sync once rounds run)."""
        if (code := self._stop_if_requested()) is not None:
            return code
        t0 = self.clock()
        msg = self.session.recv(timeout_s)
        self.throughput.stalled(self.clock() - t0)
        self._check_link()
        return None if msg is None else self._dispatch(msg)

    def _check_link(self) -> None:
        if self.kit_watch is not None and (kit := self.kit_watch.poll()) is not None:
            self.metrics.certificate_expiry(kit.certificate.not_after)
            self.sender.kit_loaded(kit)
            self.status_doc.write()
        lost = self.session.check_link()
        if lost is not None:
            # What was in flight may be lost: the channel sends again whatever the coordinator
            # has not acknowledged (comm.transport.reliable).
            log.info("[site=%s] link back after %s", self.cfg.site_id, lost)

    def _dispatch(self, msg: Message) -> int | None:
        if not isinstance(msg, Error):
            self.session.accepted()
        if isinstance(msg, Welcome):
            self._on_welcome(msg)
        elif isinstance(msg, Global):
            outcome = self.replica.apply_global(msg, at_step=self.throughput.steps_done)
            if outcome is GlobalOutcome.ASK_FOR_MODEL:
                self._ask_for_model()
            elif outcome is GlobalOutcome.APPLIED and msg.evaluate:
                self._evaluate()
        elif isinstance(msg, RoundStart):
            if self.replica.catch_up_needed(msg.global_version):
                self._ask_for_model()
            if msg.attempt > 0:
                # A repeat of a round already trained (after a dropout): no training.
                if self.sender.send_again(msg, global_version=self.replica.global_version):
                    self._update_sent()
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
            # Every coordinator process stops serving this site now: with several shards, the
            # others learn here that the federation ended (only shard 0 says Shutdown).
            self.leave(f"shutdown: {msg.reason}")
            self.rounds.shutdown()
            self.save_checkpoint()
            self.status_doc.write()
            return EXIT_OK
        else:
            log.warning("[site=%s] ignoring unexpected %s", self.site_id, type(msg).__name__)
        return None

    def _on_welcome(self, msg: Welcome) -> None:
        self.session.welcomed(msg)
        self.sender.open_session(msg.session_id)
        if msg.need_init:
            self.session.send_init(self.replica.initial_params())
            self.replica.adopt(0)
            self._evaluate()  # θ_0's loss, measured before any round can wait on it

    def _ask_for_model(self) -> None:
        self.session.send(
            SyncRequest(site_id=self.site_id, global_version=self.replica.global_version)
        )

    def _on_error(self, msg: Error) -> int | None:
        response = self.session.on_error(msg)
        if response is ErrorResponse.JOIN_AGAIN:
            # The rounds planned by a coordinator that forgot us (it restarted, or timed us
            # out) are void, the one being trained included: its result will never come.
            self.rounds.rejoin()
            self._join()
        elif response is ErrorResponse.STOP_FATAL:
            return EXIT_FATAL
        elif response is ErrorResponse.STOP_AUTH_REFUSED:
            return EXIT_AUTH_REFUSED
        return None


def _load_kit(cfg: SiteConfig, metrics: SiteMetrics) -> SiteKit | None:
    if not cfg.security.kit_dir:
        return None
    kit = load_site_kit(cfg.security.kit_dir, site_id=cfg.site_id)
    metrics.certificate_expiry(kit.certificate.not_after)
    return kit


def _kit_watcher(
    cfg: SiteConfig, kit: SiteKit | None, metrics: SiteMetrics
) -> SiteKitWatcher | None:
    """What loads a new certificate or trust bundle of the kit while the agent runs."""
    if kit is None:
        return None
    return SiteKitWatcher(
        cfg.security.kit_dir, kit, on_refuse=lambda reason, _: metrics.trust_refused(reason)
    )
