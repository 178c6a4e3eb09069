"""The coordinator service: thin I/O around the round lifecycle and the strategy.

The loop receives one message at a time (``intake`` validates and records it), then ``tick``s:
the pure :class:`~coordinator.lifecycle.Lifecycle` decides (remove a silent site, open, close,
abort, re-run, finish) and ``opening`` / ``closing`` carry each decision out. All math is in
``strategy``. Saves run on a background writer (``outbox``), and nothing that reveals a state is
sent before that state is durable:

- opening a round persists the round counter first (round ids are never reused);
- closing a round persists θ_{t+1}, momentum and residual first, then sends Global.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from comm.security.kits import CoordinatorKit, load_coordinator_kit
from comm.security.masking import Peer
from comm.security.registry import CertificateRegistry
from comm.security.secagg import MaskingPlan
from comm.security.zap import ZapHandler
from comm.transport.router import RouterChannel
from comm.wire.schema import ERROR_MEANINGS, Error, ErrorCode, Message, RoundStart
from comm.wire.tensors import fragments, state_hash
from coordinator import closing, intake, opening, redelivery
from coordinator.aggregate import RunningSum
from coordinator.config import CoordinatorConfig
from coordinator.decisions import Abort, Close, Open, Remove, Rerun
from coordinator.deltalog import DeltaLog
from coordinator.file_store import FileStateStore
from coordinator.intake import Accepted
from coordinator.lifecycle import Lifecycle, lifecycle_config, next_fragment
from coordinator.membership import Member
from coordinator.metrics import CoordinatorMetrics
from coordinator.model_spec import ModelSpec
from coordinator.outbox import Outbox
from coordinator.rounds import OpenRound
from coordinator.scheduler import RoundPlan, SiteView
from coordinator.state import GlobalState, StateStore
from coordinator.status_board import STATUS_HISTORY_TAIL, StatusBoard, write_endpoint
from coordinator.strategy import DiLoCo, Strategy

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True)
class InitialModel:
    """θ_0 handed to the coordinator at its start (built from the federation's seed by its
    launcher), so that no site has to upload it."""

    params: Mapping[str, np.ndarray]
    fingerprint: str


class Coordinator:
    """One federation's coordinator. ``start``, then ``run`` (or ``step``), then ``close``.

    Rounds and membership live in a pure :class:`Lifecycle` (``self.book``); this class is the
    I/O around it: decoding and validating messages, the strategy's math, durable writes and
    sends, in the order the lifecycle's decisions give.
    """

    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        store: StateStore | None = None,
        strategy: Strategy | None = None,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        initial: InitialModel | None = None,
    ) -> None:
        self.cfg = cfg
        self.initial = initial
        self.kit: CoordinatorKit | None = (
            load_coordinator_kit(cfg.security.kit_dir) if cfg.security.kit_dir else None
        )
        self.store: StateStore = store or FileStateStore(
            cfg.state_dir,
            keep=cfg.keep_checkpoints,
            signing_key=self.kit.signing_key if self.kit else None,
        )
        self.registry: CertificateRegistry | None = None
        self._zap: ZapHandler | None = None
        self.strategy: Strategy = strategy or DiLoCo(
            lr=cfg.outer_lr, momentum=cfg.outer_momentum, warmup_steps=cfg.outer_warmup_steps
        )
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock
        self.book = Lifecycle(lifecycle_config(cfg))
        self.session_id = os.urandom(8).hex()
        self.state: GlobalState | None = None
        self._init_round_records()
        self._init_site: str | None = None
        self._init_fingerprint: str | None = None
        # The federation's model as a site with its fingerprint declared it: explains refusals.
        self._model_spec: ModelSpec | None = None
        self._finish_started: float | None = None
        self.finished = False
        self.endpoint = ""
        self.chan: RouterChannel | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._hash_cache: tuple[int, str] | None = None
        self.deltas = DeltaLog(0)  # sized and started with the model (``_set_model``)
        self._transfers_waited_seen = 0  # the channel's count, as far as the metric has it
        # Saves run on a writer thread; whatever reveals a state waits until it is durable.
        self.outbox: Outbox | None = None
        self._status = StatusBoard(
            self.cfg.state_path / "status.json" if self.cfg.state_dir else None, self.clock
        )

    def _init_round_records(self) -> None:
        """What the service keeps per round and per site beside the lifecycle (never a site's
        update: those go into running sums)."""
        # What each accepted update says (no tensors): on time per open round, late by
        # (site, round).
        self._accepted: dict[int, dict[str, Accepted]] = {}
        self._late: dict[tuple[str, int], Accepted] = {}
        # Running weighted sums of the updates: per open round, and per closed round whose
        # late updates wait for their fragment's next sync (never the updates themselves).
        self._sums: dict[int, RunningSum] = {}
        self._late_sums: dict[int, RunningSum] = {}
        self._views: dict[str, SiteView] = {}
        self._round_plan: dict[int, RoundPlan] = {}
        # The RoundStart each participant of an open round was sent, to send again to a site
        # heard from after a loss (see ``redelivery``), and the members a send failed to since
        # they were last heard from.
        self._round_starts: dict[int, dict[str, RoundStart]] = {}
        self._undelivered: set[str] = set()
        self._missed_result: set[str] = set()  # a broadcast failed to reach them
        # Arrival alignment: when each on-time update landed, per open round; how early each
        # site's landed in the latest closed round (``_early_round``) before its last one, and
        # the extra steps it had there.
        self._arrived: dict[int, dict[str, float]] = {}
        self._early_s: dict[str, float] = {}
        self._early_extra: dict[str, int] = {}
        self._early_round = 0
        self._fragment_names: list[list[str]] = []
        # The socket's byte counters when the latest round's result went out: a round's bytes
        # are those since (two rounds in flight overlap in time, their bytes must not).
        self._bytes_mark = (0, 0)
        # What each site said it holds at its join (version, state hash): before the initial
        # model exists, a site that built the same θ0 is in sync once it does.
        self._claims: dict[str, tuple[int, str]] = {}
        # Secure aggregation: each site's announced masking keys, each round's masking plan
        # (its current attempt), and the masked vectors of that attempt.
        self._secagg_peers: dict[str, Peer] = {}
        self._masking: dict[int, MaskingPlan] = {}
        self._masked: dict[int, dict[str, dict[str, np.ndarray]]] = {}

    @property
    def members(self) -> dict[str, Member]:
        return self.book.members

    @property
    def open_rounds(self) -> list[OpenRound]:
        return self.book.open_rounds

    @property
    def open_round(self) -> OpenRound | None:
        """The oldest round in flight."""
        return self.book.open_rounds[0] if self.book.open_rounds else None

    def install_initial(self, params: Mapping[str, np.ndarray], fingerprint: str) -> None:
        """θ_0: the global model at version 0, zero momentum and residual, saved durably."""
        arrays = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        zeros = {k: np.zeros_like(v) for k, v in arrays.items()}
        self.state = GlobalState(
            params=arrays,
            momentum=zeros,
            residual={k: v.copy() for k, v in zeros.items()},
            global_version=0,
            round_counter=0,
            model_fingerprint=fingerprint,
        )
        self._persist(self.state)
        self._set_model()
        self.book.set_model(0)
        log.info(
            "[coordinator] initial model %s: %d tensors, %d parameters",
            fingerprint,
            len(arrays),
            sum(v.size for v in arrays.values()),
        )

    def _set_model(self) -> None:
        """Fragment layout of the model (a pure function of its tensor names)."""
        assert self.state is not None
        self._fragment_names = fragments(list(self.state.params), self.cfg.num_fragments)
        # A chain of deltas is worth sending only while it is smaller than the model itself.
        self.deltas = DeltaLog(
            sum(4 * v.size for v in self.state.params.values()),
            self.cfg.state_path / "deltas" if self.cfg.state_dir else None,
        )
        self.deltas.resume(self.state.global_version, self._hash())

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Load durable state, bind the socket; return the bound endpoint."""
        self.state = self.store.load()
        self.outbox = Outbox(self.cfg.faults.wrap(self.store))
        if self.state is None and self.initial is not None:
            self.install_initial(self.initial.params, self.initial.fingerprint)
        elif (
            self.state is not None
            and self.initial is not None
            and self.initial.fingerprint != self.state.model_fingerprint
        ):
            raise ValueError(
                f"coordinator.initial_model describes model {self.initial.fingerprint}, but "
                f"{self.cfg.state_dir or 'the state store'} holds model "
                f"{self.state.model_fingerprint}"
            )
        if self.state is not None:
            self._set_model()
            self.book = Lifecycle.resume(
                lifecycle_config(self.cfg),
                global_version=self.state.global_version,
                round_counter=self.state.round_counter,
                completed_rounds=len(self.state.history),
                next_fragment=next_fragment(self.state.history, self.cfg.num_fragments),
            )
            self.metrics.global_version.set(self.state.global_version)
            log.info(
                "[coordinator] resumed global_version=%d round_counter=%d",
                self.state.global_version,
                self.state.round_counter,
            )
        self._ctx = zmq.Context()
        channel_cfg = self.cfg.channel
        if self.kit is not None:
            self.registry = CertificateRegistry.from_kit(self.kit.kit_dir)
            self.metrics.watch_certificates(self._trusted_certificates)
            self.metrics.ca_expiry.set(self.kit.ca_not_after)
            self._zap = ZapHandler(self._ctx, self.registry, on_reject=self._on_auth_reject)
            self._zap.start()  # before the bind: no handshake may race the handler
            channel_cfg = replace(channel_cfg, curve=self.kit.curve)
        else:
            log.warning(
                "[coordinator] INSECURE MODE: no encryption, no authentication. "
                "For loopback experiments only; never expose this endpoint."
            )
        self.chan = RouterChannel(channel_cfg, context=self._ctx, on_reject=self._on_wire_reject)
        self.endpoint = self.chan.bind(self.cfg.bind)
        if self.cfg.state_dir:
            write_endpoint(self.cfg.state_path, self.endpoint, self.session_id)
        log.info("[coordinator] listening on %s session=%s", self.endpoint, self.session_id)
        self._publish_status()
        return self.endpoint

    def close(self) -> None:
        if self.outbox is not None:
            self.outbox.close()  # what waited on a save goes out before the socket closes
            self.outbox = None
            self._publish_status()  # the last state, now durable
        if self.chan is not None:
            # Finished: the last results, and the Shutdown queued behind each, go out in full
            # (a site that stops acknowledging is dropped after channel.send_timeout_s without
            # progress), within a round's deadline; otherwise the usual linger.
            self.chan.close(flush_timeout_s=self.cfg.round_deadline_s if self.finished else None)
            self.chan = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            # term() waits (up to the linger) until queued messages, e.g. Shutdown, are sent.
            self._ctx.term()
            self._ctx = None

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until the federation finishes or ``stop`` is set."""
        while not self.finished and not (stop is not None and stop.is_set()):
            self.step(0.05)
        if self.outbox is not None:  # what waits on a save (Shutdown, say) goes out now
            self.outbox.drain()
            self._publish_status()

    def step(self, timeout_s: float) -> None:
        """Handle at most one message (waiting up to ``timeout_s``), then tick."""
        assert self.chan is not None, "start() first"
        assert self.outbox is not None
        self.outbox.flush()
        got = self.chan.recv(min(timeout_s, 0.002) if self.outbox.waiting else timeout_s)
        if got is not None:
            peer, msg = got
            intake.handle(self, peer, msg)
        self.tick()
        self.outbox.flush()

    # ---- durability before announcement ------------------------------------------------------

    def _persist(self, state: GlobalState, *, counter_only: bool = False) -> None:
        assert self.outbox is not None, "start() first"
        self.outbox.persist(state, counter_only=counter_only)

    def _later(self, action: Callable[[], None]) -> None:
        assert self.outbox is not None, "start() first"
        self.outbox.later(action)

    # ---- helpers ---------------------------------------------------------------------------

    def _trusted_certificates(self) -> list[tuple[str, str, float]]:
        """(site, serial, not_after) of each certificate the registry trusts (HTTP thread)."""
        registry = self.registry
        if registry is None:
            return []
        return [(c.site_id, c.serial, c.not_after) for c in registry.trusted_certificates()]

    def _on_wire_reject(self, peer: bytes, code: ErrorCode, detail: str) -> None:
        self.metrics.rejected.labels(reason=code.name.lower()).inc()

    def _on_auth_reject(self, reason: str, detail: str) -> None:
        """A connection refused at the CURVE handshake (ZAP handler thread)."""
        self.metrics.rejected.labels(reason=reason).inc()

    def _reject(
        self, peer: bytes, code: ErrorCode, detail: str, who: str = "?", reason: str = ""
    ) -> None:
        reason = reason or code.name.lower()
        self.metrics.rejected.labels(reason=reason).inc()
        log.warning("[coordinator site=%s] rejected: %s: %s", who, reason, detail)
        self._send(peer, Error(code=int(code), detail=f"{ERROR_MEANINGS[code]}: {detail}"))

    def _send(self, peer: bytes, msg: Message) -> bool:
        """Send now, or after the latest save is durable (then True means queued)."""
        if self.outbox is not None and not self.outbox.settled():
            self._later(lambda: self._send_queued(peer, msg))
            return True
        return self._send_now(peer, msg)

    def _send_queued(self, peer: bytes, msg: Message) -> None:
        self._send_now(peer, msg)

    def _send_now(self, peer: bytes, msg: Message) -> bool:
        assert self.chan is not None
        before = self.chan.stats.bytes_sent
        ok = self.chan.send(peer, msg)
        self.metrics.wire_bytes.labels(direction="out").inc(self.chan.stats.bytes_sent - before)
        if not ok:
            redelivery.send_failed(self, peer)
        return ok

    def _hash(self, state: GlobalState | None = None) -> str:
        state = state or self.state
        assert state is not None
        if self._hash_cache is None or self._hash_cache[0] != state.global_version:
            self._hash_cache = (state.global_version, state_hash(state.params))
        return self._hash_cache[1]

    # ---- message handling ------------------------------------------------------------------

    def _remove(self, site_id: str) -> None:
        m = self.book.leave(site_id)
        self._forget(site_id)
        if m is not None and self.chan is not None:
            self.chan.forget(m.peer)
        self.metrics.members.set(len(self.book.members))

    def _forget(self, site_id: str) -> None:
        """Everything kept about a member, dropped when it leaves or is timed out (both removal
        paths): a site that comes back joins afresh and is recorded again."""
        self._undelivered.discard(site_id)
        self._missed_result.discard(site_id)
        self._claims.pop(site_id, None)
        self._views.pop(site_id, None)
        self._secagg_peers.pop(site_id, None)

    # ---- the tick: decisions carried out ---------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        if now - self._status.published_at > 1.0:
            self._publish_status()
        if self.state is None:
            self._expire(now)
            if self._init_site is not None and self._init_site not in self.book.members:
                self._init_site = self._init_fingerprint = None
                self._model_spec = None
            return
        if self.finished:
            return
        if self._finish_started is not None:
            self._expire(now)
            closing.maybe_finish(self, now)
            return
        # Several decisions can follow at once (remove a silent site, close r, open r+2).
        for _ in range(8):
            decision = self.book.tick(now)
            if decision is None:
                return
            if isinstance(decision, Remove):
                self._on_removed(decision)
            elif isinstance(decision, Open):
                opening.open(self, now, decision)
            elif isinstance(decision, Close):
                closing.close(self, now, decision)
            elif isinstance(decision, Rerun):
                opening.rerun_or_abandon(self, now, decision.round, decision.received)
            elif isinstance(decision, Abort):
                opening.abort(self, decision)
            else:
                log.info("[coordinator] finishing: %s", decision.why)
                self._finish_started = now
                closing.maybe_finish(self, now)
                return

    def _expire(self, now: float) -> None:
        """Silent sites are removed also when no round can run (before init, while finishing)."""
        removed = self.book.expire(now)
        if removed is not None:
            self._on_removed(removed)

    def _on_removed(self, decision: Remove) -> None:
        for m in decision.members:
            log.warning("[coordinator site=%s] removed: %s", m.site_id, decision.why)
            self.metrics.site_timeouts.inc()
            self._forget(m.site_id)
            if self.chan is not None:
                self.chan.forget(m.peer)
        self.metrics.members.set(len(self.book.members))

    # ---- status ----------------------------------------------------------------------------

    def _observe_transfers(self) -> None:
        """The receive budget's figures (``comm/transport/receiver.py``) into the metrics."""
        if self.chan is None:
            return
        stats = self.chan.stats
        self.metrics.transfers_waiting.set(stats.transfers_waiting)
        self.metrics.reassembly_peak_bytes.set(stats.reassembly_peak_bytes)
        self.metrics.transfers_waited.inc(stats.transfers_waited - self._transfers_waited_seen)
        self._transfers_waited_seen = stats.transfers_waited

    def _publish_status(self) -> None:
        self._observe_transfers()
        if self.outbox is not None and not self.outbox.durable:
            return  # the status shows durable states only; the next tick publishes this one
        st = self.state
        chan = self.chan
        status: dict[str, Any] = {
            "session_id": self.session_id,
            "endpoint": self.endpoint,
            "finished": self.finished,
            "global_version": st.global_version if st else None,
            "round_counter": st.round_counter if st else 0,
            "rounds_completed": len(st.history) if st else 0,
            "members": sorted(self.book.members),
            "open_round": self.open_round.round_id if self.open_round else None,
            "open_rounds": [r.round_id for r in self.book.open_rounds],
            "val_losses": {str(k): v for k, v in sorted(st.val_losses.items())} if st else {},
            "val_metrics": {str(k): v for k, v in sorted(st.val_metrics.items())} if st else {},
            "history": list(st.history[-STATUS_HISTORY_TAIL:]) if st else [],
            "history_count": len(st.history) if st else 0,
            "wire_bytes_in": chan.stats.bytes_received if chan else 0,
            "wire_bytes_out": chan.stats.bytes_sent if chan else 0,
            "rejected": dict(chan.stats.rejected) if chan else {},
            "transfers_waited": chan.stats.transfers_waited if chan else 0,
            "reassembly_peak_bytes": chan.stats.reassembly_peak_bytes if chan else 0,
            "num_parameters": int(sum(v.size for v in st.params.values())) if st else 0,
        }
        self._status.publish(status)

    def status(self) -> dict[str, Any]:
        """The latest published status (safe to call from another thread)."""
        return self._status.get()
