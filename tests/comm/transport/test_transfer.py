"""Tests for comm.transport (transfers): the credit window (a property test over chunk sizes,
windows and acknowledgement orders), resume from the last acknowledged chunk and chunk
validation. The bench's ZeroMQ drivers of a transfer are tested in
tests/crossdc/bench/test_transfer_drivers.py."""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comm.transport.credit import (
    TransferConfig,
    decode_ack,
    encode_ack,
    grant_window_bytes,
    stall_timeout_s,
    stream_bytes,
)
from comm.transport.linkest import LinkEstimate, LinkEstimator, LinkEstimatorConfig
from comm.transport.receiver import TransferReceiver
from comm.transport.sender import TransferSender
from comm.wire.frames import WireError
from comm.wire.schema import Chunk, ChunkAck, ErrorCode


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


class _Net:
    """A sender and a receiver joined by an in-memory network that the test drives step by step:
    chunks travel in order, acknowledgements may be reordered, dropped or duplicated, and a cut
    loses what is on the wire. ``check`` is the window invariant, run after every step."""

    def __init__(
        self, frames: list[bytes], cfg: TransferConfig, link: LinkEstimator | None = None
    ) -> None:
        self.frames = frames
        self.cfg = cfg
        self.link = link
        self.sender = TransferSender(
            frames, chunk_bytes=cfg.chunk_bytes, initial_credit_bytes=cfg.initial_credit_bytes
        )
        self.receiver = TransferReceiver(cfg)
        self.chunks: deque[Chunk] = deque()
        self.acks: list[ChunkAck] = []
        # The largest right edge the receiver ever granted (its initial credit to begin with).
        self.granted_edge = cfg.initial_credit_bytes
        self.result: list[memoryview] | None = None
        self.now = 0.0
        self.acked_history = [0]

    def check(self) -> None:
        s = self.sender
        assert s.bytes_in_flight <= s.window_bytes, (s.bytes_in_flight, s.window_bytes)
        assert s.acked_index <= s.next_index <= s.high_water_index <= s.num_chunks
        # The sender only ever moves forward from what was acknowledged: never back to zero.
        assert s.acked_index >= max(self.acked_history) or s.acked_index == s.num_chunks

    def send(self) -> None:
        for chunk in self.sender.pending_chunks(self.now):
            assert chunk.offset + len(chunk.data) <= self.granted_edge
            self.chunks.append(chunk)
            self.check()

    def deliver_chunk(self) -> None:
        chunk = self.chunks.popleft()
        self.now += 0.001
        got = self.receiver.on_chunk(b"site", chunk, self.now, self.link)
        ack = got.ack
        self.granted_edge = max(
            self.granted_edge, ack.next_index * self.cfg.chunk_bytes + ack.credit_bytes
        )
        if got.ack.next_index < self.sender.num_chunks:
            assert ack.credit_bytes >= self.cfg.chunk_bytes
        if got.frames is not None:
            assert self.result is None
            self.result = got.frames
        self.acks.append(ack)

    def deliver_ack(self, position: int) -> None:
        ack = self.acks.pop(position % len(self.acks))
        self.now += 0.001
        self.sender.on_ack(ack.transfer_id, ack.next_index, ack.credit_bytes, self.now)
        self.acked_history.append(self.sender.acked_index)
        self.check()

    def cut(self, lost_prefix: int) -> None:
        """The connection breaks: the chunks it had taken are lost (those still queued behind
        them survive), every acknowledgement on the way back is lost, and the sender resumes."""
        for _ in range(min(lost_prefix, len(self.chunks))):
            self.chunks.popleft()
        self.acks.clear()
        before = self.sender.acked_index
        self.sender.resume(now=self.now)
        assert self.sender.next_index == before  # the last acknowledged chunk, not zero
        self.check()

    def drain(self) -> None:
        """Reliable delivery until done; a round without progress is a stall and resumes."""
        for _ in range(10 * self.sender.num_chunks + 10):
            if self.sender.done:
                return
            self.send()
            progressed = bool(self.chunks)
            while self.chunks:
                self.deliver_chunk()
            while self.acks:
                self.deliver_ack(0)
            if not progressed:
                self.sender.resume(now=self.now)
                self.check()
        raise AssertionError("transfer did not finish")


