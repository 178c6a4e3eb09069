"""The coordinator's round lifecycle as a pure state machine: random interleavings of joins,
leaves, silence, updates (on time, late, duplicate, wrong), ticks and restarts from the persisted
state, with the invariants checked after every step."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from comm.wire.schema import Update
from coordinator.aggregate import MeanResult
from coordinator.config import RoundsConfig
from coordinator.decisions import Abort, Close, Finish, Open, Remove, Retry
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Membership
from coordinator.round import Taken, UpdateRefusal
from coordinator.rounds import next_fragment

pytestmark = pytest.mark.timeout(120)

SITES = ("a", "b", "c", "d")
SITE_TIMEOUT_S = 5.0


def config(*, overlap: bool, fragments: int, staleness: int, quorum: float) -> RoundsConfig:
    return RoundsConfig(
        min_sites=2,
        quorum_fraction=quorum,
        max_rounds=0,
        max_open=2 if overlap else 1,
        num_fragments=fragments,
        max_staleness_rounds=staleness,
        round_deadline_s=10.0,
        grace_floor_s=1.0,
        grace_ceiling_s=3.0,
    )


def join(book: Lifecycle, now: float, site: str, peer: bytes, *, version: int | None) -> None:
    """A join as the intake records it: the member, and no plan owed to the site any more."""
    book.rejoined(site)
    book.members.join(now, site, peer, in_sync_version=version)


def update(site: str, round_id: int, fragment: int, trained_from: int) -> Update:
    """An update with no tensors (the rounds here cover none)."""
    return Update(
        site_id=site,
        round_id=round_id,
        global_version=trained_from,
        fragment=fragment,
        weight=1.0,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=1.0,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=(),
    )


class LifecycleMachine(RuleBasedStateMachine):
    """The test plays the service: it carries out every decision and keeps a durable record
    (round counter, global version, history) as the real service persists it."""

    @initialize(
        overlap=st.booleans(),
        fragments=st.sampled_from([1, 3]),
        staleness=st.sampled_from([0, 2, 8]),
        quorum=st.sampled_from([0.5, 1.0]),
    )
    def setup(self, overlap: bool, fragments: int, staleness: int, quorum: float) -> None:
        self.cfg = config(overlap=overlap, fragments=fragments, staleness=staleness, quorum=quorum)
        self.now = 0.0
        self.members = Membership(SITE_TIMEOUT_S)
        self.book = Lifecycle(self.cfg, self.members)
        self.book.set_model(0)
        # The durable record.
        self.counter = 0
        self.version = 0
        self.history: list[dict[str, int]] = []
        # What happened.
        self.issued: list[int] = []
        self.closed_ids: list[int] = []
        self.accepted_on_time: dict[int, set[str]] = {}
        self.accepted_late: set[tuple[str, int]] = set()
        self.lost: set[tuple[str, int]] = set()
        self.merged: dict[tuple[str, int], int] = {}

    # ---- events ------------------------------------------------------------------------------

    @rule(site=st.sampled_from(SITES), in_sync=st.booleans())
    def join(self, site: str, in_sync: bool) -> None:
        version = self.book.global_version if in_sync else None
        join(self.book, self.now, site, site.encode(), version=version)
        if not in_sync:  # the service sends the full model at once
            self.members.holds(site, self.book.global_version, in_sync=True)

    @rule(site=st.sampled_from(SITES))
    def leave(self, site: str) -> None:
        self.members.leave(site)

    @rule(site=st.sampled_from(SITES))
    def heartbeat(self, site: str) -> None:
        self.members.touch(self.now, site, site.encode())

    @rule(dt=st.floats(min_value=0.1, max_value=8.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(
        site=st.sampled_from(SITES),
        pick=st.integers(min_value=0, max_value=5),
        wrong_fragment=st.booleans(),
        behind=st.booleans(),
    )
    def update(self, site: str, pick: int, wrong_fragment: bool, behind: bool) -> None:
        candidates = [r.round_id for r in self.book.open_rounds] + sorted(self.book.closed)[-3:]
        candidates += [self.counter + 1]  # a round that was never opened
        round_id = candidates[pick % len(candidates)]
        r = self.book.open_round(round_id)
        done = self.book.closed.get(round_id)
        fragment = r.fragment if r is not None else done.fragment if done is not None else 0
        if wrong_fragment and self.cfg.num_fragments > 1:
            fragment = (fragment + 1) % self.cfg.num_fragments
        trained_from = (r.base_version if r is not None else 0) - (1 if behind else 0)
        if self.members.touch(self.now, site, site.encode()) is None:
            return  # the service refuses a non-member before asking the lifecycle
        taken = self.book.take(self.now, update(site, round_id, fragment, trained_from))
        if isinstance(taken, UpdateRefusal):
            return
        assert isinstance(taken, Taken)
        assert fragment == (r.fragment if r is not None else done.fragment if done else -1)
        key = (site, round_id)
        assert key not in self.accepted_late and site not in self.accepted_on_time.get(round_id, ())
        if taken.late:
            assert r is None and done is not None and done.merged
            self.accepted_late.add(key)
        else:
            assert r is not None and trained_from >= r.base_version
            self.accepted_on_time.setdefault(round_id, set()).add(site)

    @rule()
    def tick(self) -> None:
        for _ in range(16):
            decision = self.book.tick(self.now)
            if decision is None:
                break
            self.carry_out(decision)
        else:
            raise AssertionError("the lifecycle kept deciding without an event in between")
        # Once the tick has run, no open round outlives its participants or its deadline, and
        # no member outlives its timeout.
        for m in self.members.values():
            assert self.now - m.last_seen <= SITE_TIMEOUT_S
        if self.book.open_rounds:
            oldest = self.book.open_rounds[0]
            assert self.now < oldest.deadline_at
            outstanding = set(oldest.participants) - oldest.received
            assert outstanding & (set(self.members) - oldest.dropped)

    @rule()
    def restart(self) -> None:
        """The coordinator dies; a new one resumes from the durable record."""
        for r in self.book.open_rounds:
            self.lost.update((s, r.round_id) for s in self.accepted_on_time.get(r.round_id, ()))
        self.lost.update(self.book.pending_late())
        self.members = Membership(SITE_TIMEOUT_S)
        self.book = Lifecycle.resume(
            self.cfg,
            self.members,
            global_version=self.version,
            round_counter=self.counter,
            completed_rounds=len(self.history),
            next_fragment=next_fragment(self.history, self.cfg.num_fragments),
        )

    # ---- the service's side --------------------------------------------------------------------

    def carry_out(self, decision: object) -> None:
        if isinstance(decision, Open):
            assert decision.round_id == self.counter + 1
            self.counter = decision.round_id  # persisted before the round is announced
            self.issued.append(decision.round_id)
            assert set(decision.participants) <= set(self.members)
            assert decision.base_version < decision.round_id
        elif isinstance(decision, Close):
            r = decision.round
            assert set(decision.merged) == self.accepted_on_time.get(r.round_id, set())
            for site in decision.merged:
                self.merge((site, r.round_id))
            assert all(earlier.fragment == r.fragment for earlier in decision.late)
            for u in r.result(decision.late)[1]:
                self.merge((u.site_id, u.round_id))
            self.version = r.round_id
            self.history.append(
                {
                    "round_id": r.round_id,
                    "fragment": r.fragment,
                    "num_fragments": self.cfg.num_fragments,
                }
            )
            self.closed_ids.append(r.round_id)
            # The service sends the result to every member (a delta or the full model).
            for site in list(self.members):
                self.members.holds(site, r.round_id, in_sync=True)
        elif isinstance(decision, Abort):
            for round_id in decision.round_ids:
                self.lost.update((s, round_id) for s in self.accepted_on_time.get(round_id, ()))
        elif isinstance(decision, Remove):
            assert not set(decision.site_ids) & set(self.members)
        else:
            assert isinstance(decision, Finish | Retry)
            raise AssertionError(f"unexpected {decision}")

    def merge(self, key: tuple[str, int]) -> None:
        self.merged[key] = self.merged.get(key, 0) + 1

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def round_ids_never_reused(self) -> None:
        if hasattr(self, "issued"):
            assert self.issued == sorted(set(self.issued))
            assert self.book.round_counter == self.counter

    @invariant()
    def every_accepted_update_merged_at_most_once(self) -> None:
        if not hasattr(self, "merged"):
            return
        assert all(n == 1 for n in self.merged.values())
        # A merged update was accepted; an on-time update of a closed round was merged.
        for site, round_id in self.merged:
            assert site in self.accepted_on_time.get(round_id, ()) or (site, round_id) in (
                self.accepted_late
            )
        for round_id in self.closed_ids:
            for site in self.accepted_on_time.get(round_id, ()):
                assert (site, round_id) in self.merged
        pending = set(self.book.pending_late())
        for key in self.accepted_late:
            assert (key in self.merged) + (key in pending) + (key in self.lost) >= 1
            assert not (key in self.merged and key in pending)

    @invariant()
    def durable_record_is_consistent(self) -> None:
        if not hasattr(self, "history"):
            return
        assert self.version <= self.counter
        assert self.version == (self.history[-1]["round_id"] if self.history else 0)
        ids = [h["round_id"] for h in self.history]
        assert ids == sorted(set(ids)) and set(ids) <= set(self.issued)
        assert self.book.global_version == self.version
        assert self.book.completed_rounds == len(self.history)

    @invariant()
    def bounded(self) -> None:
        if not hasattr(self, "book"):
            return
        assert len(self.book.open_rounds) <= self.cfg.max_open
        assert len(self.book.closed) <= self.cfg.max_staleness_rounds + 2 + self.cfg.max_open
        for r in self.book.open_rounds:
            assert self.book.fragment_version[r.fragment] <= r.base_version < r.round_id


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_late_update_merges_after_its_closed_round_is_forgotten() -> None:
    # Three fragments and no staleness slack: the late update's round leaves the closed-round
    # memory before its fragment syncs again; the update still merges there, once.
    book = Lifecycle(
        config(overlap=False, fragments=3, staleness=0, quorum=0.5), Membership(SITE_TIMEOUT_S)
    )
    book.set_model(0)
    for site in ("a", "b"):
        join(book, 0.0, site, site.encode(), version=0)
    opened = book.tick(0.0)
    assert isinstance(opened, Open) and opened.fragment == 0
    assert isinstance(book.take(0.0, update("a", opened.round_id, 0, 0)), Taken)
    closed = book.tick(5.0)  # quorum 1 of 2 and the grace floor passed
    assert isinstance(closed, Close) and closed.merged == ("a",)
    for site in ("a", "b"):
        book.members.holds(site, closed.round.round_id, in_sync=True)
    taken = book.take(5.0, replace(update("b", opened.round_id, 0, 0), weight=3.0))
    assert isinstance(taken, Taken) and taken.late
    now = 5.0
    for fragment in (1, 2, 0):
        for site in ("a", "b"):
            book.members.touch(now, site, site.encode())
        o = book.tick(now)
        assert isinstance(o, Open) and o.fragment == fragment
        for site in ("a", "b"):
            assert isinstance(
                book.take(now, update(site, o.round_id, fragment, o.base_version)), Taken
            )
        c = book.tick(now)
        assert isinstance(c, Close)
        for site in ("a", "b"):
            book.members.holds(site, c.round.round_id, in_sync=True)
        if fragment == 0:
            assert opened.round_id not in book.closed
            late = [(u.site_id, r.round_id) for r in c.late for u in r.late_waiting]
            assert late == [("b", opened.round_id)]
            # The close merges it, once: 1 + one sync of its fragment missed halves its weight.
            result, merged = c.round.result(c.late)
            assert merged == [taken.update]
            assert isinstance(result, MeanResult)
            assert [(label, weight) for label, weight, _ in result.updates] == [
                (f"round {c.round.round_id}", 2.0),
                (f"late@{opened.round_id}", 3.0 / 2),
            ]
            assert c.late[0].late_waiting == [] and c.late[0].late_fold is None
        else:
            assert c.late == ()
    assert book.pending_late() == [] and book.late == {}


@pytest.mark.parametrize(("quorum", "expected"), [(0.5, Close), (1.0, Abort)])
def test_a_participant_that_joins_again_no_longer_holds_its_round(
    quorum: float, expected: type
) -> None:
    # A site restarted mid-round joins again at once (its silence never reaches the timeout);
    # it holds no plan now, so the round must not wait for it until the deadline.
    book = Lifecycle(
        config(overlap=False, fragments=1, staleness=2, quorum=quorum), Membership(SITE_TIMEOUT_S)
    )
    book.set_model(0)
    for site in ("a", "b"):
        join(book, 0.0, site, site.encode(), version=0)
    opened = book.tick(0.0)
    assert isinstance(opened, Open)
    assert book.awaiting("a") == book.awaiting("b") == (opened.round_id,)
    assert isinstance(book.take(0.1, update("a", opened.round_id, 0, 0)), Taken)
    assert book.tick(0.2) is None  # b is still expected
    assert (book.awaiting("a"), book.awaiting("b")) == ((), (opened.round_id,))
    join(book, 0.3, "b", b"b-restarted", version=0)
    assert book.awaiting("b") == ()  # dropped: no plan is owed to it any more
    decision = book.tick(0.3)
    assert isinstance(decision, expected), decision
    if isinstance(decision, Close):
        assert decision.merged == ("a",)
