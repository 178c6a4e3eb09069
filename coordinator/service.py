"""The coordinator service: the composition root and its loop.

:class:`Coordinator` builds the components, each owning its state and given only what it needs:
its own sections of the configuration (:func:`coordinator.config.sections` cuts the one
``[coordinator]`` table into them) and the collaborators it uses. They are the
:class:`~coordinator.aggregate.Aggregator` every round folds its updates through (chosen here,
once: the weighted mean, the sparse forward, or secure aggregation's masked sum), the
:class:`~coordinator.membership.Membership` (who is a member, what each holds), the round
:class:`~coordinator.lifecycle.Lifecycle` (the live :class:`~coordinator.round.Round` objects,
the decisions), the :class:`~coordinator.global_model.GlobalModel`, the
:class:`~coordinator.post.PostOffice` (socket, authentication, durability barrier), the
:class:`~coordinator.planner.Planner`, :class:`~coordinator.intake.Intake` for messages (with
:class:`~coordinator.conflicts.IdentityConflicts`, claims on a live member's site id),
:class:`~coordinator.opening.Opening` and :class:`~coordinator.closing.Closing` for rounds,
:class:`~coordinator.delivery.Delivery` for models owed to one site (a message lost on the way
is the channel's to send again: ``comm.transport.reliable``). Its loop receives one message at a
time, then ``tick``s: the lifecycle decides (remove a silent site, open, close, abort, retry,
finish) and the loop routes each decision to the component that carries it out. All math is in
the outer strategy (``coordinator.strategies``). Nothing that
reveals a state is sent before that state is durable:

- opening a round persists the round counter first (round ids are never reused);
- closing a round persists θ_{t+1}, momentum and residual first, then sends Global.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from comm.codecs.base import load_encoders
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import load_coordinator_kit
from comm.transport.router import CutOff, RouterChannel
from coordinator import strategies
from coordinator.aggregate import Aggregator, SparseForward, WeightedMean
from coordinator.allowance import PeerAllowance
from coordinator.closing import Closing
from coordinator.config import AggregationConfig, CoordinatorConfig, OuterConfig, sections
from coordinator.conflicts import IdentityConflicts
from coordinator.decisions import Abort, Close, Decision, Open, Remove, Retry
from coordinator.delivery import Delivery
from coordinator.file_store import FileStateStore
from coordinator.global_model import GlobalModel
from coordinator.initial_model import DescribedModel, InitialModel, check_holds, remember
from coordinator.intake import Intake
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Member, Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.opening import Opening
from coordinator.planner import Planner
from coordinator.post import PostOffice
from coordinator.rounds import OpenRound, next_fragment
from coordinator.secure_aggregation import MaskedSumAggregator
from coordinator.state import GlobalState, StateStore
from coordinator.status import CoordinatorStatus
from coordinator.status_board import write_endpoint
from coordinator.strategies.base import Strategy

log = logging.getLogger("crossdc.coordinator")


class Coordinator:
    """One federation's coordinator. ``start``, then ``run`` (or ``step``), then ``close``."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        store: StateStore | None = None,
        strategy: Strategy | None = None,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        initial: InitialModel | DescribedModel | None = None,
    ) -> None:
        """``initial``: θ0 from the launcher (``coordinator.initial_model``), installed as
        version 0 when the start finds no state, else checked against the state's model."""
        self.cfg = cfg
        self.sections = s = sections(cfg)
        self.clock = clock
        self.metrics = metrics or CoordinatorMetrics()
        self.finished = False
        self.decides = True
        """Whether the lifecycle decides rounds: a shard following shard 0 never does, shard 0
        only while every shard is there (``coordinator.shard_service``)."""
        self._finish_started: float | None = None
        self._initial = initial
        self._encoders: _Loading | None = None
        """The encoders' library loading while a restarted coordinator serves."""
        kit = load_coordinator_kit(cfg.security.kit_dir) if cfg.security.kit_dir else None
        signing_key = kit.signing_key if kit else None
        state_path = s.state.path
        store = store or FileStateStore(
            s.state.dir, keep=s.state.keep_checkpoints, signing_key=signing_key
        )
        self.post = PostOffice(s.post, s.faults.wrap(store), self.metrics, kit, clock=clock)
        self.aggregator = _configured_aggregator(s.aggregation, self.post)
        self.membership = Membership(s.site_timeout_s)
        self.book = Lifecycle(s.rounds, self.membership, self.aggregator)
        self.model = GlobalModel(
            num_fragments=s.rounds.num_fragments,
            deltas_dir=state_path / "deltas" if state_path else None,
            signing_key=signing_key,
            persist=self.post.persist,
            later=self.post.later,
            drain=self.post.drain,
            reload=self.post.load,
        )
        self.status_report = CoordinatorStatus(
            session_id=os.urandom(8).hex(),
            state_dir=state_path,
            clock=clock,
            members=self.membership,
            book=self.book,
            model=self.model,
            post=self.post,
            metrics=self.metrics,
        )
        self._assemble(strategy or _outer_strategy(s.outer))

    def _assemble(self, strategy: Strategy) -> None:
        """The components that handle messages and carry decisions out."""
        s, book, model, post = self.sections, self.book, self.model, self.post
        metrics = self.metrics
        members, aggregator = self.membership, self.aggregator
        planner = self.planner = Planner(s.schedule)
        delivery = Delivery(members, model, post, metrics)
        self.intake = Intake(
            session_id=self.session_id,
            heartbeat_interval_s=s.post.channel.heartbeat_interval_s,
            clock=self.clock,
            members=members,
            rounds=book,
            model=model,
            post=post,
            delivery=delivery,
            planner=planner,
            aggregator=aggregator,
            conflicts=IdentityConflicts(
                heartbeat_timeout_s=s.post.channel.heartbeat_timeout_s,
                metrics=metrics,
                describe=post.describe,
            ),
            metrics=metrics,
            on_leave=self._remove,
            on_changed=self._publish_status,
        )
        self.opening = Opening(
            s.rounds,
            s.faults,
            book=book,
            members=members,
            model=model,
            planner=planner,
            post=post,
            metrics=metrics,
        )
        self.closing = Closing(
            s.evaluation,
            s.faults,
            final_mean=s.outer.final_mean,
            members=members,
            model=model,
            planner=planner,
            strategy=strategy,
            post=post,
            metrics=metrics,
            on_changed=self._publish_status,
        )

    # ---- what callers read -----------------------------------------------------------------

    @property
    def state(self) -> GlobalState | None:
        return self.model.state

    @property
    def members(self) -> Mapping[str, Member]:
        return self.membership

    @property
    def open_rounds(self) -> list[OpenRound]:
        """The rounds in flight, oldest first, as they stand now."""
        return [r.view() for r in self.book.open_rounds]

    @property
    def open_round(self) -> OpenRound | None:
        """The oldest round in flight, as it stands now."""
        return self.book.open_rounds[0].view() if self.book.open_rounds else None

    @property
    def chan(self) -> RouterChannel | None:
        return self.post.chan

    @property
    def registry(self) -> CertificateRegistry | None:
        return self.post.registry

    @property
    def session_id(self) -> str:
        return self.status_report.session_id

    @property
    def endpoint(self) -> str:
        return self.status_report.endpoint

    def status(self) -> dict[str, Any]:
        """The latest published status (safe to call from another thread)."""
        return self.status_report.get()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Load the durable state and the encoders' library, bind the socket; return the bound
        endpoint. A start without a state loads the library first (a broken install fails
        before any site joins); a restart that found its state serves while it loads
        (:class:`_Loading`), and it builds no θ0 unless it must (``coordinator.initial_model``),
        so that it listens again at once."""
        state = self.post.load()
        if state is None:
            load_encoders()
        self.post.start_writer()
        initial, state_path = self._initial, self.sections.state.path
        if state is None and initial is not None:
            theta0 = initial.built()
            self.model.install(theta0.params, theta0.fingerprint)
            remember(initial, theta0.fingerprint, state_path)
            self.book.set_model(0)
        elif state is not None:
            if initial is not None:  # built only where the state's record cannot vouch for it
                where = self.sections.state.dir or "the state store"
                check_holds(initial, state.model_fingerprint, state_path, where)
            self._resume(state)
        allowance = PeerAllowance(
            members=self.membership,
            numel=lambda: None if self.model.state is None else self.model.numel,
            unknown_model_bytes=self.sections.post.channel.max_transfer_bytes,
            held_updates=self.sections.rounds.max_open + self.sections.rounds.num_fragments,
        )
        endpoint = self.status_report.endpoint = self.post.bind(allowance)
        if self.sections.state.path is not None:
            write_endpoint(self.sections.state.path, endpoint, self.session_id)
        log.info("[coordinator] listening on %s session=%s", endpoint, self.session_id)
        if state is not None:
            self._encoders = _Loading(load_encoders)
        self._publish_status()
        return endpoint

    def _resume(self, state: GlobalState) -> None:
        self.model.loaded(state)
        self.book.restore(
            global_version=state.global_version,
            round_counter=state.round_counter,
            completed_rounds=len(state.history),
            next_fragment=next_fragment(state.history, self.sections.rounds.num_fragments),
        )
        self.metrics.global_version.set(state.global_version)
        log.info(
            "[coordinator] resumed global_version=%d round_counter=%d",
            state.global_version,
            state.round_counter,
        )

    def close(self) -> None:
        if self.post.close_writer():  # what waited on a save goes out before the socket closes
            self._publish_status()  # the last state, now durable
        self.post.close(finished=self.finished)

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until the federation finishes or ``stop`` is set."""
        while not self.finished and not (stop is not None and stop.is_set()):
            self.step(0.05)
        if self.post.outbox is not None:  # what waits on a save (Shutdown, say) goes out now
            self.post.outbox.drain()
            self._publish_status()

    def step(self, timeout_s: float) -> None:
        """Handle at most one message (waiting up to ``timeout_s``), then tick."""
        chan, outbox = self.post.chan, self.post.outbox
        assert chan is not None and outbox is not None, "start() first"
        if self._encoders is not None:
            self._encoders.check()
        outbox.flush()
        got = chan.recv(min(timeout_s, 0.002) if outbox.waiting else timeout_s)
        if got is not None:
            self.intake.handle(*got)
        self.tick()
        outbox.flush()

    # ---- the tick: decisions routed --------------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        for cut in self.post.cut_off():
            self._on_cut_off(cut)
        self._models_given_up()
        if now - self.status_report.published_at > 1.0:
            self._publish_status()
        if self.model.state is None:
            self._expire(now)
            self.intake.initiator_gone()
            return
        if self.finished:
            return
        if self._finish_started is not None:
            self._expire(now)
            self._maybe_finish(now)
            return
        if not self.decides:
            self._expire(now)
            return
        # Several decisions can follow at once (remove a silent site, close r, open r+2).
        for _ in range(8):
            decision = self.book.tick(now, self._unconfirmed())
            if decision is None:
                return
            self._route(now, decision)
            if self._finish_started is not None:
                return

    def _models_given_up(self) -> None:
        """A member whose model the channel gave up (it held more for it than it may) does not
        hold it: out of sync, it gets the whole model with the next result."""
        peers = set(self.post.models_given_up())
        for site_id, m in list(self.membership.items()):
            if m.peer in peers and m.in_sync:
                log.warning("[coordinator site=%s] its model was given up: out of sync", site_id)
                self.membership.holds(site_id, m.global_version, in_sync=False)

    def _unconfirmed(self) -> frozenset[str]:
        """Members a model was sent to in chunks that have not acknowledged it: a site that
        cannot or will not take the model is not planned into rounds it would only hold up."""
        members = self.membership
        return frozenset(s for s, m in members.items() if self.post.awaits_model(m.peer))

    def carry_out(self, now: float, decision: Decision) -> None:
        """Carry out a decision made outside ``tick`` (a coordinator of several shards closes a
        round when every shard agrees, ``coordinator.shard_service``)."""
        self._route(now, decision)

    def _route(self, now: float, decision: Decision) -> None:
        if isinstance(decision, Remove):
            self._on_removed(decision)
        elif isinstance(decision, Open):
            self.opening.open(now, decision)
        elif isinstance(decision, Close):
            self.closing.close(now, decision)
        elif isinstance(decision, Retry):
            self.opening.retry_or_abandon(now, decision)
        elif isinstance(decision, Abort):
            self.opening.abort(decision)
        else:
            log.info("[coordinator] finishing: %s", decision.why)
            self._finish_started = now
            self._maybe_finish(now)

    def _maybe_finish(self, now: float) -> None:
        assert self._finish_started is not None
        if self.closing.maybe_finish(now, self._finish_started):
            self.finished = True
            self._publish_status()

    def _expire(self, now: float) -> None:
        """Silent sites are removed also when no round can run (before init, while finishing)."""
        removed = self.book.expire(now)
        if removed is not None:
            self._on_removed(removed)

    # ---- members leaving: one way to forget them -------------------------------------------

    def _remove(self, site_id: str) -> None:
        """A member that left."""
        m = self.membership.leave(site_id)
        self._forget(site_id, m.peer if m is not None else None)
        self.metrics.members.set(len(self.membership))

    def _on_cut_off(self, cut: CutOff) -> None:
        """A connection the channel cut off (a revoked or expired certificate): the member it
        carries leaves, as by a Leave."""
        site_id = cut.identity.site_id
        m = self.membership.get(site_id)
        if m is None or m.peer != cut.peer:
            return
        log.warning("[coordinator site=%s] removed: certificate %s", site_id, cut.reason)
        self._remove(site_id)

    def _on_removed(self, decision: Remove) -> None:
        """Members timed out."""
        for m in decision.members:
            log.warning("[coordinator site=%s] removed: %s", m.site_id, decision.why)
            self.metrics.site_timeouts.inc()
            self._forget(m.site_id, m.peer)
        self.metrics.members.set(len(self.membership))

    def _forget(self, site_id: str, peer: bytes | None) -> None:
        """Everything kept about a member, dropped when it leaves or is timed out (both removal
        paths): a site that comes back joins afresh and is recorded again."""
        self.intake.forget(site_id)
        if peer is not None:
            self.post.forget(peer)

    def _publish_status(self) -> None:
        self.status_report.publish(finished=self.finished)


class _Loading:
    """A library loaded on a thread of its own while the service serves (a message that needs
    it waits on the import); an error there stops the service at its next step, as it would
    have stopped its start."""

    def __init__(self, load: Callable[[], None]) -> None:
        self._load = load
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="load-encoders", daemon=True).start()

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # re-raised on the service's thread
            self._error = exc

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"cannot load the encoders' library: {self._error}")


def _configured_aggregator(aggregation: AggregationConfig, post: PostOffice) -> Aggregator:
    """How rounds aggregate: secure aggregation's masked sum, the sparse broadcast's forward,
    or the plain weighted mean."""
    if aggregation.secure_aggregation is not None:
        return MaskedSumAggregator(aggregation.secure_aggregation, post)
    if aggregation.broadcast == "sparse":
        return SparseForward(aggregation.max_update_norm)
    return WeightedMean(aggregation.max_update_norm)


def _outer_strategy(outer: OuterConfig) -> Strategy:
    """The outer optimizer the outer step section names, from the registry."""
    settings = strategies.OuterSettings(
        lr=outer.lr, momentum=outer.momentum, warmup_steps=outer.warmup_steps
    )
    return strategies.build(outer.strategy, settings)