# --------------------------------------------------------------------------------------------
# Pure state machines


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=0, max_size=4),
    chunk=st.integers(1, 700),
    initial_chunks=st.integers(1, 4),
    window_chunks=st.integers(1, 6),
    rtt_ms=st.integers(0, 400),
    actions=st.lists(
        st.tuples(
            st.sampled_from(["send", "chunk", "ack", "drop", "dup", "cut"]), st.integers(0, 9)
        ),
        max_size=80,
    ),
)
def test_window_is_never_exceeded(
    sizes: list[int],
    chunk: int,
    initial_chunks: int,
    window_chunks: int,
    rtt_ms: int,
    actions: list[tuple[str, int]],
) -> None:
    cfg = _small_config(
        chunk,
        initial_credit_bytes=initial_chunks * chunk,
        min_window_bytes=window_chunks * chunk,
        max_window_bytes=(window_chunks + 3) * chunk,
    )
    # A link whose estimate moves while the transfer runs, so granted windows grow and shrink.
    link = LinkEstimator(LinkEstimatorConfig(goodput_interval_s=0.002))
    link.on_rtt_sample(rtt_ms / 1000.0, now=0.0)
    frames = _frames(len(sizes), sizes)
    net = _Net(frames, cfg, link)
    for action, arg in actions:
        if action == "send":
            net.send()
        elif action == "chunk" and net.chunks:
            net.deliver_chunk()
        elif action == "ack" and net.acks:
            net.deliver_ack(arg)
        elif action == "drop" and net.acks:
            net.acks.pop(arg % len(net.acks))
        elif action == "dup" and net.acks:
            net.acks.append(net.acks[arg % len(net.acks)])
        elif action == "cut":
            net.cut(arg)
        net.check()
    net.drain()
    assert net.result is not None
    assert [bytes(f) for f in net.result] == frames
    s = net.sender
    assert s.chunks_sent - s.chunks_resent == s.num_chunks


@pytest.mark.timeout(10)
def test_several_chunks_in_flight_and_acks_advance_the_window() -> None:
    frames = _frames(1, [10_000])
    sender = TransferSender(frames, chunk_bytes=1000, initial_credit_bytes=4000)
    assert sender.num_chunks == 11 and sender.total_bytes == stream_bytes(frames) == 10_016
    first = list(sender.pending_chunks(now=0.0))
    assert [c.index for c in first] == [0, 1, 2, 3]
    assert sender.bytes_in_flight == sender.window_bytes == 4000
    assert sender.next_chunk() is None
    rtt = sender.on_ack(sender.transfer_id, 2, 5000, now=0.25)
    assert rtt == 0.25  # chunk 1, sent once at 0.0
    assert (sender.acked_index, sender.bytes_in_flight, sender.window_bytes) == (2, 2000, 5000)
    assert [c.index for c in sender.pending_chunks(now=0.3)] == [4, 5, 6]
    # A late acknowledgement changes nothing but could only move the edge forward.
    assert sender.on_ack(sender.transfer_id, 1, 100, now=0.4) is None
    assert (sender.acked_index, sender.window_bytes) == (2, 5000)
    with pytest.raises(ValueError, match="never sent"):
        sender.on_ack(sender.transfer_id, 9, 1000)
    with pytest.raises(ValueError, match="transfer"):
        sender.on_ack("other", 3, 1000)


