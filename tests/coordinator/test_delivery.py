"""Models owed to one site: a result lost on the way delivered by the channel, and catch-up from
the delta log after a rejoin or a coordinator restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from comm.transport.faults import WireFaults
from comm.wire.schema import (
    Global,
    Message,
    RoundStart,
)
from coordinator.state import MemoryStateStore
from tests.support.coordinator import (
    Harness,
    Site,
    heard,
    join,
    merge_round,
    running,
    start_round,
    two_rounds,
)

pytestmark = pytest.mark.timeout(60)


def _heard_until(h: Harness, site: Site, found: Callable[[list[Message]], bool]) -> list[Message]:
    """``site`` keeps sending heartbeats (their acknowledgements ride on them) until what it
    received satisfies ``found``; everything it received, echoes aside."""
    got: list[Message] = []
    deadline = time.monotonic() + 30.0
    while not found(got):
        assert time.monotonic() < deadline, got
        got += heard(h, site)
    return got


@pytest.mark.timeout(60)
def test_a_result_lost_after_accept_reaches_the_site_and_the_next_round_opens() -> None:
    with running() as h:  # blocking rounds, both sites needed
        eu, us, rs = start_round(h)
        chan = h.coord.post.chan
        assert chan is not None
        chan.faults = faults = WireFaults()
        faults.lose_next(Global, peer=h.coord.members["us"].peer)
        assert merge_round(h, eu, us, rs).global_version == 1
        assert faults.lost == [(h.coord.members["us"].peer, "Global")]
        # Sent is delivered: the channel holds the result until us acknowledges it.
        assert h.coord.members["us"].in_sync and h.coord.members["us"].global_version == 1
        got = _heard_until(h, us, lambda got: any(isinstance(m, RoundStart) for m in got))
        results = [m for m in got if isinstance(m, Global)]
        assert [(g.is_full, g.base_version, g.global_version) for g in results] == [(False, 0, 1)]
        plan = next(m for m in got if isinstance(m, RoundStart))
        assert (plan.round_id, plan.participants) == (2, ("eu", "us"))
        assert chan.stats.messages_resent >= 1 and us.chan.stats.duplicates_dropped == 0


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
        assert h.coord.members["us"].in_sync
        # A site whose v1 is not the federation's gets the whole model instead.
        ap = h.site("ap")
        join(h, ap, version=g1.global_version, digest="not-v1")
        full: Global = h.expect(ap, Global)
        assert full.is_full and full.state_hash == g2.state_hash
