"""What a close accounts for: the fold of the updates that waited for their turn (the round's
sum adds them in site order, so an update whose predecessors never came is folded only when
the round's result is taken) is charged to the fold's CPU time like every other fold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from comm.wire.schema import Global
from coordinator.service import Coordinator
from tests.support.coordinator import D_US, running, start_round, update

pytestmark = pytest.mark.timeout(60)


def _fold_cpu(coord: Coordinator) -> float:
    value = coord.metrics.registry.get_sample_value("crossdc_fold_cpu_seconds_total")
    return value or 0.0


def test_an_update_folded_at_the_close_is_charged_to_the_fold_cpu_time() -> None:
    # A quorum of one: the round closes on us's update alone, after the grace window.
    with running(quorum_fraction=0.5, grace_floor_s=0.3, grace_ceiling_s=0.3) as h:
        eu, us, rs = start_round(h)
        us.send(replace(update("us", rs.round_id, D_US, weight=300.0), global_version=0))
        r = h.coord.book.open_round(rs.round_id)
        assert r is not None
        h.until(lambda: "us" in r.accepted)
        # us comes after eu in the round's order: its update waits, encoded, until the close.
        assert r.fold is not None and r.fold.nbytes > 0
        checked = _fold_cpu(h.coord)
        g: Global = h.expect(us, Global)
        assert g.global_version == rs.round_id and g.merged == ("us",)
        assert _fold_cpu(h.coord) > checked
