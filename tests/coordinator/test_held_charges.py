"""The updates a round holds are charged to the peers that sent them (coordinator.allowance):
from arrival until the round's result is taken, the round aborts or a later close takes a late
update; an update that would take its sender past its allowance is refused with an Error and a
counter, and nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from comm.transport.charges import PeerCharges
from comm.wire.schema import Error, ErrorCode, Global
from coordinator.aggregate import WeightedMean
from coordinator.allowance import hold_update
from coordinator.round import Taken, UpdateRefusal
from tests.coordinator.test_round import opened
from tests.coordinator.test_round import update as round_update
from tests.support.coordinator import (
    D_EU,
    D_US,
    Harness,
    ManualClock,
    rejected,
    running,
    start_round,
    update,
)

pytestmark = pytest.mark.timeout(60)

HELD = 4 * (6 + 3)  # D_EU in fp32: w (2, 3) and b (3,)


def _charges(h: Harness) -> PeerCharges:
    chan = h.coord.post.chan
    assert chan is not None
    return chan.charges


def test_an_update_is_charged_to_its_sender_until_its_round_closes(harness: Harness) -> None:
    h = harness
    eu, us, rs = start_round(h)
    charges = _charges(h)
    assert charges.total == 0
    eu.send(update("eu", rs.round_id, D_EU, weight=100.0))
    h.until(lambda: h.coord.open_round is not None and "eu" in h.coord.open_round.received)
    assert charges.total == HELD  # eu's, and nothing else held
    us.send(update("us", rs.round_id, D_US, weight=300.0))
    h.expect(eu, Global)
    assert charges.total == 0


def test_an_update_past_its_senders_allowance_is_refused_and_changes_nothing(
    harness: Harness,
) -> None:
    h = harness
    eu, _us, rs = start_round(h)
    charges = _charges(h)
    allowance = charges.allowance
    charges.allowance = lambda _peer: HELD - 1  # one byte short of eu's update
    before = h.coord.open_round
    eu.send(update("eu", rs.round_id, D_EU))
    err: Error = h.expect(eu, Error)
    assert err.code == int(ErrorCode.OVERSIZE)
    assert "an update to hold until its round closes, of 36 bytes" in err.detail
    assert f"of {HELD} bytes" in err.detail and f"of the {HELD - 1} it may" in err.detail
    assert rejected(h.coord, "update_over_allowance") == 1.0
    assert h.coord.open_round == before and before is not None and not before.received
    assert charges.total == 0
    # The same update within the allowance is taken: the refusal kept nothing.
    charges.allowance = allowance
    eu.send(update("eu", rs.round_id, D_EU))
    h.until(lambda: h.coord.open_round is not None and "eu" in h.coord.open_round.received)
    assert charges.total == HELD


def test_the_charge_of_an_aborted_rounds_update_is_released() -> None:
    clock = ManualClock()
    with running(clock=clock, quorum_fraction=1.0, round_deadline_s=30.0) as h:
        eu, _us, rs = start_round(h)
        charges = _charges(h)
        eu.send(update("eu", rs.round_id, D_EU))
        h.until(lambda: h.coord.open_round is not None and "eu" in h.coord.open_round.received)
        assert charges.total == HELD
        aborted = "crossdc_rounds_aborted_total"
        assert not h.coord.metrics.registry.get_sample_value(aborted)
        clock.now += 31.0  # the deadline with one update of the two the quorum needs
        h.until(lambda: bool(h.coord.metrics.registry.get_sample_value(aborted)))
        assert charges.total == 0


class _Charge:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_a_round_keeps_each_charge_until_it_lets_go_of_the_update() -> None:
    """On time: until the result is taken, or the attempt is retried; late: until a later
    close takes it; a refusal gives its charge back at once."""
    r = opened(1, WeightedMean())
    a, b, refused = _Charge(), _Charge(), _Charge()
    assert isinstance(
        r.take(0.0, round_update("a", 1, 1.0, 1.0), staleness=0, horizon=8, charge=a), Taken
    )
    duplicate = r.take(0.0, round_update("a", 1, 2.0, 1.0), staleness=0, horizon=8, charge=refused)
    assert isinstance(duplicate, UpdateRefusal) and refused.released == 1
    r.retry(("a", "b", "c"), WeightedMean().fold(1, ("a", "b", "c")), 10.0, 1)
    assert a.released == 1  # the first attempt's update is let go
    assert isinstance(
        r.take(0.0, round_update("b", 1, 1.0, 1.0), staleness=0, horizon=8, charge=b), Taken
    )
    r.close(("b",))
    late = _Charge()
    taken = r.take(0.0, round_update("c", 1, 3.0, 2.0), staleness=0, horizon=8, charge=late)
    assert isinstance(taken, Taken) and taken.late
    result, _ = r.result()
    assert b.released == 1 and late.released == 0  # the late one waits for the next close
    r2 = opened(2, WeightedMean())
    assert isinstance(r2.take(0.0, round_update("d", 2, 1.0, 1.0), staleness=0, horizon=8), Taken)
    r2.close(("d",))
    r2.result([r])
    assert late.released == 1
    assert [c.released for c in (a, b, refused, late)] == [1, 1, 1, 1]  # each once
    del result


def test_a_held_update_is_charged_by_account_and_released_once() -> None:
    """The charge outlives the routing id's mapping to its account (a connection forgotten)."""
    charges = PeerCharges(100)
    accounts = {b"eu/1": b"site:eu"}
    charges.key = lambda peer: accounts.get(peer, peer)
    held = hold_update(charges, b"eu/1", 60)
    assert charges.held(b"eu/1") == 60
    with pytest.raises(Exception, match="of 50 bytes: the peer holds 60 of the 100 it may"):
        hold_update(charges, b"eu/1", 50)
    del accounts[b"eu/1"]  # forgotten: the routing id is its own account now
    held.release()
    held.release()
    assert charges.total == 0 and charges.refused == 1
    assert np.isclose(held.nbytes, 60)
