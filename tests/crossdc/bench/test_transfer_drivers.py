"""The bench's ZeroMQ transfer drivers (``crossdc.bench.transfer_drivers``) over real
DEALER/ROUTER sockets, through the WAN link emulator with a cut, and the WAN goodput bench that
drives them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import queue
import random
import threading
from collections.abc import Iterator

import pytest
import zmq

from comm.transport.credit import TransferConfig, decode_ack
from comm.transport.sender import TransferSender
from comm.wire.chunking import chunk_digest
from comm.wire.frames import to_wire
from crossdc.bench.transfer_drivers import KIND_CHUNK, ZmqTransferReceiver, ZmqTransferSender
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator

WAIT_S = 20.0  # bound on waiting for something that must happen; never a speed assertion


def _frames(seed: int, sizes: list[int]) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def _small_config(chunk: int, **over: int | float) -> TransferConfig:
    fields: dict[str, int | float] = {
        "chunk_bytes": chunk,
        "initial_credit_bytes": 2 * chunk,
        "min_window_bytes": 3 * chunk,
        "max_window_bytes": 8 * chunk,
    }
    fields.update(over)
    return TransferConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
def router(zmq_context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[zmq.Socket[bytes]]:
    sock = zmq_context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind("tcp://127.0.0.1:*")
    try:
        yield sock
    finally:
        sock.close(linger=0)


def _port(sock: zmq.Socket[bytes]) -> int:
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


def _dealer(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, cfg: TransferConfig
) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"site-eu")
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
    sock.setsockopt(zmq.SNDHWM, cfg.high_water_mark)
    sock.connect(endpoint)
    return sock


class _Served:
    """A ZmqTransferReceiver serving on its own thread until the test ends."""

    def __init__(self, router: zmq.Socket[bytes], cfg: TransferConfig) -> None:
        self.server = ZmqTransferReceiver(router, cfg)
        self.messages: queue.Queue[tuple[bytes, list[bytes]]] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.server.serve,
            args=(
                self.stop,
                lambda peer, frames: self.messages.put((peer, [bytes(f) for f in frames])),
            ),
            daemon=True,
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def serve() -> Iterator[list[_Served]]:
    started: list[_Served] = []
    try:
        yield started
    finally:
        for served in started:
            served.close()


@pytest.mark.timeout(60)
def test_cut_mid_transfer_resumes_from_last_ack_and_delivers_identical_bytes(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    router: zmq.Socket[bytes],
    serve: list[_Served],
) -> None:
    chunk = 256 << 10
    cfg = TransferConfig(
        chunk_bytes=chunk,
        initial_credit_bytes=4 * chunk,
        min_window_bytes=4 * chunk,
        max_window_bytes=4 * chunk,
        stall_timeout_s=0.3,
    )
    frames = [b"header of a large message", random.Random(8).randbytes(8 << 20)]
    served = _Served(router, cfg)
    serve.append(served)
    with LinkEmulator("127.0.0.1", _port(router), profile=LinkProfile(rate_bps=200e6)) as link:
        dealer = _dealer(zmq_context, link.endpoint, cfg)
        try:
            # Mid-way through the stream: the connection breaks, ZeroMQ reconnects by itself.
            link.cut_after_bytes(3 << 20, "up")
            report = ZmqTransferSender(dealer, cfg).send(frames, timeout_s=WAIT_S)
        finally:
            dealer.close(linger=0)
        assert link.num_cuts == 1 and link.num_accepted >= 2
    peer, got = served.messages.get(timeout=WAIT_S)
    assert peer == b"site-eu"
    assert [hashlib.sha256(f).hexdigest() for f in got] == [
        hashlib.sha256(f).hexdigest() for f in frames
    ]
    # The cut lost at least the chunk on the wire; the sender went back to the last chunk the
    # receiver had acknowledged (well past zero: 3 MiB had gone through), never further back.
    assert report.resumes, report
    cut_at = (3 << 20) // chunk
    for from_index, high in report.resumes:
        assert cut_at - 4 - 2 <= from_index <= high
    assert 1 <= report.chunks_resent <= sum(high - low for low, high in report.resumes)
    assert report.chunks_sent == report.num_chunks + report.chunks_resent
    assert served.server.receiver.stats.duplicates <= report.chunks_resent
    assert served.server.rejected == {}


@pytest.mark.timeout(60)
def test_rtt_ping_and_window_over_a_delayed_link(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    router: zmq.Socket[bytes],
    serve: list[_Served],
) -> None:
    cfg = TransferConfig(
        chunk_bytes=64 << 10, initial_credit_bytes=256 << 10, min_window_bytes=256 << 10
    )
    frames = [random.Random(9).randbytes(1 << 20)]
    served = _Served(router, cfg)
    serve.append(served)
    profile = LinkProfile(rate_bps=None, delay_ms=15.0)  # 30 ms round trip
    with LinkEmulator("127.0.0.1", _port(router), profile=profile) as link:
        dealer = _dealer(zmq_context, link.endpoint, cfg)
        try:
            report = ZmqTransferSender(dealer, cfg).send(frames, timeout_s=WAIT_S)
        finally:
            dealer.close(linger=0)
    _, got = served.messages.get(timeout=WAIT_S)
    assert got == frames
    # The ping crossed the link both ways before any chunk: both ends saw the full 30 ms.
    assert report.rtt_s is not None and report.rtt_s >= 0.030
    receiver_view = served.server.links[b"site-eu"].snapshot()
    assert receiver_view.min_rtt_s is not None and receiver_view.min_rtt_s >= 0.030
    assert served.server.max_credit_bytes >= cfg.min_window_bytes
    assert report.max_window_bytes >= cfg.min_window_bytes


@pytest.mark.timeout(30)
def test_zmq_receiver_rejects_a_tampered_chunk_without_answering(
    zmq_context: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes]
) -> None:
    cfg = _small_config(4096)
    dealer = _dealer(zmq_context, f"tcp://127.0.0.1:{_port(router)}", cfg)
    try:
        server = ZmqTransferReceiver(router, cfg)
        sender = TransferSender(_frames(10, [20_000]), chunk_bytes=4096)
        chunk = sender.next_chunk()
        assert chunk is not None
        data = bytearray(chunk.data)
        data[0] ^= 1
        tampered = dataclasses.replace(chunk, data=bytes(data))
        assert tampered.digest != chunk_digest(tampered.data)
        dealer.send_multipart([KIND_CHUNK, *to_wire(tampered)])
        assert server.poll_once(WAIT_S) is None
        assert server.rejected == {"bad_digest": 1} and server.acks_sent == 0
        dealer.send_multipart([KIND_CHUNK, *to_wire(chunk)])
        assert server.poll_once(WAIT_S) is None
        assert server.acks_sent == 1
        kind, raw = dealer.recv_multipart()
        assert decode_ack(raw).next_index == 1
    finally:
        dealer.close(linger=0)


@pytest.mark.timeout(60)
def test_wan_goodput_bench_reports_or_skips(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.bench import wan_goodput

    assert wan_goodput.main(["--size-mib", "1", "--rate-mbit", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    if "skipped" in report:
        assert report["skipped"]
        return
    assert report["chunk_bytes"] == 1 << 20 and report["window_bytes"] >= 8 << 20
    assert report["chunks_resent"] == 0 and report["chunks_sent"] == 2
    assert report["goodput_ratio"] > 0 and report["tcp_goodput_ratio"] > 0


@pytest.mark.timeout(120)
def test_wan_goodput_bench_over_curve_channels_with_delay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from crossdc.bench import wan_goodput

    argv = ["--size-mib", "2", "--rate-mbit", "200", "--curve", "--rtt-ms", "20", "--json"]
    assert wan_goodput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    if "skipped" in report:
        assert report["skipped"]
        return
    assert report["path"] == "channels" and report["curve"] and report["rtt_ms"] == 20
    # 2 MiB of float32 plus the message's header, in the channel's 256 KiB chunks.
    assert report["chunk_bytes"] == 256 << 10 and report["chunks_sent"] >= 9
    assert report["goodput_ratio"] > 0 and report["tcp_goodput_ratio"] > 0
