"""Two shards of a coordinator, in process over tcp loopback, when shard 1 misses one of shard
0's decisions on a connection that stays up (the transport gave the message up; the test drops
it on arrival):

- a missed abort of a round both shards saved: shard 0 goes back a version, shard 1 does not;
  shard 0's next round builds on the version before, which is out of step with shard 1, so
  shard 1 meets shard 0 again, goes back too and opens the round: it closes on both;
- a missed commit: shard 0's answer to shard 1's next hello names the version committed and its
  hash, and shard 1 commits and announces it: every site gets the whole result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from comm.wire.schema import Global, RoundCancel, RoundStart, ShardAbort, ShardCommit
from comm.wire.tensors import state_hash
from coordinator.shard_peers import Lost
from coordinator.shard_service import FollowShard
from tests.coordinator.test_shard_aborts import _HeldStore, _round_2_closing, _two_shards
from tests.coordinator.test_shard_service import SITES, _Federation, _update

pytestmark = pytest.mark.timeout(90)


def _drop_once(follow: FollowShard, kind: type, round_id: int) -> list[Any]:
    """Shard 1 loses the first ``kind`` about round ``round_id`` shard 0 sends; what it lost."""
    handle: Callable[[Any], None] = follow._on
    lost: list[Any] = []

    def on(event: Any) -> None:
        about = getattr(event, "round_ids", (getattr(event, "round_id", None),))
        if isinstance(event, kind) and round_id in about and not lost:
            lost.append(event)
            return
        handle(event)

    follow._on = on  # type: ignore[method-assign]
    return lost


def _stores() -> list[_HeldStore]:
    stores = [_HeldStore(), _HeldStore()]
    for store in stores:
        store.hold.set()
    return stores


def _both_saved(fed: _Federation, lead: Any, follow: FollowShard, rid: int) -> None:
    for _ in range(3000):
        fed.pump()
        if rid in lead._saved and rid in follow._saved:
            return
    raise AssertionError("the shards never both saved the round")


def test_a_shard_that_missed_an_abort_meets_shard_0_again_and_opens_the_next_round() -> None:
    with _two_shards(_stores()) as (fed, lead, follow):
        lost = _drop_once(follow, ShardAbort, 2)
        rid = _round_2_closing(fed, lead, follow)
        _both_saved(fed, lead, follow, rid)
        lead._on(Lost(1))  # shard 0 aborts the round both saved
        assert lead.coord.state is not None and lead.coord.state.global_version == 1
        cancel: RoundCancel = fed.expect("eu", RoundCancel)
        assert rid in cancel.round_ids
        for s in SITES:
            while True:
                start: RoundStart = fed.expect(s, RoundStart, steps=4000)
                if start.round_id > rid:
                    break
            assert start.fragment_base_version == 1
            fed.sites[s].link.send(_update(s, start))
        assert [type(e) for e in lost] == [ShardAbort]
        g: Global = fed.expect("eu", Global, steps=4000)
        assert g.base_version == 1 and g.global_version == start.round_id
        assert lead.coord.state is not None and follow.coord.state is not None
        assert follow.coord.state.global_version == g.global_version
        whole = {**lead.coord.state.params, **follow.coord.state.params}
        assert state_hash(whole) == g.state_hash


def test_a_shard_that_missed_a_commit_commits_on_shard_0s_answer_to_its_hello() -> None:
    with _two_shards(_stores()) as (fed, lead, follow):
        lost = _drop_once(follow, ShardCommit, 2)
        rid = _round_2_closing(fed, lead, follow)
        g: Global = fed.expect("eu", Global, steps=4000)
        assert [type(e) for e in lost] == [ShardCommit]
        assert g.global_version == rid and lead.committed == rid
        assert g.state_hash == lead.coord.model.site_hash()
        assert rid not in follow._saved
        assert follow.coord.model.site_hash() == g.state_hash
        for s in ("us", "ap"):
            got: Global = fed.expect(s, Global)
            while got.global_version < rid:
                got = fed.expect(s, Global)
            assert got.state_hash == g.state_hash
        assert lead.coord.state is not None and follow.coord.state is not None
        whole = {**lead.coord.state.params, **follow.coord.state.params}
        assert state_hash(whole) == g.state_hash
