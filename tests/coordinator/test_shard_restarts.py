"""Two shards of a coordinator, in process over tcp loopback, when one of them restarts the way
a SIGKILL and a supervisor's restart leave it (found by ``crossdc bench chaos --shards 2``):

- shard 0 starts again while shard 1 holds a round open: shard 1 meets shard 0's new session,
  drops the rounds the old one had in flight, and opens, folds and closes the next round;
- a shard that does not know a site (it restarted, the site has not joined it again) refuses the
  site's part of a round: shard 0 learns it at once and the round ends then (aborted, the site's
  part on shard 0 cannot be taken back), not at its deadline or the grace ceiling.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from comm.wire.schema import Global, Join, RoundCancel, RoundStart
from comm.wire.tensors import state_hash
from coordinator.service import Coordinator, InitialModel
from coordinator.shard_service import FollowShard, LeadShard
from coordinator.sharding import ShardIdentity, own_part
from tests.coordinator.test_shard_service import (
    PARAMS,
    PARTS,
    SHAPES,
    SITES,
    _config,
    _Federation,
    _join_all,
    _sharded,
    _update,
)

pytestmark = pytest.mark.timeout(90)

WHOLE = state_hash(PARAMS)
IDS = [ShardIdentity(i, 2, "test") for i in range(2)]


def _shard_coordinator(i: int, state_dir: Path, **overrides: object) -> Coordinator:
    return Coordinator(
        _config(shards=2, state_dir=str(state_dir / f"shard-{i}"), **overrides),
        initial=InitialModel(own_part(PARAMS, SHAPES, IDS[i]), "fp"),
    )


def _lead(state_dir: Path, control: str, **overrides: object) -> LeadShard:
    lead = LeadShard(
        _shard_coordinator(0, state_dir, **overrides),
        IDS[0],
        PARTS,
        kit=None,
        control_bind=control,
        whole_hash0=WHOLE,
    )
    lead.start()
    return lead


def test_shard_1_drops_the_rounds_of_a_shard_0_that_started_again(tmp_path: Path) -> None:
    leads = [_lead(tmp_path, "tcp://127.0.0.1:0")]
    control = leads[0].control_endpoint
    follow = FollowShard(
        _shard_coordinator(1, tmp_path),
        IDS[1],
        PARTS,
        kit=None,
        control_endpoint=control,
        whole_hash0=WHOLE,
    )
    fed: _Federation | None = None
    try:
        follow.start()

        def step() -> None:
            leads[-1].step(0.002)
            follow.step(0.002)

        fed = _Federation(step, [leads[0].endpoint, follow.endpoint])
        _join_all(fed)
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        assert fed.expect("eu", Global).global_version == 1
        # Round 2 is open on both shards (its plans reached the sites) when shard 0 stops.
        held = {s: fed.expect(s, RoundStart) for s in SITES}
        rid = held["eu"].round_id
        assert follow.coord.book.open_round(rid) is not None
        port = leads[0].endpoint.rpartition(":")[2]
        leads[0].close()
        leads.append(_lead(tmp_path, control, bind=f"tcp://127.0.0.1:{port}"))
        assert leads[1].committed == 1
        # The sites join shard 0 again (it knows none of them).
        for s in SITES:
            fed.sites[s].link.links[0].send(
                Join(
                    site_id=s,
                    model_fingerprint="fp",
                    global_version=1,
                    state_hash=leads[1].coord.model.site_hash(),
                    capabilities={},
                )
            )
        for _ in range(2000):
            fed.pump()
            if follow.coord.book.open_round(rid) is None:
                break
        assert follow.coord.book.open_round(rid) is None  # shard 0's old round: gone
        for s in SITES:
            while (start := fed.expect(s, RoundStart)).round_id <= rid:
                pass
            fed.sites[s].link.send(_update(s, start))
        g: Global = fed.expect("eu", Global)
        assert g.global_version > rid and g.base_version == 1
        lead_st, follow_st = leads[1].coord.state, follow.coord.state
        assert lead_st is not None and follow_st is not None
        assert lead_st.global_version == follow_st.global_version == g.global_version
        assert state_hash({**lead_st.params, **follow_st.params}) == g.state_hash
    finally:
        if fed is not None:
            fed.close()
        for lead in leads:
            with contextlib.suppress(Exception):
                lead.close()
        follow.close()


def test_a_part_a_shard_refuses_unread_ends_the_round_at_once() -> None:
    # The deadline and the grace ceiling are far beyond the steps this test pumps.
    with _sharded(round_deadline_s=600.0, grace_ceiling_s=600.0) as (fed, lead, follow):
        _join_all(fed)
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        rid = starts["eu"].round_id
        follow.coord.membership.leave("ap")  # as a shard restarted since ap joined it
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        cancel: RoundCancel = fed.expect("eu", RoundCancel, steps=1500)
        assert cancel.round_ids == (rid,)
        assert "ap" in cancel.reason
        assert lead.coord.book.open_round(rid) is None
        assert follow.coord.book.open_round(rid) is None
        assert rid not in lead.plane.in_flight()
