"""The channel between a sharded coordinator's shards, on real sockets: a shard holding the
coordinator's kit talks to shard 0 both ways; a site's certified key is refused at the
handshake; without a kit (insecure, loopback) the channel is plain."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from comm.security.identity import CurveKeys
from comm.security.kits import SITE_CURVE_KEY, SITE_CURVE_PUB, init_kit, issue_site
from comm.security.rolekits import CoordinatorKit, load_coordinator_kit
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import Message, ShardFolded, ShardHello, ShardState
from coordinator.shard_link import ShardClient, ShardServer

pytestmark = pytest.mark.timeout(60)

CFG = ChannelConfig()
WAIT_S = 20.0


@pytest.fixture
def kit_dir(tmp_path: Path) -> Path:
    kit = init_kit(tmp_path / "kit")
    issue_site(kit, "eu", 30, out_dir=tmp_path / "site-eu")
    return kit


def _hello(shard: int = 1) -> ShardHello:
    return ShardHello(
        shard=shard, shards=2, partition="ab", global_version=3, round_counter=4, sent_at=1.0
    )


Link = tuple[ShardServer, str, CoordinatorKit | None]


@pytest.fixture
def link(request: pytest.FixtureRequest, kit_dir: Path) -> Iterator[Link]:
    """Shard 0's end, bound on a free port, with the coordinator's kit (param True) or none."""
    kit = load_coordinator_kit(kit_dir) if request.param else None
    server = ShardServer(CFG, kit)
    try:
        yield server, server.bind("tcp://127.0.0.1:0"), kit
    finally:
        server.close()


def _server_recv(server: ShardServer) -> tuple[bytes, Message]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = server.recv(0.1)
        if got is not None:
            return got
    raise AssertionError("shard 0 received nothing")


def _client_recv(client: ShardClient) -> Message:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = client.recv(0.1)
        if got is not None:
            return got
    raise AssertionError("the shard received nothing")


@pytest.mark.parametrize("link", [True, False], ids=["curve", "insecure"], indirect=True)
def test_a_shard_and_shard_zero_talk_both_ways(link: Link) -> None:
    server, endpoint, kit = link
    client = ShardClient(CFG, kit, shard=1)
    try:
        client.connect(endpoint)
        client.send(_hello())
        peer, msg = _server_recv(server)
        assert msg == _hello()
        assert peer.startswith(b"coordinator-shard/")
        if kit is not None:
            assert server.chan.identities[peer].site_id == "coordinator-shard"
        assert server.send(peer, ShardState(global_version=3, round_counter=4, sent_at=1.0))
        assert _client_recv(client) == ShardState(global_version=3, round_counter=4, sent_at=1.0)
        folded = ShardFolded(shard=1, round_id=4, site_id="eu", accepted=True, detail="")
        client.send(folded)
        assert _server_recv(server)[1] == folded
        assert server.refused == 0
    finally:
        client.close()


@pytest.mark.parametrize("link", [True], ids=["curve"], indirect=True)
def test_a_sites_key_is_refused_at_the_handshake(link: Link, tmp_path: Path) -> None:
    server, endpoint, kit = link
    assert kit is not None
    site = tmp_path / "site-eu"
    keys = CurveKeys(
        public=(site / SITE_CURVE_PUB).read_bytes().strip(),
        secret=(site / SITE_CURVE_KEY).read_bytes().strip(),
        server_public=kit.curve.public,
    )
    ctx: zmq.Context[Any] = zmq.Context()
    chan = DealerChannel(ChannelConfig(curve=keys), identity="eu", context=ctx)
    try:
        chan.connect(endpoint)
        chan.send(_hello())
        deadline = time.monotonic() + WAIT_S
        while server.refused == 0 and time.monotonic() < deadline:
            assert server.recv(0.1) is None, "a site's message reached shard 0"
        assert server.refused >= 1
        assert server.recv(0.3) is None
    finally:
        chan.close()
        ctx.term()
