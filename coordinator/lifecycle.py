"""The coordinator's round lifecycle: the decisions, when to open, close, retry or abort.

:class:`Lifecycle` keeps the round counter and which rounds are live: those open, oldest
first, and the closed ones that can still take late updates. What a round gathered is the
:class:`~coordinator.round.Round`'s own; the lifecycle routes each update to its round (``take``)
and reads the rounds, and the :class:`~coordinator.membership.Membership` it is given (who is
ready, who fell silent), to decide. Events go in (``take``, ``rejoined``, ``tick``, ``retry``,
restart through ``Lifecycle.resume``); decisions come out (:class:`Open`,
:class:`Close`, :class:`Retry`, :class:`Abort`, :class:`Finish`, :class:`Remove`), each with a
reason. It holds no socket and reads no clock (``now`` is an argument); the service carries the
decisions out, in the order given.

A coordinator of several shards closes a round only once every shard holds the same updates
(``coordinator.shard_plane``); it gives the lifecycle a :class:`RoundGate`, which says whose
updates count as received (every shard took their part) and holds a close until the shards
agree (the gate then closes it with :meth:`Lifecycle.close`). Without a gate (one coordinator
process) a close is decided and applied at once.

A decision's transition is applied when it is returned: the service must carry it out before it
handles the next event (the round counter of an :class:`Open` is persisted before any site hears
of the round; the state of a :class:`Close` is persisted before its result is announced).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from comm.wire.schema import ErrorCode, Update
from coordinator.aggregate import Aggregator, Fold, WeightedMean
from coordinator.config import RoundsConfig
from coordinator.decisions import Abort, Close, Decision, Finish, Open, Remove, Retry
from coordinator.membership import Membership
from coordinator.round import Charge, Round, Taken, UpdateRefusal
from coordinator.rounds import (
    Action,
    OpenRound,
    RoundPolicy,
    RoundSnapshot,
    decide,
    grace_window,
    quorum_size,
)


class RoundGate(Protocol):
    """How a coordinator of several shards takes part in the lifecycle's decisions."""

    def complete(self, r: Round) -> frozenset[str]:
        """The sites of ``r`` whose update counts as received (every shard took its part)."""
        ...

    def hold_close(self, now: float, r: Round, merged: tuple[str, ...], why: str) -> bool:
        """The lifecycle would close ``r`` over ``merged``: True holds the close (the gate
        closes it later with :meth:`Lifecycle.close`, or aborts it)."""
        ...


