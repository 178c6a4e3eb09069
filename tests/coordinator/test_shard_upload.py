"""Two shards of a coordinator without ``[coordinator.initial_model]`` take θ0 from the first
site to join (``coordinator.shard_initial``): its link sends each shard its tensors, shard 0
puts the parts together under the whole θ0's hash, and the rounds that follow are one
coordinator's bit for bit. Parts from different sites, parts that are not the model's cut, parts
of another θ0 than the site joined with, and an upload cut half-way are dropped on both shards
(no state), and the next upload is taken."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import Error, ErrorCode, Global, InitParams, Join, Leave, RoundStart, Welcome
from comm.wire.tensors import encode_tensors, state_hash
from coordinator.service import Coordinator
from coordinator.shard_initial import read_record
from coordinator.shard_service import FollowShard, LeadShard
from coordinator.sharding import ShardIdentity
from coordinator.state import MemoryStateStore
from tests.coordinator.test_shard_service import (
    PARAMS,
    PARTS,
    SITES,
    _config,
    _Federation,
    _single,
    _update,
    running_shards,
)

pytestmark = pytest.mark.timeout(90)

WHOLE = state_hash(PARAMS)


@contextlib.contextmanager
def _uploading(
    state_dir: Path | None = None,
) -> Iterator[tuple[_Federation, LeadShard, FollowShard]]:
    """Two shards holding no model (θ0 comes from a site), stepped in turn, and the sites."""
    coords = []
    for i in range(2):
        if state_dir is None:
            coords.append(Coordinator(_config(shards=2), store=MemoryStateStore()))
        else:
            coords.append(Coordinator(_config(shards=2, state_dir=str(state_dir / f"shard-{i}"))))
    with running_shards(coords, None, None) as running:
        yield running


def _join(fed: _Federation, site: str, version: int, digest: str) -> Welcome:
    fed.sites[site].link.send(
        Join(
            site_id=site,
            model_fingerprint="fp",
            global_version=version,
            state_hash=digest,
            capabilities={},
        )
    )
    welcome: Welcome = fed.expect(site, Welcome)
    return welcome


def _init(site: str, params: dict[str, np.ndarray] = PARAMS) -> InitParams:
    return InitParams(
        site_id=site, model_fingerprint="fp", payload=encode_tensors(params, Fp32Codec())
    )


def _part(msg: InitParams, names: tuple[str, ...]) -> InitParams:
    return replace(msg, payload=tuple(e for e in msg.payload if e.name in names))


def _nothing_held(fed: _Federation, lead: LeadShard, follow: FollowShard) -> None:
    for _ in range(50):
        fed.pump()
    assert lead.coord.state is None and follow.coord.state is None
    assert lead._initial is None and follow._initial is None
    assert lead.initials.reports == {}


def _rounds(fed: _Federation) -> list[Global]:
    results = []
    for _ in range(3):
        starts = {s: fed.expect(s, RoundStart) for s in SITES}
        for s in SITES:
            fed.sites[s].link.send(_update(s, starts[s]))
        results.append(fed.expect("eu", Global))
        for s in ("us", "ap"):
            assert fed.expect(s, Global).state_hash == results[-1].state_hash
    return results


def test_shards_take_theta0_from_a_site_and_run_one_coordinators_rounds(tmp_path: Path) -> None:
    with _single() as (fed, _coord):
        for s in SITES:
            _join(fed, s, 0, WHOLE)
        single = _rounds(fed)
    with _uploading(tmp_path) as (fed, lead, follow):
        assert _join(fed, "eu", -1, "").need_init
        for s in ("us", "ap"):
            assert not _join(fed, s, 0, WHOLE).need_init
        fed.sites["eu"].link.send(_init("eu"))
        sharded = _rounds(fed)
        assert lead.coord.state is not None and follow.coord.state is not None
        assert set(lead.coord.state.params) == set(PARTS[0])
        assert set(follow.coord.state.params) == set(PARTS[1])
        for i in range(2):
            record = read_record(tmp_path / f"shard-{i}")
            assert record is not None and record.state_hash == WHOLE
            assert dict(record.shapes) == {k: v.shape for k, v in PARAMS.items()}
    assert [g.state_hash for g in sharded] == [g.state_hash for g in single]
    for a, b in zip(sharded, single, strict=True):
        assert a.global_version == b.global_version
        assert sorted(e.name for e in a.payload) == sorted(e.name for e in b.payload)


def _refused_then_taken(fed: _Federation, lead: LeadShard, follow: FollowShard) -> None:
    """After a refused upload: nothing held anywhere; eu's next whole upload is taken."""
    _nothing_held(fed, lead, follow)
    fed.sites["eu"].link.send(_init("eu"))
    for _ in range(2000):
        fed.pump()
        if lead.coord.state is not None and follow.coord.state is not None:
            break
    assert lead.coord.model.site_hash() == WHOLE == follow.coord.model.site_hash()
    assert lead.committed == 0


