"""Models and plans owed to one site: plans sent again after a silence or a failed send, the
deltas a site missed when it is heard from, and catch-up from the delta log after a rejoin or a
coordinator restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from comm.wire.schema import (
    Global,
    RoundStart,
)
from coordinator.state import MemoryStateStore
from tests.support.coordinator import (
    D_EU,
    D_US,
    ManualClock,
    Reset,
    heard,
    join,
    land,
    merge_round,
    on_base,
    plans_resent,
    running,
    start_round,
    two_rounds,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.timeout(60)
def test_a_site_heard_from_after_a_silence_gets_the_plans_it_owes_again() -> None:
    clock = ManualClock()
    with running(clock=clock) as h:  # heartbeat timeout 10 s, site timeout 30 s
        eu, us, rs = start_round(h)
        land(h, eu, rs, D_EU)  # round 1 now waits on us only
        clock.now += 9.9  # shorter than the heartbeat timeout: the connection held, nothing lost
        assert heard(h, us) == [] and heard(h, eu) == []
        clock.now += 10.0  # as long as the heartbeat timeout: what was in flight may be lost
        again = heard(h, us)
        assert [type(m) for m in again] == [RoundStart], again
        plan = again[0]
        assert isinstance(plan, RoundStart)
        assert (plan.round_id, plan.participants, plan.num_inner_steps) == (1, ("eu", "us"), 3)
        assert heard(h, eu) == []  # eu sent its update: the round owes it nothing
        assert plans_resent(h.coord) == 1
        # The plan sent again is the plan: us's update for it closes the round.
        us.send(on_base("us", plan, D_US))
        assert h.expect(eu, Global).global_version == 1
        assert h.expect(us, RoundStart).round_id == 2  # blocking: round 2 opens on the result
        clock.now += 10.0
        # us owes round 2 and gets its plan again; nothing of the closed round 1 is sent again.
        again = heard(h, us)
        assert [m.round_id for m in again if isinstance(m, RoundStart)] == [2], again
        assert plans_resent(h.coord) == 2


@pytest.mark.timeout(60)
def test_a_site_a_result_failed_to_reach_gets_the_deltas_when_heard_from() -> None:
    with running() as h:  # blocking rounds, both sites needed
        eu, us, rs = start_round(h)
        reset = Reset(h, "us")
        assert merge_round(h, eu, us, rs).global_version == 1
        h.until(lambda: reset.dropped == 1)
        # us missed v1, so it is not in sync, and round 2 (both sites needed) cannot open: the
        # federation would wait for us for good.
        assert not h.coord.members["us"].in_sync and h.coord.members["us"].global_version == 0
        assert h.coord.open_rounds == []
        reset.on = False
        got = heard(h, us)  # the connection is back: us is sent what it missed
        assert [type(m) for m in got] == [Global], got
        delta = got[0]
        assert isinstance(delta, Global)
        assert (delta.is_full, delta.base_version, delta.global_version) == (False, 0, 1)
        assert h.coord.members["us"].in_sync and h.coord.members["us"].global_version == 1
        plan: RoundStart = h.expect(us, RoundStart)
        assert (plan.round_id, plan.participants) == (2, ("eu", "us"))
        assert heard(h, us) == []  # once


@pytest.mark.timeout(60)
def test_a_plan_that_failed_to_reach_a_site_is_sent_when_it_is_heard_from() -> None:
    with running() as h:
        eu, us, rs = start_round(h)
        reset = Reset(h, "us", RoundStart)
        merge_round(h, eu, us, rs)
        h.expect(us, Global)
        plan_eu: RoundStart = h.expect(eu, RoundStart)
        assert reset.dropped == 1 and plan_eu.participants == ("eu", "us")
        reset.on = False
        got = heard(h, us)
        assert [(type(m), getattr(m, "round_id", 0)) for m in got] == [(RoundStart, 2)], got
        assert heard(h, us) == []
        assert plans_resent(h.coord) == 1


def test_after_a_coordinator_restart_a_site_behind_still_gets_deltas(tmp_path: Path) -> None:
    """The delta log is durable: a site that missed the last broadcast before the coordinator
    restarted catches up by the delta, not the model."""
    store = MemoryStateStore()
    with running(store=store, state_dir=str(tmp_path), downlink_codec="int8") as h:
        _, us, g1, g2 = two_rounds(h)
    with running(store=store, state_dir=str(tmp_path), downlink_codec="int8") as h:
        us2 = h.site("us")
        welcome = join(h, us2, version=g1.global_version, digest=g1.state_hash)
        assert not welcome.need_init and welcome.global_version == g2.global_version
        got: Global = h.expect(us2, Global)
        assert not got.is_full and got.base_version == g1.global_version
        assert got.state_hash == g2.state_hash and got.signature == g2.signature
        for a, b in zip(got.payload, g2.payload, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=True))
        assert h.coord.metrics.registry.get_sample_value("crossdc_catch_up_deltas_total") == 1.0


def test_a_site_that_rejoins_behind_gets_the_deltas_since_its_version() -> None:
    with running(downlink_codec="int8") as h:
        _, us, g1, g2 = two_rounds(h)
        h.expect(us, Global)
        # us restarts from its checkpoint at v1 (it missed nothing else) and joins again: its
        # old connection closes, the new one has a new routing id.
        us.chan.close()
        us2 = h.site("us")
        welcome = join(h, us2, version=g1.global_version, digest=g1.state_hash)
        assert not welcome.need_init and welcome.global_version == g2.global_version
        got: Global = h.expect(us2, Global)
        assert not got.is_full and got.base_version == g1.global_version
        assert got.global_version == g2.global_version and got.state_hash == g2.state_hash
        assert not got.evaluate  # the very delta broadcast, without the evaluation request
        for a, b in zip(got.payload, g2.payload, strict=True):
            assert a.codec == b.codec == "int8" and a.meta == b.meta
            assert all(np.array_equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=True))
        assert h.coord.metrics.registry.get_sample_value("crossdc_catch_up_deltas_total") == 1.0
        assert h.coord.book.members["us"].in_sync
        # A site whose v1 is not the federation's gets the whole model instead.
        ap = h.site("ap")
        join(h, ap, version=g1.global_version, digest="not-v1")
        full: Global = h.expect(ap, Global)
        assert full.is_full and full.state_hash == g2.state_hash
