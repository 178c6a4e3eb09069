"""The site's round state machine (site_agent.rounds) under random interleavings of events.

A model of what the coordinator said (every cancel, every plan) checks, after every step, that
a cancelled round is never trained or sent, no round is sent twice, the machine never waits on
the result of a cancelled round, and its state stays bounded.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from comm.wire.schema import RoundStart
from site_agent.rounds import MAX_CANCELLED, MAX_PENDING, Drop, Send, SiteRounds, Stop, Train, Wait

pytestmark = pytest.mark.timeout(120)


def plan(round_id: int, *, overlap: bool, fragments: int) -> RoundStart:
    # Fragment f of round r is sent on top of fragment f's previous result: round r - fragments.
    return RoundStart(
        round_id=round_id,
        global_version=round_id - 1,
        fragment_base_version=max(0, round_id - fragments),
        fragment=round_id % fragments,
        num_fragments=fragments,
        num_inner_steps=10,
        overlap=overlap,
        codec="fp32",
        deadline_s=60.0,
        participants=("eu",),
        evaluate=False,
        reason="test",
    )


class RoundsMachine(RuleBasedStateMachine):
    overlap = True
    fragments = 1

    def __init__(self) -> None:
        super().__init__()
        self.m = SiteRounds(global_version=0)
        self.next_round = 1
        self.cancelled: set[int] = set()  # every round ever cancelled
        self.sent: list[int] = []
        self.trained: list[int] = []

    # ---- the coordinator's side (any order, repeats included) --------------------------

    @rule(data=st.data())
    def round_start(self, data: st.DataObject) -> None:
        # Mostly the next round; sometimes a repeat or a plan from the past.
        rid = data.draw(st.sampled_from([self.next_round, self.next_round, self.next_round - 1]))
        rid = max(1, rid)
        self.next_round = max(self.next_round, rid + 1)
        self.m.round_start(plan(rid, overlap=self.overlap, fragments=self.fragments))

    @rule(data=st.data())
    def round_cancel(self, data: st.DataObject) -> None:
        lo = max(1, self.next_round - 4)
        ids = data.draw(st.lists(st.integers(lo, self.next_round), min_size=1, max_size=3))
        self.cancelled |= set(ids)
        self.m.round_cancel(ids)

    @rule(data=st.data())
    def global_applied(self, data: st.DataObject) -> None:
        version = data.draw(st.integers(self.m.global_version, self.next_round))
        self.m.global_applied(version)

    @rule()
    def rejoin(self) -> None:
        self.m.rejoin()

    @precondition(lambda self: self.next_round > 40)
    @rule()
    def shutdown(self) -> None:
        self.m.shutdown()
        assert isinstance(self.m.next_action(), Stop)

    # ---- the site's side ---------------------------------------------------------------

    @precondition(lambda self: self.m.training is None)
    @rule()
    def between_rounds(self) -> None:
        d = self.m.next_action()
        if isinstance(d, Train):
            assert d.plan.round_id not in self.cancelled, "trains a cancelled round"
            self.trained.append(d.plan.round_id)
        else:
            assert isinstance(d, Wait | Drop | Stop)

    @precondition(lambda self: self.m.training is not None)
    @rule()
    def slot_trained(self) -> None:
        d = self.m.slot_done()
        if isinstance(d, Send):
            rid = d.plan.round_id
            assert rid not in self.cancelled, "sends a cancelled round"
            assert rid not in self.sent, "sends a round twice"
            self.sent.append(rid)
        else:
            assert isinstance(d, Wait | Drop | Stop)

    # ---- after every step ----------------------------------------------------------------

    @invariant()
    def never_awaits_a_cancelled_round(self) -> None:
        assert self.m.awaiting is None or self.m.awaiting not in self.cancelled

    @invariant()
    def a_blocked_slot_waits_only_for_a_live_round(self) -> None:
        t = self.m.training
        if t is not None and self.m.global_version < t.fragment_base_version:
            # Blocked on the base version: only while the round itself is not cancelled.
            assert t.round_id not in self.cancelled or isinstance(self.m.slot_done(), Drop | Stop)

    @invariant()
    def state_is_bounded(self) -> None:
        assert len(self.m.pending) <= MAX_PENDING
        assert len(self.m.cancelled) <= MAX_CANCELLED
        assert all(r > self.m.global_version for r in self.m.cancelled)

    @invariant()
    def plans_are_kept_in_order_once(self) -> None:
        ids = [p.round_id for p in self.m.pending]
        assert ids == sorted(set(ids))


def _case(overlap: bool, fragments: int) -> type:
    machine = type(
        f"Rounds_overlap{overlap}_f{fragments}",
        (RoundsMachine,),
        {"overlap": overlap, "fragments": fragments},
    )
    machine.TestCase.settings = settings(
        max_examples=40, stateful_step_count=40, deadline=None, derandomize=True
    )
    return machine.TestCase


TestOverlap1 = _case(True, 1)
TestOverlap3 = _case(True, 3)
TestNoOverlap1 = _case(False, 1)
TestNoOverlap3 = _case(False, 3)


def test_without_overlap_it_waits_for_the_result_then_trains_on() -> None:
    m = SiteRounds(global_version=0)
    m.round_start(plan(1, overlap=False, fragments=1))
    m.round_start(plan(2, overlap=False, fragments=1))
    assert isinstance(m.next_action(), Train)
    assert isinstance(m.slot_done(), Send)
    assert isinstance(m.next_action(), Wait)  # round 1's result first
    m.global_applied(1)
    d = m.next_action()
    assert isinstance(d, Train) and d.plan.round_id == 2


def test_a_cancel_of_the_awaited_round_releases_the_wait() -> None:
    m = SiteRounds(global_version=0)
    m.round_start(plan(1, overlap=False, fragments=1))
    m.next_action()
    m.slot_done()
    m.round_cancel([1])
    m.round_start(plan(2, overlap=False, fragments=1))
    d = m.next_action()
    assert isinstance(d, Train) and d.plan.round_id == 2


def test_a_rejoin_during_a_slot_drops_that_round() -> None:
    m = SiteRounds(global_version=0)
    m.round_start(plan(1, overlap=True, fragments=1))
    m.next_action()
    m.rejoin()
    m.round_start(plan(2, overlap=True, fragments=1))
    assert m.slot_done() == Drop(1, "abandoned")
    d = m.next_action()
    assert isinstance(d, Train) and d.plan.round_id == 2


def test_the_slot_waits_for_its_fragment_base_unless_cancelled() -> None:
    m = SiteRounds(global_version=0)
    m.round_start(plan(4, overlap=True, fragments=3))  # base: round 1's result
    m.next_action()
    assert isinstance(m.slot_done(), Wait)
    m.round_cancel([4])
    assert isinstance(m.slot_done(), Drop)
