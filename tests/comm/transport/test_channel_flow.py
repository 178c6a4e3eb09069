"""Flow-controlled large messages over the real channels: ROUTER <-> DEALER over tcp loopback.

A large message arrives bit-identical while the sender never exceeds the credit the receiver
granted; a cut connection (``crossdc.lab.wanem``) resumes from the last acknowledged chunk; a peer that
vanishes mid-transfer never makes ``recv`` raise; a replayed chunk or acknowledgement is rejected;
``SiteLink`` keeps transfers moving on its I/O thread and flushes them on close.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq

from comm.codecs.floats import Fp32Codec
from comm.transport.dealer import DealerChannel, SiteLink
from comm.transport.profile import ChannelConfig
from comm.transport.router import RouterChannel
from comm.transport.sender import TransferSender
from comm.wire.chunking import split_frames
from comm.wire.frames import from_wire, to_wire
from comm.wire.schema import ChunkAck, Heartbeat, InitParams, Leave, Message
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator

WAIT_S = 30.0  # bound on waiting for something that must happen; never a speed assertion
CHUNK = 256 << 10
WINDOW = 1 << 20

CFG = ChannelConfig(
    chunk_bytes=CHUNK,
    min_window_bytes=WINDOW,
    max_window_bytes=WINDOW,
    stall_timeout_s=0.3,
    reconnect_interval_s=0.02,
    reconnect_interval_max_s=0.5,
    linger_s=0.2,
)


def _big_message(seed: int, nbytes: int = 8 << 20) -> InitParams:
    values = np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)
    enc = Fp32Codec().encode("w", values)
    return InitParams(site_id="eu", model_fingerprint=f"fp{seed}", payload=(enc,))


def _digest(msg: Message) -> str:
    """A hash over every frame of a message (its header included): equal means bit-identical."""
    h = hashlib.sha256()
    for frame in to_wire(msg):
        h.update(memoryview(frame).cast("B"))
    return h.hexdigest()


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@dataclass
class _Channels:
    ctx: zmq.Context[Any]
    opened: list[RouterChannel | DealerChannel] = field(default_factory=list)

    def router(self, cfg: ChannelConfig = CFG) -> tuple[RouterChannel, str]:
        router = RouterChannel(cfg, context=self.ctx)
        self.opened.append(router)
        return router, router.bind("tcp://127.0.0.1:0")

    def dealer(self, endpoint: str, cfg: ChannelConfig = CFG) -> DealerChannel:
        dealer = DealerChannel(cfg, identity="eu", context=self.ctx)
        self.opened.append(dealer)
        dealer.connect(endpoint)
        return dealer

    def close(self) -> None:
        for chan in reversed(self.opened):
            chan.close(flush_timeout_s=0)


@pytest.fixture
def chans(ctx: zmq.Context[Any]) -> Iterator[_Channels]:
    opened = _Channels(ctx)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def emulators() -> Iterator[list[LinkEmulator]]:
    started: list[LinkEmulator] = []
    try:
        yield started
    finally:
        for emulator in started:
            emulator.close()


@dataclass
class _Audit:
    """Every chunk any TransferSender sends, checked against the credit its receiver granted."""

    granted: dict[str, int] = field(default_factory=dict)  # transfer id -> right edge
    violations: list[str] = field(default_factory=list)
    max_in_flight: int = 0
    chunks: int = 0
    resumes: list[tuple[int, int]] = field(default_factory=list)  # (acked index, high water)


@pytest.fixture
def audit(monkeypatch: pytest.MonkeyPatch) -> _Audit:
    """Wraps the sender's state machine: the right edge is taken from the acknowledgements the
    sender was handed (not from its own bookkeeping), and every chunk must end within it."""
    seen = _Audit()
    next_chunk = TransferSender.next_chunk
    on_ack = TransferSender.on_ack
    resume = TransferSender.resume

    def checked_next_chunk(self: TransferSender, now: float | None = None) -> Any:
        seen.granted.setdefault(self.transfer_id, CFG.transfer.initial_credit_bytes)
        chunk = next_chunk(self, now)
        if chunk is not None:
            seen.chunks += 1
            end = chunk.offset + memoryview(chunk.data).nbytes
            if end > seen.granted[self.transfer_id]:
                seen.violations.append(f"chunk {chunk.index} ends at {end}")
            if self.bytes_in_flight > self.window_bytes:
                seen.violations.append(f"{self.bytes_in_flight} in flight > {self.window_bytes}")
            seen.max_in_flight = max(seen.max_in_flight, self.bytes_in_flight)
        return chunk

    def checked_on_ack(
        self: TransferSender, tid: str, next_index: int, credit: int, now: float | None = None
    ) -> float | None:
        edge = min(self.total_bytes, next_index * self.chunk_bytes) + credit
        seen.granted[tid] = max(seen.granted.get(tid, 0), edge)
        return on_ack(self, tid, next_index, credit, now)

    def recorded_resume(
        self: TransferSender, from_index: int | None = None, now: float | None = None
    ) -> None:
        seen.resumes.append((self.acked_index, self.high_water_index))
        resume(self, from_index, now)

    monkeypatch.setattr(TransferSender, "next_chunk", checked_next_chunk)
    monkeypatch.setattr(TransferSender, "on_ack", checked_on_ack)
    monkeypatch.setattr(TransferSender, "resume", recorded_resume)
    return seen


def _pump_until(
    router: RouterChannel,
    dealer: DealerChannel,
    done: Callable[[list[tuple[bytes, Message]]], bool],
) -> list[tuple[bytes, Message]]:
    """Drive both ends from this thread until ``done(got)``; ``got``: every complete message
    either end received, in order."""
    got: list[tuple[bytes, Message]] = []
    deadline = time.monotonic() + WAIT_S
    while not done(got):
        assert time.monotonic() < deadline, "transfer did not finish"
        received = router.recv(0.01)
        if received is not None:
            got.append(received)
        msg = dealer.recv(0.01)
        if msg is not None:
            got.append((b"dealer", msg))
    return got


def _hello(router: RouterChannel, dealer: DealerChannel) -> bytes:
    """The dealer says hello so the router knows its routing id; returns it."""
    dealer.send(Leave(site_id="eu", reason="hello"))
    got = router.recv(WAIT_S)
    assert got is not None and isinstance(got[1], Leave)
    return got[0]


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direction", ["dealer_to_router", "router_to_dealer"])
def test_large_message_arrives_identical_within_the_credit_window(
    chans: _Channels, audit: _Audit, direction: str
) -> None:
    router, endpoint = chans.router()
    dealer = chans.dealer(endpoint)
    peer = _hello(router, dealer)
    msg = _big_message(1)
    if direction == "dealer_to_router":
        sender: RouterChannel | DealerChannel = dealer
        dealer.send(msg)
    else:
        sender = router
        assert router.send(peer, msg)
    # Only the first window went out with the send; the rest waits for acknowledgements.
    assert sender.pending_transfers == 1
    (tx,) = sender.outgoing()
    assert tx.next_index == WINDOW // CHUNK < tx.num_chunks
    got = _pump_until(router, dealer, lambda _: sender.pending_transfers == 0)
    assert len(got) == 1
    assert isinstance(got[0][1], InitParams) and _digest(got[0][1]) == _digest(msg)
    assert audit.violations == []
    # Several chunks in flight at once, never more than the window.
    assert CHUNK < audit.max_in_flight <= WINDOW
    assert audit.resumes == [] and audit.chunks == tx.num_chunks == sender.stats.chunks_sent
    receiver = router if sender is dealer else dealer
    assert receiver.stats.rejected == {} and sender.stats.rejected == {}
    assert receiver.stats.goodput_bps > 0 and receiver.stats.messages_received >= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direction", ["dealer_to_router", "router_to_dealer"])
def test_messages_keep_their_order_behind_a_large_one_heartbeats_excepted(
    chans: _Channels, direction: str
) -> None:
    router, endpoint = chans.router()
    dealer = chans.dealer(endpoint)
    peer = _hello(router, dealer)
    sent: list[Message] = [
        _big_message(11, 2 << 20),
        Leave(site_id="eu", reason="after the first"),
        _big_message(12, 2 << 20),
        Leave(site_id="eu", reason="after the second"),
        Heartbeat(site_id="eu", global_version=0, sent_at=1.0),
    ]
    for msg in sent:
        if direction == "dealer_to_router":
            dealer.send(msg)
        else:
            assert router.send(peer, msg)
    sender: RouterChannel | DealerChannel = dealer if direction == "dealer_to_router" else router
    assert sender.pending_transfers == 1 and sender.queued_messages == 3
    got = [m for _, m in _pump_until(router, dealer, lambda got: len(got) == len(sent))]
    assert not sender.pending_transfers and not sender.queued_messages
    # The heartbeat overtook the large message in transfer; everything else kept its order.
    assert [_digest(m) for m in got] == [_digest(m) for m in [sent[4], *sent[:4]]]


@pytest.mark.timeout(60)
def test_cut_mid_transfer_resumes_from_the_last_acknowledged_chunk(
    chans: _Channels, audit: _Audit, emulators: list[LinkEmulator]
) -> None:
    router, endpoint = chans.router()
    port = int(endpoint.rsplit(":", 1)[1])
    link = LinkEmulator("127.0.0.1", port, profile=LinkProfile(rate_bps=200e6))
    emulators.append(link)
    link.start()
    dealer = chans.dealer(link.endpoint)
    _hello(router, dealer)
    msg = _big_message(2)
    cut_at = 3 << 20
    link.cut_after_bytes(cut_at, "up")
    dealer.send(msg)
    (tx,) = dealer.outgoing()
    got = _pump_until(router, dealer, lambda _: dealer.pending_transfers == 0)
    assert len(got) == 1 and _digest(got[0][1]) == _digest(msg)
    assert link.num_cuts == 1 and link.num_accepted >= 2
    assert audit.violations == []
    # The sender went back to the chunk the receiver had acknowledged, well past zero (3 MiB
    # had gone through, less at most a window in flight), and resent less than everything.
    assert audit.resumes and dealer.stats.transfer_resumes == len(audit.resumes)
    for acked, high in audit.resumes:
        assert (cut_at - WINDOW) // CHUNK - 1 <= acked <= high
    assert 1 <= dealer.stats.chunks_resent < tx.num_chunks
    assert dealer.stats.chunks_resent <= sum(high - acked for acked, high in audit.resumes)
    assert dealer.stats.chunks_sent == tx.num_chunks + dealer.stats.chunks_resent
    # Resent chunks are new sends with new sequence numbers: none counts as a replay.
    assert router.stats.rejected == {}


@pytest.mark.timeout(60)
def test_router_survives_a_peer_vanishing_mid_transfer(chans: _Channels) -> None:
    router, endpoint = chans.router()
    dealer = chans.dealer(endpoint)
    peer = _hello(router, dealer)
    msg = _big_message(3, 4 << 20)
    assert router.send(peer, msg) and router.pending_transfers == 1
    dealer.recv(0.2)  # takes some chunks and acknowledges them
    dealer.close(flush_timeout_s=0)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert router.recv(0.05) is None  # stalls resume towards a gone peer: never raises
    assert router.pending_transfers == 1  # kept (it may come back) until forgotten
    assert router.stats.transfer_resumes >= 1
    router.forget(peer)
    assert router.pending_transfers == 0
    # A message that must arrive is held for when the peer is heard from again; one that need
    # not is refused: the peer is not connected.
    assert router.send(peer, msg) and router.pending_transfers == 0
    assert len(router.out_streams[peer].held) == 1
    assert not router.send(peer, Heartbeat(site_id="coordinator", global_version=0, sent_at=0.0))
    router.forget(peer)
    assert peer not in router.out_streams


@pytest.mark.timeout(60)
def test_a_transfer_without_progress_is_dropped_after_the_send_timeout(
    chans: _Channels,
) -> None:
    cfg = ChannelConfig(
        chunk_bytes=CHUNK,
        min_window_bytes=WINDOW,
        max_window_bytes=WINDOW,
        stall_timeout_s=0.2,
        send_timeout_s=1.0,
        linger_s=0.1,
    )
    router, endpoint = chans.router(cfg)
    dealer = chans.dealer(endpoint, cfg)
    peer = _hello(router, dealer)
    assert router.send(peer, _big_message(4, 2 << 20))
    dealer.close(flush_timeout_s=0)  # gone before acknowledging anything
    deadline = time.monotonic() + WAIT_S
    while router.pending_transfers:
        assert time.monotonic() < deadline
        assert router.recv(0.05) is None
    assert router.stats.messages_dropped == 1


@pytest.mark.timeout(60)
def test_replayed_chunk_and_ack_are_rejected(chans: _Channels, ctx: zmq.Context[Any]) -> None:
    router, endpoint = chans.router()
    raw: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"eu/raw")
    raw.connect(endpoint)
    try:
        session = "feedface"
        msg = _big_message(5, 1 << 20)
        chunks = list(split_frames(to_wire(msg, session=session, seq=1), CHUNK))
        assert len(chunks) > 2
        first = to_wire(chunks[0], session=session, seq=2)
        raw.send_multipart(first)
        assert router.recv(0.5) is None
        assert raw.poll(int(WAIT_S * 1000))
        ack = from_wire(raw.recv_multipart())
        assert isinstance(ack, ChunkAck) and ack.next_index == 1 and ack.credit_bytes > 0

        raw.send_multipart(first)  # the same frames again: same session and sequence
        assert router.recv(0.3) is None
        assert router.stats.rejected == {"replay": 1}
        assert not raw.poll(200)  # a replay gets no acknowledgement

        raw.send_multipart(to_wire(chunks[0], session=session, seq=3))  # a resend: new sequence
        assert router.recv(0.3) is None
        assert raw.poll(int(WAIT_S * 1000))
        assert from_wire(raw.recv_multipart()) == ack
        assert router.stats.rejected == {"replay": 1}

        ack_frames = to_wire(
            ChunkAck(transfer_id="00", next_index=1, credit_bytes=1), session=session, seq=4
        )
        raw.send_multipart(ack_frames)
        raw.send_multipart(ack_frames)
        assert router.recv(0.3) is None
        assert router.stats.rejected == {"replay": 2}

        for seq, chunk in enumerate(chunks[1:], start=5):
            raw.send_multipart(to_wire(chunk, session=session, seq=seq))
        got = router.recv(WAIT_S)
        assert got is not None and got[0] == b"eu/raw" and _digest(got[1]) == _digest(msg)
        assert router.stats.rejected == {"replay": 2}
    finally:
        raw.close(linger=0)


class _RouterThread:
    """A ROUTER served on its own thread: every complete message lands in ``messages``."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.router = RouterChannel(CFG, context=ctx)
        self.endpoint = self.router.bind("tcp://127.0.0.1:0")
        self.messages: queue.Queue[tuple[bytes, Message]] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            got = self.router.recv(0.01)
            if got is not None:
                self.messages.put(got)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        self.router.close(flush_timeout_s=0)