@pytest.mark.timeout(10)
def test_resume_goes_back_to_the_last_acknowledged_chunk() -> None:
    cfg = _small_config(1000, initial_credit_bytes=6000, min_window_bytes=6000)
    frames = _frames(2, [12_000])
    sender = TransferSender(frames, chunk_bytes=1000, initial_credit_bytes=6000)
    receiver = TransferReceiver(cfg)
    sent = list(sender.pending_chunks(now=0.0))  # chunks 0..5
    assert len(sent) == 6
    acks = [receiver.on_chunk(b"s", c, 0.1).ack for c in sent[:4]]  # 4 and 5 are lost
    sender.on_ack(**dataclasses.asdict(acks[1]), now=0.2)  # acks 2 and 3 are lost too
    assert sender.acked_index == 2
    assert not sender.stalled(now=0.5, timeout_s=1.0)
    assert sender.stalled(now=1.2, timeout_s=1.0)
    sender.resume(now=1.2)
    assert sender.resumes == 1 and sender.next_index == 2
    again = sender.next_chunk(now=1.2)
    assert again is not None and again.index == 2  # not zero: 0 and 1 were acknowledged
    got = receiver.on_chunk(b"s", again, 1.3)
    assert got.duplicate and got.ack.next_index == 4  # the receiver holds 2 and 3 already
    sender.on_ack(**dataclasses.asdict(got.ack), now=1.4)
    # The acknowledgement lets the sender skip what arrived: it goes on at 4.
    following = sender.next_chunk(now=1.4)
    assert following is not None and following.index == 4
    assert sender.chunks_resent == 2  # chunk 2, then 4
    with pytest.raises(ValueError, match="acknowledged"):
        sender.resume(from_index=1)
    with pytest.raises(ValueError, match="sent"):
        sender.resume(from_index=sender.high_water_index + 1)


@pytest.mark.timeout(10)
def test_receiver_grants_bandwidth_times_rtt_times_factor() -> None:
    cfg = TransferConfig(chunk_bytes=1 << 20, min_window_bytes=8 << 20, max_window_bytes=64 << 20)
    link = LinkEstimator()
    assert grant_window_bytes(cfg, None) == 8 << 20
    assert grant_window_bytes(cfg, link.snapshot()) == 8 << 20  # priors: 125 kB BDP
    link.on_rtt_sample(0.1, now=0.0)
    link.on_transfer(100_000_000, 1.0, now=0.0)  # 800 Mbit/s x 0.1 s = 10 MB
    assert link.bdp_bytes() == 10_000_000
    assert TransferReceiver(cfg).window_bytes(link) == 20_000_000
    link.on_transfer(10**9, 0.25, now=1.0)  # towards 32 Gbit/s: clamped
    assert TransferReceiver(cfg).window_bytes(link) == 64 << 20
    # The first acknowledgement of a transfer grants that window from the chunk it names.
    receiver = TransferReceiver(cfg)
    link2 = LinkEstimator()
    link2.on_rtt_sample(0.1, now=0.0)
    link2.on_transfer(100_000_000, 1.0, now=0.0)
    sender = TransferSender(_frames(3, [3 << 20]), chunk_bytes=1 << 20)
    chunk = sender.next_chunk()
    assert chunk is not None
    ack = receiver.on_chunk(b"s", chunk, 0.0, link2).ack
    assert (ack.next_index, ack.credit_bytes) == (1, 20_000_000)


@pytest.mark.timeout(10)
def test_stall_timeout_follows_the_link() -> None:
    cfg = TransferConfig(stall_timeout_s=0.5)
    assert stall_timeout_s(cfg, None) == 0.5
    slow = LinkEstimate(rtt_s=0.3, goodput_bps=10e6, samples=2, updated_at=0.0)
    # 2 x 0.3 s + 2 x (8 Mibit / 10 Mbit/s)
    assert stall_timeout_s(cfg, slow) == pytest.approx(0.6 + 2 * 8 * 1048576 / 10e6)
    fast = LinkEstimate(rtt_s=0.001, goodput_bps=10e9, samples=2, updated_at=0.0)
    assert stall_timeout_s(cfg, fast) == 0.5


