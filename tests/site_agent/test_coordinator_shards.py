"""A site of a coordinator of several shards: the kit names every shard's endpoint, the site's
config holds them, and its session opens one channel per shard (real sockets), joins every
shard and is welcomed once all have."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm.security.kits import SITE_TOML, init_kit
from comm.transport.profile import ChannelConfig
from comm.transport.router import RouterChannel
from comm.wire.partition import partition
from comm.wire.schema import Join, Welcome
from site_agent.config import SiteConfig, load_site_config
from site_agent.metrics import SiteMetrics
from site_agent.session import Session, SiteIdentity
from site_agent.shard_links import ShardedLink

pytestmark = pytest.mark.timeout(120)

SPEC = [
    ["emb", [16, 4], "float32"],
    ["layers.0.w", [4, 4], "float32"],
    ["head", [4, 16], "float32"],
]


def test_the_kit_names_every_shard_and_the_site_config_reads_them(tmp_path: Path) -> None:
    kit = init_kit(tmp_path / "kit")
    ends = ["tcp://coord-0.example.org:7710", "tcp://coord-1.example.org:7710"]
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", "keys", "issue", "--kit", str(kit), "--site", "eu",
         "--out", str(tmp_path / "eu"), "--json", "--endpoint", ends[0], "--endpoint", ends[1]],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["site_id"] == "eu"
    cfg = load_site_config(tmp_path / "eu" / SITE_TOML, security={"insecure": True})
    assert cfg.coordinator == ends[0] and cfg.coordinator_shards == tuple(ends)
    one = subprocess.run(
        [sys.executable, "-m", "crossdc", "keys", "issue", "--kit", str(kit), "--site", "us",
         "--out", str(tmp_path / "us"), "--endpoint", ends[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    assert "coordinator_shards" not in (tmp_path / "us" / SITE_TOML).read_text()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"coordinator_shards": ("tcp://a:1",)}, "two or more distinct endpoints"),
        ({"coordinator_shards": ("tcp://a:1", "tcp://a:1")}, "two or more distinct endpoints"),
        ({"coordinator_shards": ("tcp://a:1", "udp://b:1")}, "'udp://b:1' is not a ZeroMQ"),
        ({"coordinator_shards": ("tcp://b:1", "tcp://a:1")}, "coordinator must be shard 0's"),
    ],
)
def test_the_shards_endpoints_are_checked(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SiteConfig(site_id="eu", coordinator="tcp://a:1", **kw)  # type: ignore[arg-type]


@pytest.fixture
def shards() -> Iterator[list[tuple[RouterChannel, str]]]:
    """Two ROUTERs standing in for a coordinator's two shards (insecure, loopback)."""
    routers = [RouterChannel(ChannelConfig()) for _ in range(2)]
    try:
        yield [(r, r.bind("tcp://127.0.0.1:0")) for r in routers]
    finally:
        for r in routers:
            r.close()


def _recv(router: RouterChannel, kind: type) -> tuple[bytes, object]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = router.recv(0.1)
        if got is not None and isinstance(got[1], kind):
            return got
    raise AssertionError(f"no {kind.__name__}")


def test_a_session_joins_every_shard_and_is_welcomed_once(
    shards: list[tuple[RouterChannel, str]],
) -> None:
    ends = tuple(e for _, e in shards)
    session = Session(
        SiteIdentity("eu", "fp", {"state_spec": SPEC}),
        channel=ChannelConfig(),
        coordinator=ends[0],
        endpoint_file="",
        metrics=SiteMetrics("eu"),
        clock=time.monotonic,
        heartbeat_version=lambda: 0,
        shards=ends,
    )
    try:
        session.start()
        assert isinstance(session.link, ShardedLink)
        assert session.link.owner == {
            n: s
            for s, names in enumerate(partition({n: tuple(sh) for n, sh, _ in SPEC}, 2))
            for n in names
        }
        session.join(global_version=-1, state_hash="", announce={})
        peers = []
        for router, _ in shards:
            peer, msg = _recv(router, Join)
            assert isinstance(msg, Join) and msg.site_id == "eu"
            peers.append(peer)
        for i, ((router, _), peer) in enumerate(zip(shards, peers, strict=True)):
            router.send(
                peer,
                Welcome(
                    site_id="eu",
                    session_id=f"shard-{i}",
                    global_version=0,
                    heartbeat_interval_s=1.0,
                    need_init=False,
                ),
            )
        deadline = time.monotonic() + 30
        welcomes = []
        while time.monotonic() < deadline and not welcomes:
            got = session.recv(0.1)
            if isinstance(got, Welcome):
                welcomes.append(got)
        assert [w.session_id for w in welcomes] == ["shard-0"]
    finally:
        session.close()