@pytest.fixture
def served_router(ctx: zmq.Context[Any]) -> Iterator[_RouterThread]:
    served = _RouterThread(ctx)
    try:
        yield served
    finally:
        served.close()


def _next_large(served: _RouterThread) -> Message:
    deadline = time.monotonic() + WAIT_S
    while True:
        _, msg = served.messages.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, InitParams):
            return msg


@pytest.mark.timeout(60)
def test_site_link_moves_transfers_on_its_thread_and_flushes_on_close(
    served_router: _RouterThread, audit: _Audit
) -> None:
    link = SiteLink(CFG, identity="eu", endpoint=served_router.endpoint)
    link.start()
    try:
        first = _big_message(6, 4 << 20)
        link.send(first)
        # The owner does nothing (trains): the I/O thread takes the acks and sends on.
        assert _digest(_next_large(served_router)) == _digest(first)
        assert link.flush(WAIT_S) and link.pending_sends == 0
        second = _big_message(7, 4 << 20)
        link.send(second)
    finally:
        link.close()  # flushes the second one before closing
    assert _digest(_next_large(served_router)) == _digest(second)
    assert link.pending_sends == 0
    assert link.stats.rejected == {} and link.stats.messages_dropped == 0
    assert audit.violations == []


@pytest.mark.timeout(60)
def test_site_link_counts_each_drop_of_its_connection(ctx: zmq.Context[Any]) -> None:
    served = _RouterThread(ctx)

    def beat() -> Message:
        return Heartbeat(site_id="eu", global_version=0, sent_at=time.monotonic())

    link = SiteLink(CFG, identity="eu", endpoint=served.endpoint, heartbeat=beat)
    link.start()
    open_ = True
    try:
        _, first = served.messages.get(timeout=WAIT_S)  # connected: a heartbeat came through
        assert isinstance(first, Heartbeat) and link.stats.disconnects == 0
        served.close()  # the coordinator's end goes away: the connection drops
        open_ = False
        deadline = time.monotonic() + WAIT_S
        while link.stats.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.stats.disconnects == 1
    finally:
        link.close(flush_timeout_s=0)
        if open_:
            served.close()
