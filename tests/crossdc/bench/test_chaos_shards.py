"""``crossdc bench chaos --shards 2``: the fault draws with shards, and a short run of real
processes (two coordinator shards from one TOML, three sites with one channel per shard, each
behind its own emulated link) through two chosen faults: shard 0 killed and started again with
a crash point that kills it once more after it saved a round and before it committed it, and a
site's link to shard 1 alone cut while rounds run. Asserted: no closed round lost on any shard,
no round id reused, every shard's part and the combined hash held by every site, no crash the
faults did not cause. Timings (stalls, recovery) are the bench's figures, not the test's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from crossdc.bench import chaos
from crossdc.bench.chaos_faults import KINDS, SHARD_KINDS, Fault, Injector, draw_fault
from crossdc.bench.chaos_fed import Federation, FedSpec

ARMED_KILL_S = 150.0
"""Longest wait for the armed shard to come back, close a round and kill itself after its save."""


@pytest.mark.timeout(10)
def test_with_shards_coordinator_faults_name_a_shard_and_one_shard_cuts_are_drawn() -> None:
    sites = ["eu", "us", "ap"]
    rng = random.Random(5)
    draws = [draw_fault(rng, i, sites, 10.0, shards=2) for i in range(80)]
    assert {f.kind for f in draws} == set(KINDS + SHARD_KINDS)
    assert {f.shard for f in draws if f.kind == "kill_shard_at_save"} == {0, 1}
    for f in draws:
        on_coordinator = f.kind.endswith("coordinator") or f.kind == "kill_shard_at_save"
        assert f.target == f"coordinator-{f.shard}" if on_coordinator else f.target in sites
        assert (f.shard is not None) == (on_coordinator or f.kind == "cut_shard_link")
    single = [draw_fault(rng, i, sites, 10.0) for i in range(40)]
    assert {f.kind for f in single} <= set(KINDS) and {f.shard for f in single} == {None}


def _until(
    fed: Federation, injector: Injector, samples: list[Any], done: Any, limit: float
) -> bool:
    deadline = fed.now() + limit
    while fed.now() < deadline:
        chaos._ticker(fed, injector, samples)
        if done():
            return True
    return False


@pytest.mark.timeout(600)
def test_two_shards_lose_nothing_through_a_kill_between_save_and_commit(tmp_path: Path) -> None:
    fed = Federation(tmp_path / "chaos", FedSpec(sites=3, min_sites=2, shards=2))
    injector = Injector(fed, 0)
    samples: list[Any] = []
    log0 = fed.workdir / "coordinator-0.log"
    try:
        fed.start()
        chaos.wait_first_round(fed, samples)
        soak_start = fed.now()
        assert injector.inject(Fault(0, "kill_shard_at_save", "coordinator-0", 0.0, 0))

        def fired() -> bool:
            return chaos.SAVE_KILL in log0.read_text(errors="replace")

        assert _until(fed, injector, samples, fired, ARMED_KILL_S), "the crash point never fired"
        assert injector.inject(Fault(1, "cut_shard_link", "us", 3.0, 1))
        drained = chaos.drain(fed, injector, 240.0, samples)
        chaos.stop(fed)
    finally:
        fed.close()
    report = chaos._chaos_figures(fed, injector, samples, soak_start, drained)
    assert report["drain_completed"] is True
    assert report["kills_between_save_and_commit"] == 1
    assert report["rounds_lost"] == 0, report["rounds_lost_list"]
    assert report["round_ids_reused"] == 0, report["round_ids_reused_list"]
    assert report["sites_final_hash_agree"] is True, report["final_versions"]
    assert report["combined_hash_is_committed"] is True
    assert [s["rounds_lost"] for s in report["shards"]] == [0, 0]
    assert all(s["sites_hold_its_part"] for s in report["shards"])
    assert report["unexpected_exits"] == {name: [] for name in fed.roles}
    assert report["restarts"]["coordinator-0"] == 2  # the fault's kill and the crash point's
