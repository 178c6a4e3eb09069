"""A sharded coordinator's control plane on real sockets: shard 0 and another shard take a round
through open, folded parts, freeze, close, prepared and commit, with the combined hash; a shard
of another config is refused; a silent shard is lost; a shard one version ahead rolls back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from comm.security.kits import init_kit
from comm.security.rolekits import CoordinatorKit, load_coordinator_kit
from comm.transport.profile import ChannelConfig
from comm.wire.partition import partition, partition_digest
from comm.wire.schema import (
    ShardAbort,
    ShardClose,
    ShardCommit,
    ShardFolded,
    ShardFreeze,
    ShardFrozen,
    ShardOpen,
    ShardOpened,
    ShardPrepared,
)
from comm.wire.tensors import state_hash, tensor_digest
from coordinator.scheduler import RoundPlan
from coordinator.shard_link import ShardClient, ShardServer
from coordinator.shard_peers import (
    Joined,
    Lost,
    Ready,
    Resumed,
    ShardFollower,
    ShardLeader,
    plan_fields,
    plan_of,
)
from coordinator.shard_plane import CloseAll, CommitAll, Resume, ShardPlane

pytestmark = pytest.mark.timeout(90)

CFG = ChannelConfig()
WAIT_S = 20.0
PARAMS = {
    f"layers.{i}.w": np.random.default_rng(i).standard_normal((4, i + 2)).astype(np.float32)
    for i in range(4)
}
PARTS = partition({n: a.shape for n, a in PARAMS.items()}, 2)
DIGEST = partition_digest(PARTS)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Plane:
    leader: ShardLeader
    server: ShardServer
    endpoint: str
    clock: Clock
    kit: CoordinatorKit
    followers: list[ShardFollower]

    def follower(self, held: int = 3, *, shards: int = 2, part: str = DIGEST) -> ShardFollower:
        """Shard 1 of ``shards``, holding version ``held``, connected to shard 0."""
        client = ShardClient(CFG, self.kit, shard=1)
        client.connect(self.endpoint)
        f = ShardFollower(
            client,
            shard=1,
            shards=shards,
            partition=part,
            held=lambda: (held, 5),
            interval_s=0.2,
        )
        self.followers.append(f)
        return f


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    kit = load_coordinator_kit(init_kit(tmp_path / "kit"))
    server = ShardServer(CFG, kit)
    clock = Clock()
    leader = ShardLeader(
        server,
        ShardPlane(PARTS),
        partition=DIGEST,
        committed=lambda: (3, 5),
        timeout_s=10.0,
        clock=clock,
    )
    p = Plane(leader, server, server.bind("tcp://127.0.0.1:0"), clock, kit, [])
    try:
        yield p
    finally:
        for f in p.followers:
            f.client.close()
        server.close()


def _until(step: Callable[[], list[object]], want: Callable[[object], bool]) -> object:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for event in step():
            if want(event):
                return event
    raise AssertionError("did not happen")


def _both(p: Plane, f: ShardFollower) -> Callable[[], list[object]]:
    """Poll both ends once; the events of either."""

    def step() -> list[object]:
        return [*p.leader.poll(0.02), *f.poll(0.02)]

    return step


def _digests(shard: int) -> dict[str, bytes]:
    return {n: tensor_digest(n, PARAMS[n]) for n in PARTS[shard]}


def test_a_round_goes_through_both_shards_to_the_combined_hash(plane: Plane) -> None:
    f = plane.follower()
    step = _both(plane, f)
    joined = _until(step, lambda e: isinstance(e, Joined))
    assert joined == Joined(1, True)
    resumed = f.resumed or _until(step, lambda e: isinstance(e, Resumed))
    assert resumed == Resumed(Resume(3, False), 5)
    assert plane.leader.present

    plan = RoundPlan(
        num_inner_steps=50, num_fragments=1, overlap=True, uplink={"eu": "int4"}, downlink="int8"
    )
    open_ = ShardOpen(
        round_id=6,
        base_version=3,
        fragment=0,
        participants=("eu", "us"),
        quorum=2,
        deadline_s=30,
        plan=plan_fields(plan),
    )
    plane.leader.plane.opened(6, open_.participants)
    plane.leader.broadcast(open_)
    got_open = _until(step, lambda e: isinstance(e, ShardOpen))
    assert got_open == open_ and isinstance(got_open, ShardOpen)
    assert plan_of(got_open.plan) == plan
    assert not plane.leader.plane.ready(6)
    f.report(ShardOpened(shard=1, round_id=6))
    assert _until(step, lambda e: isinstance(e, Ready)) == Ready(6)
    assert plane.leader.plane.ready(6)
    for site in ("eu", "us"):
        plane.leader.plane.folded(0, 6, site)
        f.report(ShardFolded(shard=1, round_id=6, site_id=site, accepted=True, detail=""))
    deadline = time.monotonic() + WAIT_S
    while plane.leader.plane.complete(6) != {"eu", "us"} and time.monotonic() < deadline:
        step()
    assert plane.leader.plane.complete(6) == {"eu", "us"}

    plane.leader.plane.freeze(6)
    plane.leader.broadcast(ShardFreeze(round_id=6))
    assert _until(step, lambda e: isinstance(e, ShardFreeze)) == ShardFreeze(round_id=6)
    assert plane.leader.plane.frozen(0, 6, frozenset({"eu", "us"})) is None
    f.report(ShardFrozen(shard=1, round_id=6, folded=("eu", "us")))
    close = _until(step, lambda e: isinstance(e, CloseAll))
    assert close == CloseAll(6, frozenset({"eu", "us"}))

    plane.leader.broadcast(
        ShardClose(round_id=6, merged=("eu", "us"), inner_steps=150, final=False)
    )
    assert isinstance(_until(step, lambda e: isinstance(e, ShardClose)), ShardClose)
    assert plane.leader.plane.prepared(0, 6, 4, _digests(0)) is None
    hexes = {n: d.hex() for n, d in _digests(1).items()}
    f.report(ShardPrepared(shard=1, round_id=6, global_version=4, digests=hexes))
    commit = _until(step, lambda e: isinstance(e, CommitAll))
    assert isinstance(commit, CommitAll) and commit.version == 4
    assert commit.combined_hash == state_hash(PARAMS)

    plane.leader.broadcast(
        ShardCommit(
            round_id=6,
            global_version=4,
            state_hash=commit.combined_hash,
            shard_hashes=commit.shard_hashes,
        )
    )
    got = _until(step, lambda e: isinstance(e, ShardCommit))
    assert isinstance(got, ShardCommit) and got.state_hash == state_hash(PARAMS)


def test_a_shard_of_another_config_is_never_answered(plane: Plane) -> None:
    for f in (plane.follower(shards=3), plane.follower(part="0" * 32)):
        step = _both(plane, f)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert not step(), "a shard of another config was answered or joined"
        assert f.resumed is None
    assert not plane.leader.peers


def test_a_silent_shard_is_lost_and_found_again(plane: Plane) -> None:
    f = plane.follower()
    step = _both(plane, f)
    _until(step, lambda e: isinstance(e, Joined))

    def silent() -> list[object]:  # shard 0 polls on, shard 1 says nothing
        plane.clock.now += 1.0
        return list(plane.leader.poll(0.02))

    assert _until(silent, lambda e: isinstance(e, Lost)) == Lost(1)
    assert not plane.leader.present
    deadline = time.monotonic() + WAIT_S
    while not plane.leader.present and time.monotonic() < deadline:
        step()
    assert plane.leader.present, "its next hello brings it back"


def test_shard_0_busy_past_the_timeout_does_not_count_the_others_lost(plane: Plane) -> None:
    f = plane.follower()
    step = _both(plane, f)
    _until(step, lambda e: isinstance(e, Joined))
    # Shard 0 busy for three timeouts (a close), while shard 1 said hello on and on, unread.
    plane.clock.now += 30.0
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert not [e for e in step() if isinstance(e, Lost)]
    assert plane.leader.present


def test_a_shard_back_after_a_restart_has_the_rounds_in_flight_aborted_everywhere(
    plane: Plane,
) -> None:
    first = plane.follower()
    _until(_both(plane, first), lambda e: isinstance(e, Joined))
    plane.leader.plane.opened(6, ("eu",))
    first.client.close()
    plane.followers.remove(first)
    again = plane.follower()
    step = _both(plane, again)
    assert _until(step, lambda e: isinstance(e, Joined)) == Joined(1, False)
    assert plane.leader.abort_in_flight("shard 1 joined again") == (6,)
    got = _until(step, lambda e: isinstance(e, ShardAbort))
    assert got == ShardAbort(round_ids=(6,), reason="shard 1 joined again")


def test_a_second_process_as_the_same_shard_never_takes_it_back(plane: Plane) -> None:
    """Two followers as shard 1, both alive: the newer connection keeps the shard, the older
    one's hellos are refused (counted) and never make it join again."""
    first = plane.follower()
    assert _until(_both(plane, first), lambda e: isinstance(e, Joined)) == Joined(1, True)
    second = plane.follower()
    assert _until(_both(plane, second), lambda e: isinstance(e, Joined)) == Joined(1, False)
    newer = plane.leader.peers[1]
    events: list[object] = []
    deadline = time.monotonic() + WAIT_S
    while plane.leader.refused_hellos < 3 and time.monotonic() < deadline:
        events += [*plane.leader.poll(0.02), *first.poll(0.02), *second.poll(0.02)]
    assert plane.leader.refused_hellos >= 3
    assert not [e for e in events if isinstance(e, Joined)], "the shard changed hands again"
    assert plane.leader.peers[1] == newer and plane.leader.present


def test_a_shard_one_version_ahead_rolls_back(plane: Plane) -> None:
    f = plane.follower(held=4)
    resumed = _until(_both(plane, f), lambda e: isinstance(e, Resumed))
    assert resumed == Resumed(Resume(3, True), 5)


def test_a_plan_that_does_not_read_is_refused_in_words() -> None:
    with pytest.raises(ValueError, match="a round plan from shard 0 that does not read"):
        plan_of({"num_inner_steps": 5})
