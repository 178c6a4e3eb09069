"""Security of a running federation: the auth matrix, replay, tampering and the canary.

A coordinator with a real federation kit (CURVE + ZAP + certificates) runs in this process;
legitimate sites run as processes. Each attack is made before the legitimate sites join, its
rejection is awaited on the coordinator's ``crossdc_rejected_total{reason=...}``, and then the
federation must still train to completion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comm.ops.configio import dump_toml
from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.rolekits import SecurityConfig
from comm.wire.chunking import split_frames
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import PROTOCOL_VERSION, Heartbeat, Join, MessageType
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator
from tests.conftest import TINY_MODEL, Procs, read_status, wait_for, write_site_config

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    root = tmp_path / "kit"
    init_kit(root)
    for site in ("eu", "us", "ap"):
        issue_site(root, site, days=1, out_dir=tmp_path / f"kit-{site}")
    issue_site(root, "old", days=1, out_dir=tmp_path / "kit-old", now=time.time() - 5 * 86400)
    issue_site(root, "gone", days=1, out_dir=tmp_path / "kit-gone")
    revoke_site(root, "gone")
    return root


@pytest.fixture
def coordinator(tmp_path: Path, kit: Path) -> Iterator[Coordinator]:
    cfg = CoordinatorConfig(
        bind="tcp://127.0.0.1:0",
        state_dir=str(tmp_path / "coordinator"),
        metrics_port=0,
        min_sites=2,
        num_inner_steps=20,
        max_rounds=2,
        uplink_codec="int8",
        downlink_codec="int8",
        final_eval_wait_s=60.0,
        security=SecurityConfig(kit_dir=str(kit)),
    )
    coord = Coordinator(cfg)
    coord.start()
    stop = threading.Event()
    thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield coord
    finally:
        stop.set()
        thread.join(timeout=30)
        coord.close()


def rejected(coord: Coordinator, reason: str) -> float:
    return (
        coord.metrics.registry.get_sample_value("crossdc_rejected_total", {"reason": reason}) or 0.0
    )


class Client:
    """A raw CURVE DEALER with a site's keys (or made-up ones), for crafting frames."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        server_public: bytes,
        kit_dir: Path | None,
        site_id: str,
    ) -> None:
        if kit_dir is None:
            public, secret = zmq.curve_keypair()
        else:
            public = (kit_dir / "site.curve.pub").read_bytes().strip()
            secret = (kit_dir / "site.curve.key").read_bytes().strip()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"{site_id}/{os.urandom(8).hex()}".encode())
        self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.sock.connect(endpoint)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames, copy=True)

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def clients(coordinator: Coordinator, tmp_path: Path) -> Iterator[Any]:
    ctx = zmq.Context()
    made: list[Client] = []
    server_public = (tmp_path / "kit" / "coordinator.curve.pub").read_bytes().strip()

    def make(site_id: str, kit_dir: Path | None) -> Client:
        made.append(Client(ctx, coordinator.endpoint, server_public, kit_dir, site_id))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()
        ctx.destroy(linger=0)


def _join(site_id: str, seq: int, session: str = "attacker") -> list[Any]:
    msg = Join(site_id=site_id, model_fingerprint="x", global_version=-1, state_hash="")
    return to_wire(msg, session=session, seq=seq)


def _await(coord: Coordinator, reason: str, at_least: float = 1.0) -> None:
    wait_for(
        lambda: rejected(coord, reason) >= at_least, timeout_s=30, what=f"a {reason!r} rejection"
    )


def _start_sites(procs: Procs, tmp_path: Path, coord: Coordinator) -> None:
    host_port = coord.endpoint
    for i, site in enumerate(["eu", "us"]):
        path = write_site_config(
            tmp_path,
            site,
            i,
            2,
            coordinator=host_port,
            coordinator_endpoint_file="",
            security={"kit_dir": str(tmp_path / f"kit-{site}")},
        )
        procs.start(f"site-{site}", "agent", "--config", str(path))


def _finishes(procs: Procs, coord: Coordinator) -> None:
    wait_for(lambda: coord.finished, timeout_s=240, what="the federation to finish", procs=procs)
    assert coord.state is not None and len(coord.state.history) == 2
    vals = coord.state.val_losses
    assert vals[2] < vals[0]
    for name in ("site-eu", "site-us"):
        assert procs.procs[name].wait(timeout=60) == 0, procs.log(name)