@pytest.mark.timeout(10)
def test_tampered_chunk_is_rejected_and_changes_nothing() -> None:
    cfg = _small_config(1000)
    sender = TransferSender(_frames(4, [5000]), chunk_bytes=1000, initial_credit_bytes=2000)
    receiver = TransferReceiver(cfg)
    first, second = list(sender.pending_chunks())
    receiver.on_chunk(b"s", first, 0.0)
    bad = bytearray(second.data)
    bad[10] ^= 0xFF
    with pytest.raises(WireError) as info:
        receiver.on_chunk(b"s", dataclasses.replace(second, data=bytes(bad)), 0.1)
    assert info.value.code is ErrorCode.BAD_DIGEST
    assert receiver.next_index(b"s", sender.transfer_id) == 1
    assert receiver.on_chunk(b"s", second, 0.2).ack.next_index == 2


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"offset": 999}, ErrorCode.MALFORMED),  # not where chunk 1 of 1000-byte chunks goes
        ({"index": 7}, ErrorCode.MALFORMED),  # index does not match the offset
        ({"num_chunks": 2}, ErrorCode.MALFORMED),  # 2 chunks of 1000 cannot hold 5016 bytes
        ({"total_bytes": 1 << 40}, ErrorCode.OVERSIZE),
        ({"index": 9, "num_chunks": 6}, ErrorCode.MALFORMED),
        ({"num_chunks": 1 << 21, "index": 1 << 20}, ErrorCode.OVERSIZE),
    ],
)
def test_chunks_that_fit_no_layout_are_rejected(change: dict[str, int], code: ErrorCode) -> None:
    sender = TransferSender(_frames(5, [5000]), chunk_bytes=1000, initial_credit_bytes=2000)
    sender.next_chunk()
    chunk = sender.next_chunk()
    assert chunk is not None
    bad = dataclasses.replace(chunk, **change)  # type: ignore[arg-type]
    with pytest.raises(WireError) as info:
        TransferReceiver(_small_config(1000)).on_chunk(b"s", bad, 0.0)
    assert info.value.code is code


@pytest.mark.timeout(10)
def test_late_duplicates_of_a_finished_transfer_get_the_final_ack() -> None:
    frames = _frames(6, [2500, 0, 7])
    sender = TransferSender(frames, chunk_bytes=1000, initial_credit_bytes=4000)
    receiver = TransferReceiver(_small_config(1000, initial_credit_bytes=4000))
    chunks = list(sender.pending_chunks())
    results = [receiver.on_chunk(b"s", c, 0.0) for c in chunks]
    done = results[-1]
    assert done.frames is not None and [bytes(f) for f in done.frames] == frames
    assert done.ack == ChunkAck(transfer_id=sender.transfer_id, next_index=3, credit_bytes=0)
    again = receiver.on_chunk(b"s", chunks[1], 1.0)
    assert again.duplicate and again.frames is None and again.ack == done.ack
    assert receiver.pending == 0 and receiver.stats.transfers_completed == 1
    sender.on_ack(**dataclasses.asdict(done.ack))
    assert sender.done and sender.bytes_in_flight == 0


@pytest.mark.timeout(10)
def test_receiver_drop_and_expire() -> None:
    receiver = TransferReceiver(_small_config(1000))
    for sender_id, tid in ((b"a", "t1"), (b"b", "t2")):
        sender = TransferSender(_frames(7, [5000]), chunk_bytes=1000, transfer_id=tid)
        chunk = sender.next_chunk()
        assert chunk is not None
        receiver.on_chunk(sender_id, chunk, 0.0 if sender_id == b"a" else 5.0)
    assert receiver.pending == 2
    receiver.drop_sender(b"a")
    assert receiver.pending == 1 and receiver.next_index(b"a", "t1") is None
    assert receiver.expire(now=6.0, max_idle_s=10.0) == 0
    assert receiver.expire(now=16.0, max_idle_s=10.0) == 1 and receiver.pending == 0
    assert receiver.stats.transfers_expired == 1


@pytest.mark.timeout(10)
def test_ack_codec_round_trip_and_garbage() -> None:
    ack = ChunkAck(transfer_id="ab12", next_index=7, credit_bytes=8 << 20)
    assert decode_ack(encode_ack(ack)) == ack
    for garbage in (b"\xc1", b"\x93\xa1x\x01", b"\x93\xa1x\x01\xff", b"\x92\xa1x\x01"):
        with pytest.raises(WireError):
            decode_ack(garbage)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": 4096, "initial_credit_bytes": 1024}, "initial_credit_bytes"),
        ({"chunk_bytes": 4096, "min_window_bytes": 1024}, "min_window_bytes"),
        ({"min_window_bytes": 16 << 20, "max_window_bytes": 8 << 20}, "max_window_bytes"),
        ({"window_factor": 0.5}, "window_factor"),
        ({"stall_timeout_s": 0.0}, "stall_timeout_s"),
        ({"max_pending": 0}, "max_pending"),
        ({"max_chunks": 0}, "max_chunks"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, float], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        TransferConfig(**kwargs)  # type: ignore[arg-type]