def test_parts_from_two_sites_are_dropped_and_the_next_upload_is_taken() -> None:
    with _uploading() as (fed, lead, follow):
        assert _join(fed, "eu", -1, "").need_init
        _join(fed, "us", -1, "")
        fed.sites["eu"].link.links[0].send(_part(_init("eu"), PARTS[0]))
        fed.sites["us"].link.links[1].send(_part(_init("us"), PARTS[1]))
        error: Error = fed.expect("eu", Error)
        assert error.code == int(ErrorCode.MODEL_MISMATCH)
        assert "different sites (eu, us)" in error.detail
        _refused_then_taken(fed, lead, follow)


def test_parts_that_are_not_the_models_cut_are_dropped() -> None:
    with _uploading() as (fed, lead, follow):
        assert _join(fed, "eu", -1, "").need_init
        link = fed.sites["eu"].link
        link.links[0].send(_part(_init("eu"), PARTS[1]))  # each shard the other's tensors
        link.links[1].send(_part(_init("eu"), PARTS[0]))
        error: Error = fed.expect("eu", Error)
        assert "not one model's cut" in error.detail
        _refused_then_taken(fed, lead, follow)


def test_parts_of_another_theta0_than_the_site_joined_with_are_dropped() -> None:
    other = {k: v + 1 for k, v in PARAMS.items()}
    with _uploading() as (fed, lead, follow):
        assert _join(fed, "eu", 0, WHOLE).need_init
        link = fed.sites["eu"].link
        link.links[0].send(_part(_init("eu"), PARTS[0]))
        link.links[1].send(_part(_init("eu", other), PARTS[1]))
        error: Error = fed.expect("eu", Error)
        assert "the site joined holding" in error.detail
        _refused_then_taken(fed, lead, follow)


def test_an_upload_cut_half_way_is_dropped_and_the_next_site_asked() -> None:
    with _uploading() as (fed, lead, follow):
        assert _join(fed, "eu", -1, "").need_init
        fed.sites["eu"].link.links[0].send(_part(_init("eu"), PARTS[0]))
        for _ in range(200):
            fed.pump()
        assert lead.initials.reports  # shard 0 holds eu's part, shard 1 nothing
        fed.sites["eu"].link.send(Leave(site_id="eu", reason="cut"))
        _nothing_held(fed, lead, follow)
        assert _join(fed, "us", -1, "").need_init
        fed.sites["us"].link.send(_init("us"))
        for _ in range(2000):
            fed.pump()
            if lead.coord.state is not None and follow.coord.state is not None:
                break
        assert lead.coord.model.site_hash() == WHOLE == follow.coord.model.site_hash()


def test_a_shard_restarted_after_theta0_knows_the_cut_from_its_record(tmp_path: Path) -> None:
    with _uploading(tmp_path) as (fed, lead, follow):
        _join(fed, "eu", -1, "")
        fed.sites["eu"].link.send(_init("eu"))
        for _ in range(2000):
            fed.pump()
            if follow.coord.state is not None:
                break
        assert follow.coord.state is not None
        for _ in range(50):  # the state's save is durable
            fed.pump()
    again = Coordinator(_config(shards=2, state_dir=str(tmp_path / "shard-1")))
    shard: Any = FollowShard(
        again, ShardIdentity(1, 2, "test"), None, kit=None, control_endpoint="tcp://127.0.0.1:9"
    )
    try:
        assert shard.parts == PARTS
        assert again.model.whole_hash == (0, WHOLE)
    finally:
        shard.close()  # the coordinator and the client it made (its context, never started)