def test_auth_matrix_rejects_each_attack_while_the_federation_trains(
    procs: Procs, tmp_path: Path, coordinator: Coordinator, clients: Any
) -> None:
    coord = coordinator
    # Unknown key: refused at the CURVE handshake by the ZAP handler.
    clients("eu", None).send(_join("eu", 1))
    _await(coord, "unknown_key")
    # An expired and a revoked certificate: refused at the handshake too.
    clients("old", tmp_path / "kit-old").send(_join("old", 1))
    _await(coord, "expired")
    clients("gone", tmp_path / "kit-gone").send(_join("gone", 1))
    _await(coord, "revoked")
    # A valid certificate for "ap" claiming to be "eu".
    ap = clients("ap", tmp_path / "kit-ap")
    ap.send(_join("eu", 1, session="ap-session"))
    _await(coord, "wrong_site")
    # A replayed message: the same (session, sequence) twice.
    hb = to_wire(
        Heartbeat(site_id="ap", global_version=0, sent_at=0.0), session="ap-session", seq=7
    )
    ap.send(hb)
    ap.send(hb)
    _await(coord, "replay")
    # A tampered chunk: its digest no longer matches its bytes.
    chunk = next(split_frames([b"y" * 100_000], 4096))
    bad = dataclasses.replace(chunk, data=b"z" + bytes(chunk.data)[1:])
    ap.send(to_wire(bad, session="ap-session", seq=8))
    _await(coord, "bad_digest")
    # An oversize message and a wrong protocol version.
    head = {"v": PROTOCOL_VERSION, "t": int(MessageType.HEARTBEAT), "s": "ap-session", "q": 9}
    head["f"] = {"site_id": "ap", "global_version": 0, "sent_at": 0.0}
    head["p"] = []
    half = b"x" * (coord.cfg.channel.max_message_bytes // 2 + 1)  # each frame under MAXMSGSIZE
    ap.send([msgpack.packb(head), half, half])
    _await(coord, "oversize")
    ap.send([msgpack.packb({**head, "v": PROTOCOL_VERSION + 1, "q": 10})])
    _await(coord, "wrong_version")
    assert not coord.members, "no attack made anyone a member"
    # The legitimate federation is unaffected.
    _start_sites(procs, tmp_path, coord)
    _finishes(procs, coord)


def test_revoked_site_is_cut_off_mid_run(
    procs: Procs, tmp_path: Path, coordinator: Coordinator
) -> None:
    coord = coordinator
    # One site joins; with min_sites=2 no round opens, and it keeps sending heartbeats.
    path = write_site_config(
        tmp_path,
        "us",
        1,
        2,
        coordinator=coord.endpoint,
        coordinator_endpoint_file="",
        security={"kit_dir": str(tmp_path / "kit-us")},
    )
    procs.start("site-us", "agent", "--config", str(path))
    wait_for(lambda: "us" in coord.members, timeout_s=120, what="us joined", procs=procs)
    revoke_site(tmp_path / "kit", "us")
    # The coordinator rereads the revocation list; the next message from "us" is refused.
    _await(coord, "revoked")


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=48), min_size=1, max_size=3))
def test_tamper_fuzz_frame_decoder_only_rejects_with_wire_errors(frames: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        from_wire(frames, max_bytes=1 << 20)


def test_canary_never_crosses_a_socket(procs: Procs, tmp_path: Path) -> None:
    """A canary planted in one site's data appears in no byte between site and coordinator.

    Insecure mode on purpose, so the recorder sees plaintext: the property holds because sites
    send only parameter deltas, not because of encryption.
    """
    canary = b"CANARY-7d41e0b2-do-not-leak"
    data_dir = tmp_path / "eu-data"
    data_dir.mkdir()
    for i in range(40):
        (data_dir / f"doc{i}.txt").write_bytes((canary + b" some private text\n") * 200)
    coord_dir = tmp_path / "coordinator"
    port = _free_port()
    (tmp_path / "coordinator.toml").write_text(
        dump_toml(
            {
                "coordinator": {
                    "bind": f"tcp://127.0.0.1:{port}",
                    "state_dir": str(coord_dir),
                    "metrics_port": 0,
                    "min_sites": 2,
                    "num_inner_steps": 20,
                    "max_rounds": 2,
                    "final_eval_wait_s": 60.0,
                    "security": {"insecure": True},
                }
            }
        )
    )
    recorder = Recorder(("127.0.0.1", port))
    recorder.start()
    try:
        procs.start("coordinator", "coordinator", "--config", str(tmp_path / "coordinator.toml"))
        endpoint = f"tcp://127.0.0.1:{recorder.port}"
        eu = write_site_config(
            tmp_path,
            "eu",
            0,
            2,
            coordinator=endpoint,
            coordinator_endpoint_file="",
            data={"source": "dir", "path": str(data_dir)},
            model=TINY_MODEL,
        )
        us = write_site_config(
            tmp_path, "us", 1, 2, coordinator=endpoint, coordinator_endpoint_file=""
        )
        procs.start("site-eu", "agent", "--config", str(eu))
        procs.start("site-us", "agent", "--config", str(us))
        assert procs.procs["coordinator"].wait(timeout=240) == 0, procs.log("coordinator")
        for name in ("site-eu", "site-us"):
            assert procs.procs[name].wait(timeout=60) == 0, procs.log(name)
    finally:
        recorder.close()
    status = read_status(tmp_path)
    assert status is not None and status["rounds_completed"] == 2
    captured = recorder.captured()
    assert len(captured) > 100_000, "the recorder saw the federation's traffic"
    assert b"eu" in captured  # the recorder sees plaintext (site ids travel in the clear)
    assert canary not in captured
    assert canary[:12] not in captured


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Recorder:
    """A TCP proxy that keeps every byte it forwards, both directions."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = [self.listener]
        self._stop = threading.Event()

    def start(self) -> None:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the coordinator is gone (teardown): a site's reconnect is refused
                client.close()
                continue
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self._chunks.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def captured(self) -> bytes:
        with self._lock:
            return b"".join(self._chunks)

    def close(self) -> None:
        self._stop.set()
        for s in self._socks:
            s.close()
        for t in self._threads:
            t.join(timeout=5)
