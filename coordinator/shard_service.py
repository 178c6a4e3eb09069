"""A shard of a coordinator of several shards, as a service: a :class:`Coordinator` over the
tensors it owns, and its end of the shards' control plane.

With ``[coordinator] shards = S`` each process is one shard (``coordinator.sharding``): a
:class:`~coordinator.service.Coordinator` of its own (state, outer optimizer, delta log, metrics,
endpoint) whose rounds cover its tensors; the sites send each shard its part of every update
(``site_agent.shard_links``). This module joins the shards' rounds into one:

- :class:`LeadShard` is shard 0. Its lifecycle decides (only while every shard is there): a
  round's plans go to the sites once every shard opened it (``ShardOpen``/``ShardOpened``, the
  opening's ``release``); a site's update counts once every shard took its part (the lifecycle's
  :class:`~coordinator.lifecycle.RoundGate`: each shard took its part, and their squared norms
  add up to a whole update within the norm bound); a close waits while a site is half-way (up
  to the grace ceiling), then freezes the round everywhere and closes it over the sites whose
  part every shard holds and took, leaving every other site's update out on every shard (an
  Error to the site, counted as ``left_out``), or aborts it everywhere when fewer than its
  quorum are left (``coordinator.shard_plane``); each shard saves its result and
  reports its tensors' digests; shard 0 writes its commit record (``coordinator.shard_commit``)
  and every shard announces the result with the whole model's hash, which shard 0 signs. A
  shard lost, or back after a restart, aborts every round in flight.
- :class:`FollowShard` is every other shard: it decides nothing, opens, freezes, closes and
  aborts rounds as shard 0 says (``coordinator.shard_rounds``), reports every part it took
  (with its squared norm) or refused, and announces a result when shard 0 committed it.

A shard that saved a round's version and sees the round aborted before the commit goes back to
the version before (``PostOffice.roll_back``: the store's checkpoint kept before its newest,
``GlobalModel.rolled_back``, ``Lifecycle.undo_close``); so does one that starts holding a version
never committed (the resume rule: ``coordinator.shard_plane.resume`` for the other shards,
``coordinator.shard_commit.start_version`` for shard 0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from comm.security.rolekits import CoordinatorKit, load_coordinator_kit
from comm.wire.partition import partition, partition_digest
from comm.wire.schema import (
    ErrorCode,
    ShardAbort,
    ShardClose,
    ShardCommit,
    ShardFolded,
    ShardFreeze,
    ShardFrozen,
    ShardInitial,
    ShardInitialDone,
    ShardOpen,
    ShardOpened,
    ShardPrepared,
    Update,
)
from comm.wire.tensors import state_hash
from coordinator import shard_commit
from coordinator.closing import Saved
from coordinator.config import CoordinatorConfig
from coordinator.decisions import Abort
from coordinator.history_log import META_FILE
from coordinator.initial_model import DescribedModel, InitialModel
from coordinator.round import Round
from coordinator.service import Coordinator
from coordinator.shard_initial import Held, Initials, read_record, write_record
from coordinator.shard_link import ShardClient, ShardServer
from coordinator.shard_peers import (
    FollowerEvent,
    Heard,
    Joined,
    LeaderEvent,
    Lost,
    Ready,
    Resumed,
    ShardFollower,
    ShardLeader,
    plan_fields,
)
from coordinator.shard_plane import AbortAll, CloseAll, CommitAll, Phase, ShardPlane
from coordinator.shard_rounds import (
    abort_as_told,
    close_as_told,
    freeze,
    leave_out,
    open_as_told,
)
from coordinator.sharding import (
    ShardIdentity,
    WholeModel,
    control_endpoint,
    own_part,
    shard_config,
)

log = logging.getLogger("crossdc.coordinator.shards")


class _Shard:
    """What both kinds of shard share: the coordinator, who this shard is, the partition."""

    def __init__(
        self,
        coord: Coordinator,
        identity: ShardIdentity,
        parts: Sequence[Sequence[str]] | None,
        *,
        whole_hash0: str | None,
    ) -> None:
        """``whole_hash0``: the state hash of the whole θ0 (every shard digests each tensor as
        it draws θ0 and keeps its part), the hash the sites hold version 0 by. ``parts`` None:
        θ0 comes from a site (``coordinator.shard_initial``); the cut and that hash are the
        state directory's record of it, or unknown until it came."""
        path = coord.sections.state.path
        if parts is None:
            whole = read_record(path) if path is not None else None
            if whole is not None:
                parts = partition(whole.shapes, identity.count)
                whole_hash0 = whole.state_hash
        if identity.count < 2 or (parts is not None and identity.count != len(parts)):
            n = "no" if parts is None else len(parts)
            raise ValueError(f"shard {identity.index} of {identity.count}: {n} parts")
        self.coord = coord
        self.identity = identity
        self.parts = tuple(tuple(p) for p in parts) if parts is not None else None
        """The model's cut, None until θ0 came from a site."""
        self.partition = partition_digest(self.parts) if self.parts is not None else ""
        self._initial: Held | None = None
        """This shard's part of θ0 as a site uploaded it, until shard 0's word on it."""
        coord.intake.on_initial = self._on_initial
        # The hash the sites know this shard's version by, before its state is loaded (its
        # delta log's chain is checked against it): its last commit's, else θ0's.
        record = shard_commit.read(path) if path is not None else None
        if record is not None:
            coord.model.whole_hash = (record.global_version, record.state_hash)
        elif whole_hash0 is not None:
            coord.model.whole_hash = (0, whole_hash0)
        self._saved: dict[int, Saved] = {}
        """Rounds this shard saved and has not announced (waiting for the commit)."""
        self._undone: set[int] = set()
        """Rounds whose result this shard took back (a save of one finishing later is void)."""
        coord.status_report.shard = (identity.index, identity.count)
        coord.closing.gate = self._on_saved
        self._cut_to_record: WholeModel | None = None
        """The whole model as θ0 from the launcher gave it, recorded once the state holds θ0."""

    @property
    def finished(self) -> bool:
        return self.coord.finished

    @property
    def endpoint(self) -> str:
        return self.coord.endpoint

    def _start_coordinator(self) -> str:
        endpoint = self.coord.start()
        st = self.coord.state
        if st is None:
            return endpoint  # θ0 comes from the first site (coordinator.shard_initial)
        if self.parts is None:
            raise ValueError(
                f"shard {self.identity.index} holds a model but no record of the whole model's "
                "cut (model.json in its state directory, written when θ0 came)"
            )
        owned = set(st.params)
        if owned != set(self.parts[self.identity.index]):
            raise ValueError(
                f"shard {self.identity.index} holds other tensors than the model's cut gives it "
                f"({len(owned)} held, {len(self.parts[self.identity.index])} in its part)"
            )
        path = self.coord.sections.state.path
        if self._cut_to_record is not None and path is not None:
            write_record(path, self._cut_to_record)  # a restart knows the cut, builds no θ0
            self._cut_to_record = None
        return endpoint

    def record_cut(self, whole: WholeModel) -> None:
        """θ0 came from the launcher as ``whole``'s cut: write the record of it
        (:func:`~coordinator.shard_initial.write_record`) once the state holds θ0 (not before:
        a state that turns out to hold another model must not get this model's record)."""
        self._cut_to_record = whole

    def _on_saved(self, saved: Saved) -> None:
        raise NotImplementedError

    # ---- θ0 from a site (coordinator.shard_initial) --------------------------------------------

    def _on_initial(
        self, peer: bytes, site_id: str, params: dict[str, np.ndarray], fingerprint: str
    ) -> None:
        """A site uploaded this shard's part of θ0 (checked): held, and reported to shard 0."""
        self._initial = Held(peer, site_id, params, fingerprint)
        self._report_initial(self._initial.report(self.identity.index))

    def _report_initial(self, report: ShardInitial) -> None:
        raise NotImplementedError

    def _cut(self, parts: Sequence[Sequence[str]]) -> None:
        """The model's cut, known now that θ0 came."""
        self.parts = tuple(tuple(p) for p in parts)
        self.partition = partition_digest(self.parts)

    def _take_initial(self, done: ShardInitialDone) -> bool:
        """Shard 0's word on a site's θ0: keep this shard's part as version 0 (True), or drop
        what it holds of that upload."""
        held, i = self._initial, self.identity.index
        if held is None or held.site_id != done.site_id:
            if done.state_hash:
                log.error("[coordinator shard=%d] θ0 from %s taken, not held", i, done.site_id)
            return False
        self._initial = None
        if not done.state_hash:
            log.warning(
                "[coordinator shard=%d] θ0 from %s dropped: %s", i, held.site_id, done.reason
            )
            return False
        whole = WholeModel(
            {n: tuple(int(d) for d in shape) for n, shape in done.shapes.items()},
            done.state_hash,
        )
        parts = partition(whole.shapes, self.identity.count)
        why = held.fits(done, parts[i])
        if why:
            log.error("[coordinator shard=%d] θ0 from %s not taken: %s", i, held.site_id, why)
            return False
        path = self.coord.sections.state.path
        if path is not None:
            write_record(path, whole)  # before the state: a restart knows the cut
        self._cut(parts)
        self.coord.model.whole_hash = (0, whole.state_hash)
        self.coord.intake.install_initial(held.site_id, held.params, held.fingerprint)
        return True

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until the federation finishes or ``stop`` is set."""
        while not self.finished and not (stop is not None and stop.is_set()):
            self.step(0.05)
        outbox = self.coord.post.outbox
        if outbox is not None:
            outbox.drain()

    def step(self, timeout_s: float) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _go_back(self, version: int, why: str) -> None:
        """This shard saved a version never committed: back to ``version`` (the store's and
        the model's), the round it closed merged nothing, every later round aborted."""
        st = self.coord.state
        assert st is not None
        if st.global_version == version:
            return
        book = self.coord.book
        log.warning(
            "[coordinator shard=%d] back from v%d to v%d: %s",
            self.identity.index,
            st.global_version,
            version,
            why,
        )
        # The save of the version dropped may still be in the writer: going back waits for
        # it, and its Saved, which comes then, is void.
        self._undone.add(st.global_version)
        state = self.coord.post.roll_back(version)
        self.coord.model.rolled_back(state)
        self.coord.metrics.global_version.set(version)
        r = book.closed.get(st.global_version)
        undone: tuple[int, ...] = ()
        if r is not None:
            book.undo_close(r, version)
            undone = (r.round_id,)
        else:  # at the start: nothing of the round is in memory
            book.set_model(version)
            book.completed_rounds = len(state.history)
        self._saved.pop(st.global_version, None)
        if book.open_rounds:
            undone += book.abort(f"back to v{version}: {why}").round_ids
        if undone:
            self._aborted_open(Abort(undone, f"back to v{version}: {why}"))

    def _aborted_open(self, decision: Abort) -> None:
        """Rounds this shard undid or aborted on its own (they built on a version dropped)."""

    def _closed_here(self, ids: Sequence[int]) -> Round | None:
        """The round of ``ids`` whose result this shard's model is (closed here, its save
        durable or still in the writer, not announced): aborting it takes the model back."""
        book = self.coord.book
        r = book.closed.get(book.global_version)
        if r is not None and r.merged is not None and r.round_id in ids:
            return r
        found = [i for i in ids if i in self._saved]
        return book.closed.get(found[0]) if found else None

    def _void_save(self, saved: Saved) -> bool:
        """A save that finished after its round was taken back: logged, nothing follows."""
        if saved.round_id not in self._undone:
            return False
        log.warning(
            "[coordinator shard=%d] round %d saved after it was taken back: ignored",
            self.identity.index,
            saved.round_id,
        )
        return True

    def _live(self, round_id: int) -> Round | None:
        """Round ``round_id`` while it takes parts (open, not frozen)."""
        r = self.coord.book.open_round(round_id)
        return r if r is not None and not r.frozen else None

    def _squared_norm(self, msg: Update) -> float:
        """Σ x² over the values of the part of ``msg`` this shard just took (its open round
        holds it): shard 0 bounds the site's whole update by its parts'."""
        r = self.coord.book.open_round(msg.round_id)
        assert r is not None and r.fold is not None, "an update taken on time: its round holds it"
        return r.fold.squared_norm(msg.site_id)


class LeadShard(_Shard):
    """Shard 0 (see the module doc)."""

    def __init__(
        self,
        coord: Coordinator,
        identity: ShardIdentity,
        parts: Sequence[Sequence[str]] | None,
        *,
        kit: CoordinatorKit | None,
        control_bind: str,
        whole_hash0: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(coord, identity, parts, whole_hash0=whole_hash0)
        if not identity.leader:
            raise ValueError(f"shard {identity.index} is not shard 0")
        self._clock = clock
        self._control_bind = control_bind
        channel = coord.sections.post.channel
        self.plane = ShardPlane(
            self.parts or [()] * identity.count,
            max_norm=coord.sections.aggregation.max_update_norm,
        )
        self.initials = Initials(identity.count)
        """The θ0 parts every shard holds of a site's upload (coordinator.shard_initial)."""
        self.server = ShardServer(channel, kit, clock=clock)
        self.leader = ShardLeader(
            self.server,
            self.plane,
            partition=self.partition,
            committed=lambda: (self.committed, self.coord.book.round_counter),
            timeout_s=channel.heartbeat_timeout_s,
            clock=clock,
            committed_hash=self._committed_hash,
            session=coord.session_id,
        )
        self.committed = -1
        """The last version every shard saved and shard 0 committed."""
        self.control_endpoint = ""
        self._starts: dict[int, tuple[int, Callable[[], None]]] = {}
        """Each opened round's plans and the version they name, sent once every shard opened
        the round and that version is committed (a site told of a version before its result
        would ask for the whole model)."""
        self._ready: set[int] = set()
        self._close_asked: dict[int, float] = {}
        self._why: dict[int, str] = {}
        self._events: list[LeaderEvent] = []
        coord.book.gate = self
        coord.opening.release = self._release
        coord.intake.on_update = self._on_update

    def start(self) -> str:
        """Load the state, go back to the last commit, bind both sockets."""
        endpoint = self._start_coordinator()
        st = self.coord.state
        path = self.coord.sections.state.path
        record = shard_commit.read(path) if path is not None else None
        version = shard_commit.start_version(st.global_version if st else None, record)
        if st is not None and version is not None and version != st.global_version:
            self._go_back(version, "shard 0 saved it and stopped before its commit")
        self.committed = self.coord.book.global_version
        self.control_endpoint = self.server.bind(self._control_bind)
        self.coord.decides = False  # until every shard is there
        log.info(
            "[coordinator shard=0/%d] control plane on %s, committed v%d",
            self.identity.count,
            self.control_endpoint,
            self.committed,
        )
        return endpoint

    def _committed_hash(self) -> str:
        known = self.coord.model.whole_hash
        return known[1] if known is not None and known[0] == self.committed else ""

    def close(self) -> None:
        self.coord.close()
        self.server.close()

    def step(self, timeout_s: float) -> None:
        """Handle at most one site message and the shards' reports, then decide."""
        self.coord.decides = self.leader.present
        self._drop_void()
        self.coord.step(timeout_s / 2)
        self._events += self.leader.poll(timeout_s / 2)
        for _ in range(16):
            got = self.leader.poll(0.0)
            if not got:
                break
            self._events += got
        self._aborted_by_lifecycle()
        if self.initials.reports:
            for done in self.initials.gone(self.coord.membership):
                self._initial_done(done)
        while self._events:
            self._on(self._events.pop(0))

    def _drop_void(self) -> None:
        """A site whose update is void (a shard refused a part of it, say one it was not
        joined to: a shard back from a restart before the site joined it again; or its parts
        together are over the norm bound) never completes its update: the lifecycle counts it
        as gone from the round, which closes without it or aborts at once instead of at its
        deadline."""
        for rid in self.plane.in_flight():
            r = self.coord.book.open_round(rid)
            if r is not None and self.plane.phase(rid) is Phase.OPEN:
                r.dropped = r.dropped | (self.plane.void(rid) & set(r.participants))

    # ---- the lifecycle's gate ------------------------------------------------------------------

    def complete(self, r: Round) -> frozenset[str]:
        if r.round_id not in self.plane.in_flight():
            return frozenset()
        return self.plane.complete(r.round_id)

    def hold_close(self, now: float, r: Round, merged: tuple[str, ...], why: str) -> bool:
        """Freeze the round everywhere once no site is half-way (or the grace ceiling passed
        since the lifecycle first wanted to close it); the shards' answers close it."""
        rid = r.round_id
        if rid not in self.plane.in_flight() or self.plane.phase(rid) is not Phase.OPEN:
            return True
        first = self._close_asked.setdefault(rid, now)
        ceiling = self.coord.sections.rounds.grace_ceiling_s
        # A site a shard refused a part of never completes: no use waiting for it.
        if self.plane.partial(rid) - self.plane.void(rid) and now - first < ceiling:
            return True
        r.frozen = True
        self.plane.freeze(rid)
        self._why[rid] = why
        self.leader.broadcast(ShardFreeze(round_id=rid))
        frozen = self.plane.frozen(0, rid, r.received)
        if frozen is not None:
            self._events.append(frozen)
        return True

    # ---- hooks -------------------------------------------------------------------------------

    def _release(self, round_id: int, send: Callable[[], None]) -> None:
        """A round opened here: every shard opens it (once its id is durable here), and its
        plans go to the sites once every shard did."""
        r = self.coord.book.open_round(round_id)
        assert r is not None and r.plan is not None
        st = self.coord.state
        assert st is not None
        self.plane.opened(round_id, r.participants, r.quorum)
        self._starts[round_id] = (st.global_version, send)
        msg = ShardOpen(
            round_id=round_id,
            base_version=r.base_version,
            fragment=r.fragment,
            participants=r.participants,
            quorum=r.quorum,
            deadline_s=r.deadline_at - r.opened_at,
            plan=plan_fields(r.plan),
        )
        self.coord.post.later(lambda: self.leader.broadcast(msg))

    def _on_update(self, msg: Update, refused: str | None) -> None:
        if self._live(msg.round_id) is None and refused is not None:
            return  # a late or stray update: no part of a round in flight
        try:
            if refused is None:
                self.plane.folded(0, msg.round_id, msg.site_id, self._squared_norm(msg))
            else:
                self.plane.refused(0, msg.round_id, msg.site_id, refused)
        except ValueError as exc:
            log.warning("[coordinator shard=0] %s", exc)

    def _on_saved(self, saved: Saved) -> None:
        if self._void_save(saved):
            return
        try:
            done = self.plane.prepared(0, saved.round_id, saved.version, saved.digests())
        except ValueError as exc:  # the round is no longer one the shards prepare
            log.error("[coordinator shard=0] round %d saved: %s", saved.round_id, exc)
            return
        self._saved[saved.round_id] = saved
        if done is not None:
            self._events.append(done)

    # ---- what the plane says -----------------------------------------------------------------

    def _aborted_by_lifecycle(self) -> None:
        """Rounds the lifecycle aborted (a deadline, sites gone) are aborted on every shard."""
        for rid in self.plane.in_flight():
            taking = self.plane.phase(rid) in (Phase.OPEN, Phase.FREEZING)
            if taking and self.coord.book.open_round(rid) is None:
                self._starts.pop(rid, None)
                self._ready.discard(rid)
                self._close_asked.pop(rid, None)
                self.leader.broadcast(ShardAbort(round_ids=(rid,), reason="shard 0 aborted"))
                self.plane.abort(rid, "shard 0 aborted it")
                self.plane.forget(rid)

    def _on(self, event: LeaderEvent) -> None:
        now = self._clock()
        if isinstance(event, ShardInitial):
            self._report_initial(event)
        elif isinstance(event, Ready):
            self._ready.add(event.round_id)
            self._send_starts()
        elif isinstance(event, Joined | Lost):
            what = "lost" if isinstance(event, Lost) else "joined"
            if self.plane.in_flight():
                self._abort(self.leader.abort_in_flight(f"shard {event.shard} {what}"), what)
        elif isinstance(event, CloseAll):
            self._close(now, event)
        elif isinstance(event, AbortAll):
            self.leader.broadcast(ShardAbort(round_ids=(event.round_id,), reason=event.why))
            self._abort((event.round_id,), event.why)
        else:
            self._commit(event)

    def _report_initial(self, report: ShardInitial) -> None:
        try:
            decided = self.initials.add(report)
        except ValueError as exc:
            log.warning("[coordinator shard=0] %s", exc)
            return
        for done in decided:
            claim = self.coord.intake.claims.get(done.site_id, (-1, ""))
            if done.state_hash and claim[0] == 0 and claim[1] not in ("", done.state_hash):
                why = (
                    f"its parts make θ0 {done.state_hash[:16]}, the site joined holding "
                    f"{claim[1][:16]}"
                )
                done = replace(done, state_hash="", shapes={}, reason=why)
            self._initial_done(done)

    def _initial_done(self, done: ShardInitialDone) -> None:
        """Every shard told shard 0's word on a site's θ0, and shard 0 does as it says; a site
        whose upload is dropped is told why."""
        self.leader.broadcast(done)
        if self._take_initial(done):
            self.committed = 0
            return
        member = self.coord.membership.get(done.site_id)
        if member is not None and not done.state_hash:
            detail = f"initial parameters not taken: {done.reason}"
            self.coord.post.reject(member.peer, ErrorCode.MODEL_MISMATCH, detail, done.site_id)

    def _cut(self, parts: Sequence[Sequence[str]]) -> None:
        super()._cut(parts)
        self.plane.parts = tuple(frozenset(p) for p in parts)
        self.leader.partition = self.partition

    def _send_starts(self) -> None:
        """The plans of the rounds every shard opened, once the version they name is
        committed, oldest first."""
        for rid in sorted(self._ready & set(self._starts)):
            version, send = self._starts[rid]
            if version > self.committed:
                return
            del self._starts[rid]
            self._ready.discard(rid)
            send()

    def _abort(self, ids: tuple[int, ...], why: str) -> None:
        """Rounds the plane aborted, aborted here too (the sites told); a version saved for one
        of them is dropped."""
        if self._closed_here(ids) is not None:
            self._go_back(self.committed, why)
        for i in ids:
            self._starts.pop(i, None)
            self._ready.discard(i)
            self._close_asked.pop(i, None)
            self.plane.forget(i)
        book = self.coord.book
        if any(book.open_round(i) is not None for i in ids):
            decision: Abort = book.abort(f"shards: {why}")
            self.coord.opening.abort(decision)

    def _aborted_open(self, decision: Abort) -> None:
        self.coord.opening.abort(decision)  # the sites told

    def _close(self, now: float, event: CloseAll) -> None:
        book, rid = self.coord.book, event.round_id
        r = book.open_round(rid)
        if r is None or rid not in self.plane.in_flight():
            # A shard lost or back in the same step as the last freeze answer: the round was
            # aborted on every shard before its close was read, so there is nothing to close.
            log.warning("[coordinator shards] round %d aborted before its close was read", rid)
            return
        for site_id, why in event.left_out:
            self._left_out(rid, site_id, why)
        leave_out(r, event.merged)
        merged = tuple(s for s in r.participants if s in event.merged)
        decision = book.close(r, merged, self._why.pop(rid, "every shard holds the same"))
        self._close_asked.pop(rid, None)
        st = self.coord.state
        assert st is not None and r.plan is not None
        inner_steps = sum(int(h["num_inner_steps"]) for h in st.history) + r.plan.num_inner_steps
        self.leader.broadcast(
            ShardClose(round_id=rid, merged=merged, inner_steps=inner_steps, final=decision.final)
        )
        self.coord.carry_out(now, decision)

    def _left_out(self, round_id: int, site_id: str, why: str) -> None:
        """A site's update merged on no shard: refused as a single coordinator refuses an
        update (an Error to the site, counted by reason), why said."""
        detail = f"round {round_id}: update left out on every shard: {why}"
        member = self.coord.membership.get(site_id)
        if member is not None:
            self.coord.post.reject(member.peer, ErrorCode.BAD_PAYLOAD, detail, site_id, "left_out")
            return
        self.coord.metrics.rejected.labels(reason="left_out").inc()
        log.warning("[coordinator site=%s] rejected: left_out: %s", site_id, detail)

    def _commit(self, event: CommitAll) -> None:
        """Every shard saved the round: the commit record, then every shard announces."""
        path = self.coord.sections.state.path
        if path is not None:
            shard_commit.write(path, shard_commit.Committed(event.version, event.combined_hash))
        self.committed = event.version
        model = self.coord.model
        model.whole_hash = (event.version, event.combined_hash)
        self.leader.broadcast(
            ShardCommit(
                round_id=event.round_id,
                global_version=event.version,
                state_hash=event.combined_hash,
                shard_hashes=event.shard_hashes,
            )
        )
        saved = self._saved.pop(event.round_id)
        r = self.coord.book.closed.get(event.round_id)
        base = r.base_version if r is not None else event.version - 1
        saved.announce(event.combined_hash, model.sign(event.version, base, 0, event.combined_hash))
        self.plane.forget(event.round_id)
        self._send_starts()


class FollowShard(_Shard):
    """Shards 1 to S-1 (see the module doc)."""

    def __init__(
        self,
        coord: Coordinator,
        identity: ShardIdentity,
        parts: Sequence[Sequence[str]] | None,
        *,
        kit: CoordinatorKit | None,
        control_endpoint: str,
        whole_hash0: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(coord, identity, parts, whole_hash0=whole_hash0)
        if identity.leader:
            raise ValueError("shard 0 leads; it does not follow")
        self._clock = clock
        self._control_endpoint = control_endpoint
        channel = coord.sections.post.channel
        self._timeout_s = channel.heartbeat_timeout_s
        self.client = ShardClient(channel, kit, identity.index)
        self.follower = ShardFollower(
            self.client,
            shard=identity.index,
            shards=identity.count,
            partition=self.partition,
            held=self._held,
            interval_s=channel.heartbeat_interval_s,
            clock=clock,
        )
        self._final_round: int | None = None
        """The run's last round, once shard 0 closed it."""
        self._out_of_step: ShardOpen | None = None
        """A round shard 0 opened on another version than this shard's: opened once this
        shard met shard 0 again (it missed an abort, or a commit)."""
        self._resynced = -1
        """The last round whose opening made this shard meet shard 0 again."""
        self._final_at: float | None = None
        coord.decides = False
        coord.intake.on_update = self._on_update
        coord.intake.any_initiator = True  # shard 0 asked the site

    def _held(self) -> tuple[int, int]:
        st = self.coord.state
        return (-1, 0) if st is None else (st.global_version, self.coord.book.round_counter)

    def start(self) -> str:
        endpoint = self._start_coordinator()
        self.client.connect(self._control_endpoint)
        log.info(
            "[coordinator shard=%d/%d] following shard 0 at %s",
            self.identity.index,
            self.identity.count,
            self._control_endpoint,
        )
        return endpoint

    def close(self) -> None:
        self.coord.close()
        self.client.close()

    def step(self, timeout_s: float) -> None:
        self.coord.step(timeout_s / 2)
        events: list[FollowerEvent] = self.follower.poll(timeout_s / 2)
        for _ in range(16):
            if not events:
                break
            for event in events:
                self._on(event)
            events = self.follower.poll(0.0)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        """After the run's last round is announced: once every site left, or shard 0 fell
        silent (it finished and closed)."""
        if self._final_at is None:
            return
        heard = self.follower.heard_at or self._final_at
        if not self.coord.membership or self._clock() - heard > self._timeout_s:
            self.coord.finished = True

    # ---- hooks -------------------------------------------------------------------------------

    def _on_update(self, msg: Update, refused: str | None) -> None:
        if refused is not None and self._live(msg.round_id) is None:
            return
        self.follower.report(
            ShardFolded(
                shard=self.identity.index,
                round_id=msg.round_id,
                site_id=msg.site_id,
                accepted=refused is None,
                detail=refused or "",
                squared_norm=self._squared_norm(msg) if refused is None else 0.0,
            )
        )

    def _report_initial(self, report: ShardInitial) -> None:
        self.follower.report(report)

    def _cut(self, parts: Sequence[Sequence[str]]) -> None:
        super()._cut(parts)
        self.follower.partition = self.partition

    def _on_saved(self, saved: Saved) -> None:
        if self._void_save(saved):
            return
        self._saved[saved.round_id] = saved
        digests = {name: d.hex() for name, d in saved.digests().items()}
        self.follower.report(
            ShardPrepared(
                shard=self.identity.index,
                round_id=saved.round_id,
                global_version=saved.version,
                digests=digests,
            )
        )

    # ---- what shard 0 says -------------------------------------------------------------------

    def _on(self, event: FollowerEvent) -> None:
        i, book = self.identity.index, self.coord.book
        try:
            if isinstance(event, Resumed):
                if event.resume.roll_back:
                    self._go_back(event.resume.version, "shard 0 never committed it")
                self._met_again(event.resume.version)
                counter = event.round_counter
                if self._out_of_step is not None:  # shard 0 counted the round to open again
                    counter = min(counter, self._out_of_step.round_id - 1)
                book.round_counter = max(book.round_counter, counter)
                if event.state_hash:
                    self._known(event.resume.version, event.state_hash, met=True)
            elif isinstance(event, Heard):
                self._heard(event)
            elif isinstance(event, ShardOpen):
                st = self.coord.state
                assert st is not None
                tensors = {n: tuple(v.shape) for n, v in st.params.items()}
                open_as_told(book, self._clock(), event, tensors)
                self.coord.model.issue_round(event.round_id)  # durable before it is said
                opened = ShardOpened(shard=i, round_id=event.round_id)
                self.coord.post.later(lambda: self.follower.report(opened))
            elif isinstance(event, ShardFreeze):
                folded = freeze(book, event.round_id)
                self.follower.report(
                    ShardFrozen(shard=i, round_id=event.round_id, folded=tuple(sorted(folded)))
                )
            elif isinstance(event, ShardClose):
                self.coord.carry_out(self._clock(), close_as_told(book, event))
                if event.final:
                    self._final_round = event.round_id
            elif isinstance(event, ShardCommit):
                self._commit(event)
            elif isinstance(event, ShardInitialDone):
                self._take_initial(event)
            else:
                r = self._closed_here(event.round_ids)
                if r is not None:
                    self._go_back(r.base_version, f"shard 0: {event.reason}")
                aborted = abort_as_told(book, event)
                if aborted is not None:
                    log.warning(
                        "[coordinator shard=%d] rounds %s aborted: %s",
                        i,
                        aborted.round_ids,
                        event.reason,
                    )
        except ValueError as exc:
            log.error("[coordinator shard=%d] out of step with shard 0: %s", i, exc)
            if isinstance(event, ShardOpen) and event.round_id != self._resynced:
                # A decision it missed (the transport gave it up): meet shard 0 again (its
                # next answer says the version it committed), then open the round.
                self._out_of_step, self._resynced = event, event.round_id
                self.follower.resumed = None
        if isinstance(event, Resumed) and self._out_of_step is not None:
            again, self._out_of_step = self._out_of_step, None
            self._on(again)

    def _met_again(self, version: int) -> None:
        """Shard 0 (started again) runs ``version``: the rounds open here are none of its own
        any more, and a save it committed before it stopped is announced by no commit."""
        for rid in [r for r in self._saved if r <= version]:
            del self._saved[rid]
        if self.coord.book.open_rounds:
            aborted = self.coord.book.abort("shard 0 started again")
            log.warning(
                "[coordinator shard=%d] rounds %s aborted: %s",
                self.identity.index,
                aborted.round_ids,
                aborted.why,
            )

    def _known(self, version: int, digest: str, *, met: bool = False) -> None:
        """The whole model's hash at ``version``, committed: the sites know it by it; recorded
        for this shard's next start (its delta log's chain ends at it). ``met``: shard 0 said
        it at a hello (the delta log is resumed under it); else a commit about to be announced
        (the announcement extends the log)."""
        if met:
            self.coord.model.known_as(version, digest)
        else:
            self.coord.model.whole_hash = (version, digest)
        path = self.coord.sections.state.path
        if path is not None:
            shard_commit.write(path, shard_commit.Committed(version, digest))

    def _heard(self, event: Heard) -> None:
        """Shard 0 committed the version this shard saved, and its commit never came (the
        transport gave it up): committed here too, under the hash shard 0 says."""
        saved = next((s for s in self._saved.values() if s.version == event.version), None)
        if saved is None or not event.state_hash:
            return
        log.warning(
            "[coordinator shard=%d] round %d committed by shard 0, its commit never came",
            self.identity.index,
            saved.round_id,
        )
        commit = ShardCommit(
            round_id=saved.round_id,
            global_version=saved.version,
            state_hash=event.state_hash,
            shard_hashes=(),
        )
        self._commit(commit)

    def _commit(self, event: ShardCommit) -> None:
        saved = self._saved.pop(event.round_id, None)
        if saved is None:
            log.error(
                "[coordinator shard=%d] commit of round %d, which it never saved",
                self.identity.index,
                event.round_id,
            )
            return
        self._known(event.global_version, event.state_hash)
        saved.announce(event.state_hash, b"")
        if self._final_round == event.round_id:
            self._final_at = self._clock()


def build_shard(
    cfg: CoordinatorConfig,
    identity: ShardIdentity,
    initial: InitialModel | DescribedModel | None,
    env: Mapping[str, str],
) -> LeadShard | FollowShard:
    """Shard ``identity`` of the federation's ``cfg`` (the one ``[coordinator]`` table every
    shard reads): a Coordinator of its own config (``coordinator.sharding.shard_config``) and
    part of θ0, and its end of the control plane. ``initial`` is θ0 whole (the shard keeps its
    part), or only the shard's part with the whole θ0's shapes and state hash
    (``InitialModel.whole``, as ``coordinator.sharding.keep_part`` draws it without ever holding
    the rest), or described (``coordinator.initial_model.DescribedModel``, built into such a
    part): built here only where the shard's state directory has no record of the model's cut
    (``coordinator.shard_initial.write_record``, written once the shard's state holds θ0), else
    left to the coordinator's start, which builds it only if it needs it. None: the first site
    to join uploads θ0, each shard its part (``coordinator.shard_initial``)."""
    own_cfg = shard_config(cfg, identity)
    path = Path(own_cfg.state_dir) if own_cfg.state_dir else None
    recorded = read_record(path) if path is not None else None
    has_state = path is not None and (path / META_FILE).exists()
    whole: WholeModel | None = None
    if initial is not None and (initial.digest is None or recorded is None or not has_state):
        # The cut from θ0 (none recorded yet, θ0 given built, or θ0 about to be installed).
        theta0 = initial.built()
        whole = theta0.whole
        if whole is None:  # θ0 whole: this shard keeps its part
            shapes = {name: tuple(v.shape) for name, v in theta0.params.items()}
            whole = WholeModel(shapes, state_hash(theta0.params))
            initial = InitialModel(own_part(theta0.params, shapes, identity), theta0.fingerprint)
        if recorded is not None and recorded.state_hash != whole.state_hash:
            raise ValueError(
                f"{path}/model.json records a θ0 of state hash {recorded.state_hash}, "
                f"but coordinator.initial_model gives {whole.state_hash}: a shard must start "
                "from the θ0 every shard and site holds (restore the shard's state, or start "
                "every shard afresh)"
            )
    parts = partition(whole.shapes, identity.count) if whole is not None else None
    whole_hash0 = whole.state_hash if whole is not None else None
    kit = load_coordinator_kit(cfg.security.kit_dir) if cfg.security.kit_dir else None
    coord = Coordinator(own_cfg, initial=initial)
    shard: LeadShard | FollowShard
    if identity.leader:
        shard = LeadShard(
            coord,
            identity,
            parts,
            kit=kit,
            control_bind=cfg.shard_control_bind,
            whole_hash0=whole_hash0,
        )
    else:
        shard = FollowShard(
            coord,
            identity,
            parts,
            kit=kit,
            control_endpoint=control_endpoint(cfg, env),
            whole_hash0=whole_hash0,
        )
    if whole is not None and recorded is None and path is not None:
        shard.record_cut(whole)
    return shard