@dataclass
class Lifecycle:
    """The rounds of one coordinator; see the module docstring."""

    cfg: RoundsConfig
    members: Membership
    """Read to decide (who is ready, who is alive); silent members are removed by ``tick``."""
    aggregator: Aggregator = field(default_factory=WeightedMean)
    """How every round aggregates (its folds; whether rounds are whole)."""
    global_version: int = -1
    """-1 until the initial parameters exist."""
    round_counter: int = 0
    completed_rounds: int = 0
    next_fragment: int = 0
    fragment_version: dict[int, int] = field(default_factory=dict)
    open_rounds: list[Round] = field(default_factory=list)
    closed: dict[int, Round] = field(default_factory=dict)
    """Closed and aborted rounds within the staleness horizon: they judge late updates."""
    late: dict[int, Round] = field(default_factory=dict)
    """Closed rounds with late updates waiting for their fragment's next sync (maybe beyond
    the horizon by then)."""
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    finishing: bool = False
    gate: RoundGate | None = None
    """A coordinator of several shards' say in closes (see the module doc); None: one process."""

    # ---- restart from disk ---------------------------------------------------------------------

    @classmethod
    def resume(
        cls,
        cfg: RoundsConfig,
        members: Membership,
        *,
        aggregator: Aggregator | None = None,
        global_version: int,
        round_counter: int,
        completed_rounds: int,
        next_fragment: int,
    ) -> Lifecycle:
        """The lifecycle of a coordinator restarted from durable state (see ``restore``)."""
        book = cls(cfg, members, aggregator or WeightedMean())
        book.restore(
            global_version=global_version,
            round_counter=round_counter,
            completed_rounds=completed_rounds,
            next_fragment=next_fragment,
        )
        return book

    def restore(
        self, *, global_version: int, round_counter: int, completed_rounds: int, next_fragment: int
    ) -> None:
        """A coordinator restarted from durable state: no member, no open round (sites rejoin),
        the counter where it was (ids are never reused)."""
        assert not self.members and not self.open_rounds, "restore a fresh lifecycle only"
        self.set_model(global_version)
        self.round_counter = round_counter
        self.completed_rounds = completed_rounds
        self.next_fragment = next_fragment % self.cfg.num_fragments

    def set_model(self, global_version: int) -> None:
        """The global model exists at ``global_version`` (initial parameters, or loaded)."""
        self.global_version = global_version
        self.fragment_version = dict.fromkeys(range(self.cfg.num_fragments), global_version)

    # ---- members joining again ---------------------------------------------------------------

    def rejoined(self, site_id: str) -> None:
        """A site joined (or rejoined) holding no plan (it started, or it dropped what a
        coordinator that forgot it had planned): the open rounds it has not sent its update for
        will never get one."""
        for r in self.open_rounds:
            r.drop(site_id)

    # ---- updates -------------------------------------------------------------------------------

    def take(self, now: float, msg: Update, charge: Charge | None = None) -> UpdateRefusal | Taken:
        """An update, to the round it names: refused (nothing changes; ``charge``, what holding
        it costs its sender, is given back), or checked, folded and recorded there, holding the
        charge (``Round.take``)."""
        r = self.open_round(msg.round_id) or self.closed.get(msg.round_id)
        if r is None:
            if charge is not None:
                charge.release()
            return UpdateRefusal(ErrorCode.STALE_ROUND, f"round {msg.round_id} is not open")
        verdict = r.take(
            now,
            msg,
            staleness=self.round_counter - msg.round_id,
            horizon=self.cfg.max_staleness_rounds,
            charge=charge,
        )
        if isinstance(verdict, Taken):
            if verdict.late:
                self.late[r.round_id] = r
            elif verdict.lag_s is not None:
                self.lags.append(verdict.lag_s)
        return verdict

    def pending_late(self) -> list[tuple[str, int]]:
        """(site, round) of each late update waiting for its fragment's next sync, in the order
        they were accepted."""
        waiting = sorted(
            (u for r in self.late.values() for u in r.late_waiting), key=lambda u: u.order
        )
        return [(u.site_id, u.round_id) for u in waiting]

    # ---- the tick ------------------------------------------------------------------------------

    def tick(self, now: float, unconfirmed: frozenset[str] = frozenset()) -> Decision | None:
        """The next decision, its transition applied; None when there is nothing to do.
        ``unconfirmed``: members that have not yet acknowledged the model last sent to them;
        they hold it only once they do, so no round is opened for them before."""
        removed = self.expire(now)
        if removed is not None:
            return removed
        if self.global_version < 0 or self.finishing:
            return None
        grace, _ = grace_window(
            list(self.lags), floor_s=self.cfg.grace_floor_s, ceiling_s=self.cfg.grace_ceiling_s
        )
        snap = RoundSnapshot(
            open_rounds=tuple(self._view(r) for r in self.open_rounds),
            ready=tuple(self.members.ready(self.global_version, unconfirmed)),
            alive=frozenset(self.members),
            completed_rounds=self.completed_rounds,
            grace_s=grace,
        )
        policy = RoundPolicy(
            self.cfg.min_sites, self.cfg.quorum_fraction, self.cfg.max_rounds, self.cfg.max_open
        )
        call, why = decide(now, snap, policy)
        if call.action is Action.OPEN:
            return self._do_open(now, call.participants, why)
        if call.action is Action.CLOSE:
            r = self.open_rounds[0]
            if self.aggregator.whole_rounds and set(call.participants) != set(r.participants):
                return Retry(r, call.participants, why)
            if self.gate is not None and self.gate.hold_close(now, r, call.participants, why):
                return None
            return self._do_close(r, call.participants, why)
        if call.action is Action.ABORT:
            if self.aggregator.whole_rounds:
                r = self.open_rounds[0]
                return Retry(r, tuple(sorted(r.received)), why)
            return self.abort(why)
        if call.action is Action.FINISH:
            self.finishing = True
            return Finish(why)
        return None

    def _view(self, r: Round) -> OpenRound:
        """``r`` as the decision reads it: with a gate, received only what the gate calls
        complete, and no quorum before that many are (the grace after it still runs from when
        this process had the quorum's updates)."""
        view = r.view()
        if self.gate is None:
            return view
        received = view.received & self.gate.complete(r)
        quorum_at = view.quorum_at if len(received) >= r.quorum else None
        return replace(view, received=received, quorum_at=quorum_at)

    def close(self, r: Round, merged: tuple[str, ...], why: str) -> Close:
        """Close the oldest open round ``r`` over ``merged`` now, as ``tick`` would: the
        transition applied, the decision returned (a gate's held close, or a shard told to)."""
        if not self.open_rounds or r is not self.open_rounds[0]:
            raise ValueError(f"round {r.round_id} is not the oldest open round")
        return self._do_close(r, merged, why)

    def undo_close(self, r: Round, version: int) -> None:
        """The close of ``r`` did not hold (a coordinator of several shards aborted it after this
        process saved its result): the model is back at ``version``, ``r`` merged nothing, and
        the rounds opened since, which build on it, are aborted (``abort``)."""
        if r.merged is None or self.closed.get(r.round_id) is not r:
            raise ValueError(f"round {r.round_id} is not a closed round")
        r.abort()
        self.late.pop(r.round_id, None)
        self.global_version = version
        self.fragment_version[r.fragment] = version
        self.completed_rounds -= 1
        self.finishing = False

    def expire(self, now: float) -> Remove | None:
        """Remove the members silent for longer than the site timeout."""
        gone, why = self.members.expire(now)
        return Remove(gone, why) if gone else None

    def retry(self, now: float, r: Round, survivors: tuple[str, ...], fold: Fold) -> None:
        """A whole round starts over with ``survivors`` only, gathering into ``fold``."""
        need = quorum_size(len(survivors), self.cfg.quorum_fraction)
        r.retry(survivors, fold, now + self.cfg.round_deadline_s, need)

    def abort(self, why: str) -> Abort:
        """Cancel every open round (later ones build on the oldest, which cannot complete)."""
        ids = tuple(r.round_id for r in self.open_rounds)
        for r in self.open_rounds:
            r.abort()
            self.closed[r.round_id] = r
        self.open_rounds = []
        self._prune_closed()
        return Abort(ids, why)

    # ---- transitions ---------------------------------------------------------------------------

    def _do_open(self, now: float, participants: tuple[str, ...], why: str) -> Open:
        round_id = self.round_counter + 1
        self.round_counter = round_id
        fragment = self.next_fragment
        self.next_fragment = (fragment + 1) % self.cfg.num_fragments
        # The update must build on the latest result for its fragment, even one still in flight.
        base = max(
            [self.fragment_version[fragment]]
            + [r.round_id for r in self.open_rounds if r.fragment == fragment]
        )
        r = Round(
            round_id=round_id,
            fragment=fragment,
            num_fragments=self.cfg.num_fragments,
            base_version=base,
            participants=participants,
            opened_at=now,
            deadline_at=now + self.cfg.round_deadline_s,
            quorum=quorum_size(len(participants), self.cfg.quorum_fraction),
            aggregator=self.aggregator,
            fold=self.aggregator.fold(round_id, participants),
        )
        self.open_rounds.append(r)
        return Open(r, why)

    def _do_close(self, r: Round, merged: tuple[str, ...], why: str) -> Close:
        late = tuple(
            self.late.pop(k) for k in sorted(self.late) if self.late[k].fragment == r.fragment
        )
        self.open_rounds = [o for o in self.open_rounds if o is not r]
        r.close(merged)
        self.closed[r.round_id] = r
        self._prune_closed()
        self.fragment_version[r.fragment] = r.round_id
        self.global_version = r.round_id
        self.completed_rounds += 1
        final = bool(self.cfg.max_rounds) and self.completed_rounds >= self.cfg.max_rounds
        return Close(r, merged, late, final, why)

    def _prune_closed(self) -> None:
        """Closed rounds older than the staleness horizon take no late update: forget them."""
        horizon = self.round_counter - self.cfg.max_staleness_rounds - 1
        for old in [k for k in self.closed if k < horizon]:
            del self.closed[old]

    def open_round(self, round_id: int) -> Round | None:
        return next((o for o in self.open_rounds if o.round_id == round_id), None)

    def awaiting(self, site_id: str) -> tuple[int, ...]:
        """The open rounds (oldest first) that wait on ``site_id``'s update: it takes part, has
        not sent it, and was not dropped."""
        return tuple(r.round_id for r in self.open_rounds if r.awaits(site_id))
