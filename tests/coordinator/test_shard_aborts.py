"""Two shards of a coordinator, in process over tcp loopback, when a round is aborted while a
shard's own save of its result is still in the writer (closed in memory, not yet durable, so
not yet among the saves waiting for the commit): the shard takes the result back all the same
(waiting for the save, whose word then is void), and the next round builds on the version
before on both shards.

The save is held by a store that waits for the test (an injector, no timing): the test lets it
finish, waits for the write, and hands the shard the abort before its loop has seen the save.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from comm.wire.schema import Global, RoundCancel, RoundStart, ShardAbort
from comm.wire.tensors import state_hash
from coordinator.service import Coordinator, InitialModel
from coordinator.shard_peers import Joined, Lost
from coordinator.shard_plane import Phase
from coordinator.shard_service import FollowShard, LeadShard
from coordinator.sharding import ShardIdentity, own_part
from coordinator.state import GlobalState, MemoryStateStore
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
    running_shards,
)

pytestmark = pytest.mark.timeout(90)

WHOLE = state_hash(PARAMS)
IDS = [ShardIdentity(i, 2, "test") for i in range(2)]


class _HeldStore(MemoryStateStore):
    """A store whose save of version ``watch`` waits until ``hold`` is set; ``written`` is set
    once that save is done."""

    def __init__(self) -> None:
        super().__init__()
        self.watch = -1
        self.hold = threading.Event()
        self.written = threading.Event()

    def save(self, state: GlobalState) -> None:
        if state.global_version == self.watch:
            assert self.hold.wait(30), "the test never let the save finish"
        super().save(state)
        if state.global_version == self.watch:
            self.written.set()


@contextlib.contextmanager
def _two_shards(
    stores: list[_HeldStore],
) -> Iterator[tuple[_Federation, LeadShard, FollowShard]]:
    coords = [
        Coordinator(
            _config(shards=2),
            store=stores[i],
            initial=InitialModel(own_part(PARAMS, SHAPES, IDS[i]), "fp"),
        )
        for i in range(2)
    ]
    with running_shards(coords, PARTS, WHOLE) as running:
        yield running


def _round_2_closing(fed: _Federation, lead: LeadShard, follow: FollowShard, **watch: Any) -> int:
    """Round 1 closes on both; round 2's updates go out and the shards close it (one shard's
    save held by its store); its id."""
    _join_all(fed)
    starts = {s: fed.expect(s, RoundStart) for s in SITES}
    for s in SITES:
        fed.sites[s].link.send(_update(s, starts[s]))
    assert fed.expect("eu", Global).global_version == 1
    starts = {s: fed.expect(s, RoundStart) for s in SITES}
    rid: int = starts["eu"].round_id
    for s in SITES:
        fed.sites[s].link.send(_update(s, starts[s]))
    return rid


def _next_round_builds_on_v1(
    fed: _Federation, lead: LeadShard, follow: FollowShard, rid: int
) -> None:
    cancel: RoundCancel = fed.expect("eu", RoundCancel)
    assert rid in cancel.round_ids
    for s in SITES:
        while True:
            start: RoundStart = fed.expect(s, RoundStart)
            if start.round_id > rid:
                break
        assert start.fragment_base_version == 1
        fed.sites[s].link.send(_update(s, start))
    g: Global = fed.expect("eu", Global, steps=4000)
    assert g.base_version == 1 and g.global_version > rid
    assert lead.coord.state is not None and follow.coord.state is not None
    whole = {**lead.coord.state.params, **follow.coord.state.params}
    assert state_hash(whole) == g.state_hash


def test_shard_0_takes_back_a_round_aborted_while_its_save_is_in_the_writer() -> None:
    stores = [_HeldStore(), _HeldStore()]
    stores[0].watch = 2
    stores[1].hold.set()
    with _two_shards(stores) as (fed, lead, follow):
        rid = _round_2_closing(fed, lead, follow)
        assert rid == 2
        for _ in range(3000):
            fed.pump()
            preparing = rid in lead.plane.in_flight() and lead.plane.phase(rid) is Phase.PREPARING
            if preparing and lead.coord.book.global_version == rid and rid in follow._saved:
                break
        assert lead.coord.book.global_version == rid and rid in follow._saved
        assert rid not in lead._saved  # closed in memory, its save still in the writer
        stores[0].hold.set()
        assert stores[0].written.wait(30)
        # Shard 1 falls silent before shard 0's loop has seen its own save.
        lead._on(Lost(1))
        assert lead.coord.state is not None and lead.coord.state.global_version == 1
        assert stores[0].state is not None and stores[0].state.global_version == 1
        assert lead.committed == 1 and rid not in lead._saved
        for _ in range(3000):  # the late save's word is void: nothing raises
            fed.pump()
            st = follow.coord.state
            if st is not None and st.global_version == 1:
                break
        assert stores[1].state is not None and stores[1].state.global_version == 1
        _next_round_builds_on_v1(fed, lead, follow, rid)


def test_shard_1_takes_back_a_round_aborted_while_its_save_is_in_the_writer() -> None:
    stores = [_HeldStore(), _HeldStore()]
    stores[0].hold.set()
    stores[1].watch = 2
    with _two_shards(stores) as (fed, lead, follow):
        rid = _round_2_closing(fed, lead, follow)
        for _ in range(3000):
            fed.pump()
            if rid in lead._saved and follow.coord.book.global_version == rid:
                break
        assert rid in lead._saved and follow.coord.book.global_version == rid
        assert rid not in follow._saved
        stores[1].hold.set()
        assert stores[1].written.wait(30)
        # Shard 0 aborts the round (here: shard 1 silent too long); shard 1 hears it before its
        # loop has seen its own save.
        lead._on(Lost(1))
        assert lead.coord.state is not None and lead.coord.state.global_version == 1
        follow._on(ShardAbort(round_ids=(rid,), reason="shard 1 lost"))
        assert follow.coord.state is not None and follow.coord.state.global_version == 1
        assert stores[1].state is not None and stores[1].state.global_version == 1
        _next_round_builds_on_v1(fed, lead, follow, rid)
        assert not follow._saved


def test_a_shard_back_in_the_step_of_the_last_freeze_answer_aborts_the_round_once() -> None:
    """Shard 0 reads, in one step, a restarted shard's hello and then the last freeze answer
    of a round: the hello aborts the round on every shard, and the close the answer completes
    is dropped (it once stopped shard 0 on an assertion)."""
    quick = {"quorum_fraction": 0.6, "grace_floor_s": 0.0, "grace_ceiling_s": 0.0}
    with _sharded(**quick) as (fed, lead, follow):
        _join_all(fed)
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        rid = starts["eu"].round_id
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        for _ in range(4000):  # shard 0 and the other shard's sites, not its control plane
            lead.step(0.002)
            follow.coord.step(0.002)
            if rid in lead.plane.in_flight() and lead.plane.phase(rid) is Phase.FREEZING:
                break
        assert lead.plane.phase(rid) is Phase.FREEZING
        open_on_1 = follow.coord.book.open_round(rid)
        assert open_on_1 is not None
        close = lead.plane.frozen(1, rid, open_on_1.received)
        assert close is not None
        lead._events += [Joined(1, False), close]
        lead.step(0.002)
        assert lead.coord.book.open_round(rid) is None
        assert rid not in lead.plane.in_flight()
        assert lead.coord.state is not None and lead.coord.state.global_version == 0
