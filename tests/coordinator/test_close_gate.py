"""The close in two steps a coordinator of several shards needs: the lifecycle's gate (whose
updates count, a close held until the shards agree) and the closing's gate (a saved round
announced only when the commit says so, with the hash it is given)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from comm.wire.partition import combined_hash, partition
from comm.wire.schema import Global, Update
from comm.wire.tensors import state_hash
from coordinator.closing import Saved
from coordinator.config import RoundsConfig
from coordinator.decisions import Close, Open
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Membership
from coordinator.round import Round, Taken
from tests.support.coordinator import (
    D_EU,
    D_US,
    PARAMS,
    Harness,
    decoded,
    start_round,
    update,
)

pytestmark = pytest.mark.timeout(60)


class _Gate:
    """A gate that counts only ``complete`` and holds every close while ``hold`` is set."""

    def __init__(self) -> None:
        self.complete_sites: frozenset[str] = frozenset()
        self.hold = True
        self.held: list[tuple[int, tuple[str, ...]]] = []

    def complete(self, r: Round) -> frozenset[str]:
        return self.complete_sites

    def hold_close(self, now: float, r: Round, merged: tuple[str, ...], why: str) -> bool:
        if self.hold:
            self.held.append((r.round_id, merged))
        return self.hold


def _book(gate: _Gate) -> Lifecycle:
    cfg = RoundsConfig(
        min_sites=2,
        quorum_fraction=1.0,
        max_rounds=0,
        max_open=1,
        num_fragments=1,
        max_staleness_rounds=2,
        round_deadline_s=60.0,
        grace_floor_s=1.0,
        grace_ceiling_s=3.0,
    )
    book = Lifecycle(cfg, Membership(30.0), gate=gate)
    book.set_model(0)
    for site in ("eu", "us"):
        book.members.join(0.0, site, site.encode(), in_sync_version=0)
    return book


def _update(site: str, round_id: int) -> Update:
    return Update(
        site_id=site,
        round_id=round_id,
        global_version=0,
        fragment=0,
        weight=1.0,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=1.0,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=(),
    )


def test_the_lifecycle_counts_only_what_the_gate_calls_complete_and_holds_its_close() -> None:
    gate = _Gate()
    book = _book(gate)
    opened = book.tick(1.0)
    assert isinstance(opened, Open)
    r = opened.round
    for site in ("eu", "us"):
        assert isinstance(book.take(2.0, _update(site, r.round_id)), Taken)
    # Both updates are in this process, but the gate counts none: nothing to close yet.
    assert book.tick(3.0) is None and gate.held == []
    gate.complete_sites = frozenset({"eu", "us"})
    assert book.tick(3.0) is None  # held: the gate closes it later
    assert gate.held == [(r.round_id, ("eu", "us"))]
    assert r.is_open and book.global_version == 0 and book.completed_rounds == 0
    closed = book.close(r, ("eu", "us"), "every shard folded both")
    assert isinstance(closed, Close) and closed.merged == ("eu", "us")
    assert not r.is_open and book.global_version == r.round_id and book.completed_rounds == 1
    with pytest.raises(ValueError, match="not the oldest open round"):
        book.close(r, ("eu",), "again")


def test_a_gated_close_is_announced_only_when_told_with_the_hash_it_is_given(
    harness: Harness,
) -> None:
    h = harness
    saved: list[Saved] = []
    h.coord.closing.gate = saved.append
    eu, us, rs = start_round(h)
    eu.send(replace(update("eu", rs.round_id, D_EU, weight=100.0), global_version=0))
    us.send(replace(update("us", rs.round_id, D_US, weight=300.0), global_version=0))
    h.until(lambda: bool(saved))
    (s,) = saved
    assert s.round_id == s.version == rs.round_id
    # Saved, not announced: the sites hear nothing of the result while the gate holds it.
    for _ in range(40):
        h.coord.step(0.005)
        assert not isinstance(eu.chan.recv(0.0), Global)
    state = h.coord.state
    assert state is not None and state.global_version == rs.round_id
    digests = s.digests()
    assert set(digests) == set(PARAMS)
    # The digests make the state hash, also cut over shards as a sharded coordinator holds them.
    assert combined_hash([digests]) == state_hash(state.params)
    parts = partition({k: v.shape for k, v in PARAMS.items()}, 2)
    by_shard = [{n: digests[n] for n in part} for part in parts]
    assert combined_hash(by_shard) == state_hash(state.params)
    s.announce("f" * 32, b"")
    g: Global = h.expect(eu, Global)
    assert g.global_version == rs.round_id and g.state_hash == "f" * 32
    new = {k: PARAMS[k] + decoded(g)[k] for k in PARAMS}
    np.testing.assert_allclose(new["w"], PARAMS["w"] - 0.5, rtol=1e-6)
