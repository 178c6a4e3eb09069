"""The receive budget (``comm.transport.receiver``): a receiver reassembles a bounded number of
transfers (and bytes) at once, over all its senders; the others wait, credit-blocked, kept alive by
the receiver's acknowledgements, and resend nothing.

The state machines are driven step by step on a simulated clock (no sleeps): many senders upload
at once, and after every step the receiver holds no more than its budget in reassembly buffers
(plus at most the initial credit per waiting transfer); every transfer completes bit-identical,
admitted in the order its first chunk arrived, with no chunk sent twice. Then the same over real ROUTER and
DEALER channels.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comm.codecs.floats import Fp32Codec
from comm.ops.configio import ConfigError, build
from comm.transport.credit import TransferConfig, stall_timeout_s
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.transport.receiver import TransferReceiver
from comm.transport.router import RouterChannel
from comm.transport.sender import TransferSender
from comm.wire.frames import to_wire
from comm.wire.schema import Chunk, ChunkAck, InitParams, Leave, Message

WAIT_S = 30.0  # bound on waiting for something that must happen; never a speed assertion
CHUNK = 1000


def _config(**over: Any) -> TransferConfig:
    fields: dict[str, Any] = {
        "chunk_bytes": CHUNK,
        "initial_credit_bytes": 2 * CHUNK,
        "min_window_bytes": 3 * CHUNK,
        "max_window_bytes": 3 * CHUNK,
        "stall_timeout_s": 1.0,
    }
    fields.update(over)
    return TransferConfig(**fields)


def _frames(seed: int, nbytes: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(nbytes // 2), rng.randbytes(nbytes - nbytes // 2)]


class _Fleet:
    """Many senders and one receiver over an in-memory network the test drives in steps.

    Each sender's chunks reach the receiver in order (one TCP connection each) but interleave
    with other senders' in a random order; acknowledgements come back the same way. One step:
    every sender sends what its window allows, every chunk is delivered, every acknowledgement
    (the receiver's :meth:`acks_due` included) is delivered, and the clock moves ``dt``.
    ``check`` is the budget invariant, run after every chunk the receiver takes.
    """

    def __init__(self, cfg: TransferConfig, sizes: list[int], seed: int, dt: float = 0.4):
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.dt = dt
        self.now = 0.0
        self.receiver = TransferReceiver(cfg)
        self.frames = {f"s{i:02d}".encode(): _frames(i, n) for i, n in enumerate(sizes)}
        self.senders = {
            peer: TransferSender(
                frames,
                chunk_bytes=cfg.chunk_bytes,
                initial_credit_bytes=cfg.initial_credit_bytes,
                transfer_id=f"t{peer.decode()}",
            )
            for peer, frames in self.frames.items()
        }
        self.results: dict[bytes, list[bytes]] = {}
        self.admission_order: list[bytes] = []
        self.first_chunk_order: list[bytes] = []
        self.max_admitted = 0
        self.max_admitted_bytes = 0
        self.max_waiting = 0
        self.stalls = 0
        self.deliver_due_acks = True

    @property
    def largest(self) -> int:
        return max(s.total_bytes for s in self.senders.values())

    def check(self) -> None:
        rx, cfg = self.receiver, self.cfg
        assert rx.admitted <= cfg.receive_max_transfers
        # The budget, unless one transfer is larger than the whole of it (it then goes alone).
        assert rx.admitted_bytes <= cfg.receive_budget_bytes or rx.admitted == 1
        assert rx.held_bytes <= rx.admitted_bytes + rx.waiting * cfg.initial_credit_bytes
        self.max_admitted = max(self.max_admitted, rx.admitted)
        self.max_admitted_bytes = max(self.max_admitted_bytes, rx.admitted_bytes)
        self.max_waiting = max(self.max_waiting, rx.waiting)
        # Several may be admitted at once (after the large one): they count in arrival order.
        for peer in self.first_chunk_order:
            tid = self.senders[peer].transfer_id
            opened = rx.next_index(peer, tid) is not None or peer in self.results
            if opened and peer not in self.admission_order and not rx.is_waiting(peer, tid):
                self.admission_order.append(peer)

    def _interleave(self, queues: dict[bytes, deque[Any]]) -> Iterator[tuple[bytes, Any]]:
        while any(queues.values()):
            peer = self.rng.choice([p for p, q in queues.items() if q])
            yield peer, queues[peer].popleft()

    def step(self) -> None:
        chunks: dict[bytes, deque[Chunk]] = {p: deque() for p in self.senders}
        for peer, tx in self.senders.items():
            chunks[peer].extend(tx.pending_chunks(self.now))
        acks: dict[bytes, deque[ChunkAck]] = {p: deque() for p in self.senders}
        for peer, chunk in self._interleave(chunks):
            if chunk.index == 0:
                self.first_chunk_order.append(peer)
            got = self.receiver.on_chunk(peer, chunk, self.now)
            self.check()
            acks[peer].append(got.ack)
            if got.frames is not None:
                self.results[peer] = [bytes(f) for f in got.frames]
        if self.deliver_due_acks:
            for peer, ack in self.receiver.acks_due(self.now):
                acks[peer].append(ack)
        for peer, ack in self._interleave(acks):
            self.senders[peer].on_ack(ack.transfer_id, ack.next_index, ack.credit_bytes, self.now)
        self.now += self.dt
        stall_s = stall_timeout_s(self.cfg, None)
        for tx in self.senders.values():
            if tx.stalled(self.now, stall_s):
                self.stalls += 1
                tx.resume(now=self.now)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if all(tx.done for tx in self.senders.values()):
                return
            self.step()
        raise AssertionError("the transfers did not finish")


@pytest.mark.timeout(30)
def test_many_senders_never_exceed_the_transfer_limit_and_all_complete_without_resending() -> None:
    cfg = _config(receive_max_transfers=3)
    fleet = _Fleet(cfg, [10 * CHUNK + 7 * i for i in range(12)], seed=1)
    fleet.run()
    assert fleet.max_admitted == 3 and fleet.max_waiting == 9
    assert fleet.receiver.stats.transfers_waited == 9
    for peer, frames in fleet.frames.items():
        assert fleet.results[peer] == frames
    # First come, first served: transfers are admitted in the order their first chunks arrived.
    assert fleet.admission_order == fleet.first_chunk_order
    # Waiting took many stall timeouts of simulated time, yet no sender stalled or resent.
    assert fleet.now > 3 * cfg.stall_timeout_s
    assert fleet.stalls == 0
    assert all(tx.chunks_resent == 0 and tx.resumes == 0 for tx in fleet.senders.values())
    assert fleet.receiver.stats.duplicates == 0 and fleet.receiver.stats.chunks_beyond_credit == 0
    assert fleet.receiver.pending == 0 and fleet.receiver.held_bytes == 0


@pytest.mark.timeout(30)
def test_the_byte_budget_bounds_reassembly_and_a_transfer_larger_than_it_goes_alone() -> None:
    size = 10 * CHUNK
    cfg = _config(receive_budget_bytes=int(2.5 * size))
    fleet = _Fleet(cfg, [size] * 6 + [4 * size] + [size] * 3, seed=2)
    fleet.run()
    assert fleet.max_admitted == 2  # two fit in two and a half transfers' worth, three do not
    assert fleet.max_admitted_bytes == fleet.largest  # the large one, alone
    assert len(fleet.results) == 10 and fleet.stalls == 0
    assert all(fleet.results[p] == f for p, f in fleet.frames.items())


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(3 * CHUNK, 15 * CHUNK), min_size=1, max_size=10),
    max_transfers=st.integers(1, 4),
    budget_transfers=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_budget_holds_and_every_transfer_completes_whatever_the_interleaving(
    sizes: list[int], max_transfers: int, budget_transfers: int, seed: int
) -> None:
    cfg = _config(
        receive_max_transfers=max_transfers, receive_budget_bytes=budget_transfers * 10 * CHUNK
    )
    fleet = _Fleet(cfg, sizes, seed=seed)
    fleet.run()
    assert all(fleet.results[p] == f for p, f in fleet.frames.items())
    assert fleet.admission_order == fleet.first_chunk_order
    assert fleet.stalls == 0
    assert all(tx.chunks_sent == tx.num_chunks for tx in fleet.senders.values())


@pytest.mark.timeout(10)
def test_a_waiting_sender_holds_its_chunks_acknowledged_and_stalls_only_without_keepalives() -> (
    None
):
    cfg = _config(receive_max_transfers=1)
    rx = TransferReceiver(cfg)
    first = TransferSender(_frames(1, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    second = TransferSender(_frames(2, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    for chunk in list(first.pending_chunks(0.0)):  # its initial credit only
        first.on_ack(**dataclasses.asdict(rx.on_chunk(b"a", chunk, 0.0).ack), now=0.0)
    for chunk in list(second.pending_chunks(0.0)):
        got = rx.on_chunk(b"b", chunk, 0.0)
        assert got.waiting and got.frames is None
        second.on_ack(**dataclasses.asdict(got.ack), now=0.0)
    # Both chunks it was allowed to send are held and acknowledged; no credit beyond them.
    assert rx.waiting == 1 and rx.admitted == 1
    assert rx.held_bytes == rx.admitted_bytes + 2 * CHUNK
    assert second.acked_index == 2 and second.waiting_for_credit and second.bytes_in_flight == 0
    assert second.next_chunk(0.0) is None
    # Keepalives every half stall timeout: the waiting sender never stalls.
    now = 0.0
    for _ in range(40):
        now += 0.1
        for peer, ack in rx.acks_due(now):
            assert peer == b"b" and ack.next_index == 2 and ack.credit_bytes == 0
            second.on_ack(**dataclasses.asdict(ack), now=now)
        assert not second.stalled(now, cfg.stall_timeout_s)
    # Without them it would stall, and a resume would send nothing again: all was acknowledged.
    assert second.stalled(now + cfg.stall_timeout_s, cfg.stall_timeout_s)
    second.resume(now=now + cfg.stall_timeout_s)
    assert second.next_chunk(now) is None and second.chunks_resent == 0
    # The first finishes: the second is admitted and granted a window, which it sends on.
    while not first.done:
        for chunk in first.pending_chunks(now):
            first.on_ack(**dataclasses.asdict(rx.on_chunk(b"a", chunk, now).ack), now=now)
    grants = rx.acks_due(now)
    assert [(p, a.next_index) for p, a in grants] == [(b"b", 2)]
    assert grants[0][1].credit_bytes >= cfg.min_window_bytes
    second.on_ack(**dataclasses.asdict(grants[0][1]), now=now)
    assert [c.index for c in second.pending_chunks(now)] == [2, 3, 4]
    assert rx.waiting == 0 and rx.admitted == 1 and second.chunks_resent == 0


@pytest.mark.timeout(10)
def test_a_lost_grant_is_sent_again() -> None:
    cfg = _config(receive_max_transfers=1)
    fleet = _Fleet(cfg, [10 * CHUNK, 10 * CHUNK], seed=3)
    fleet.deliver_due_acks = False
    while not fleet.senders[b"s00"].done and not fleet.senders[b"s01"].done:
        fleet.step()
    rx = fleet.receiver
    lost = rx.acks_due(fleet.now)  # the grant to the other one: never delivered
    assert len(lost) == 1 and lost[0][1].credit_bytes >= cfg.min_window_bytes
    assert rx.acks_due(fleet.now) == []
    fleet.now += cfg.stall_timeout_s / 2
    assert rx.acks_due(fleet.now) == lost  # the same grant, again
    fleet.deliver_due_acks = True
    fleet.run()
    assert all(fleet.results[p] == f for p, f in fleet.frames.items())


@pytest.mark.timeout(10)
def test_small_transfers_never_wait() -> None:
    cfg = _config(receive_max_transfers=1)
    rx = TransferReceiver(cfg)
    big = TransferSender(_frames(1, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    rx.on_chunk(b"a", next(big.pending_chunks(0.0)), 0.0)
    small = TransferSender(_frames(2, 1500), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    assert small.total_bytes <= cfg.initial_credit_bytes
    got = [rx.on_chunk(b"b", c, 0.0) for c in small.pending_chunks(0.0)]
    assert not any(g.waiting for g in got) and got[-1].frames is not None
    assert rx.stats.transfers_waited == 0


@pytest.mark.timeout(10)
def test_chunks_beyond_the_initial_credit_are_dropped_while_waiting_and_resent_after() -> None:
    cfg = _config(receive_max_transfers=1)
    rx = TransferReceiver(cfg)
    first = TransferSender(_frames(1, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    rx.on_chunk(b"a", next(first.pending_chunks(0.0)), 0.0)
    # A sender that thinks it may send more before an acknowledgement than the receiver does.
    greedy = TransferSender(_frames(2, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=5000)
    for chunk in list(greedy.pending_chunks(0.0)):
        greedy.on_ack(**dataclasses.asdict(rx.on_chunk(b"b", chunk, 0.0).ack), now=0.0)
    assert rx.stats.chunks_beyond_credit == 3 and rx.held_bytes == rx.admitted_bytes + 2 * CHUNK
    assert greedy.acked_index == 2 and greedy.bytes_in_flight == 3 * CHUNK
    rx.drop_sender(b"a")  # the first leaves: the greedy one is admitted
    ((peer, grant),) = rx.acks_due(0.1)
    assert peer == b"b" and grant.next_index == 2
    greedy.on_ack(**dataclasses.asdict(grant), now=0.1)
    greedy.resume(now=1.5)  # its stall timer: what the receiver dropped goes again
    while not greedy.done:
        for chunk in greedy.pending_chunks(1.5):
            got = rx.on_chunk(b"b", chunk, 1.5)
            greedy.on_ack(**dataclasses.asdict(got.ack), now=1.5)
    assert got.frames is not None and [bytes(f) for f in got.frames] == _frames(2, 10 * CHUNK)


@pytest.mark.timeout(10)
def test_an_idle_admitted_transfer_expires_and_admits_the_next_but_a_waiting_one_does_not() -> None:
    cfg = _config(receive_max_transfers=1, idle_expire_s=10.0)
    rx = TransferReceiver(cfg)
    gone = TransferSender(_frames(1, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    rx.on_chunk(b"gone", next(gone.pending_chunks(0.0)), 0.0)  # then its sender vanishes
    waiting = TransferSender(_frames(2, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
    for chunk in waiting.pending_chunks(1.0):
        assert rx.on_chunk(b"w", chunk, 1.0).waiting
    assert rx.expire(now=5.0) == 0 and rx.waiting == 1
    assert rx.expire(now=10.5) == 1  # the stalled partial transfer is freed...
    assert rx.stats.transfers_expired == 1 and rx.next_index(b"gone", gone.transfer_id) is None
    # ... and the waiting one, idle for 9.5 s (longer than it waited for nothing), is admitted.
    assert rx.waiting == 0 and rx.admitted == 1 and rx.admitted_bytes == waiting.total_bytes
    assert [p for p, _ in rx.acks_due(10.5)] == [b"w"]
    # Its idle time counts from its admission.
    assert rx.expire(now=20.0) == 0
    assert rx.expire(now=20.6) == 1 and rx.pending == 0 and rx.held_bytes == 0


@pytest.mark.timeout(10)
def test_a_departed_waiting_sender_frees_what_it_held() -> None:
    cfg = _config(receive_max_transfers=1)
    rx = TransferReceiver(cfg)
    for peer, seed in ((b"a", 1), (b"b", 2), (b"c", 3)):
        tx = TransferSender(_frames(seed, 10 * CHUNK), chunk_bytes=CHUNK, initial_credit_bytes=2000)
        for chunk in tx.pending_chunks(0.0):
            rx.on_chunk(peer, chunk, 0.0)
    assert rx.admitted == 1 and rx.waiting == 2
    rx.drop_sender(b"b")
    assert rx.waiting == 1 and rx.held_bytes == rx.admitted_bytes + 2 * CHUNK
    rx.drop_sender(b"a")
    assert rx.waiting == 0 and [p for p, _ in rx.acks_due(0.0)] == [b"c"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("cls", "kwargs", "field_name"),
    [
        (TransferConfig, {"receive_max_transfers": 0}, "transfer.receive_max_transfers"),
        (TransferConfig, {"receive_budget_bytes": 0}, "transfer.receive_budget_bytes"),
        (ChannelConfig, {"receive_max_transfers": 0}, "channel.receive_max_transfers"),
        (ChannelConfig, {"receive_budget_bytes": -1}, "channel.receive_budget_bytes"),
        (ChannelConfig, {"initial_credit_bytes": 0}, "channel.initial_credit_bytes"),
        (ChannelConfig, {"receive_max_transfers": 2.5}, "channel.receive_max_transfers"),
    ],
)
def test_config_validation_names_the_field(
    cls: type[Any], kwargs: dict[str, Any], field_name: str
) -> None:
    with pytest.raises(ValueError, match=field_name):
        cls(**kwargs)


@pytest.mark.timeout(10)
def test_a_config_file_sets_the_budget_and_refuses_a_bad_one() -> None:
    cfg = build(ChannelConfig, {"receive_max_transfers": 4, "receive_budget_bytes": 1 << 28})
    assert cfg.transfer.receive_max_transfers == 4
    assert cfg.transfer.receive_budget_bytes == 1 << 28
    with pytest.raises(ConfigError, match="channel.receive_max_transfers"):
        build(ChannelConfig, {"receive_max_transfers": 0})


# ---- over real channels -----------------------------------------------------------------------


def _upload(seed: int, nbytes: int) -> InitParams:
    values = np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)
    enc = Fp32Codec().encode("w", values)
    return InitParams(site_id=f"s{seed}", model_fingerprint=f"fp{seed}", payload=(enc,))


def _wire(msg: Message) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in to_wire(msg)]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.mark.timeout(120)
def test_a_router_receives_many_uploads_within_its_budget(ctx: zmq.Context[Any]) -> None:
    """Ten dealers upload at once to a router that reassembles two at a time: all arrive
    identical, the router never admits more than two uploads' worth, and the eight that waited
    are counted on both ends."""
    cfg = ChannelConfig(
        chunk_bytes=64 << 10,
        initial_credit_bytes=64 << 10,
        min_window_bytes=256 << 10,
        max_window_bytes=256 << 10,
        receive_max_transfers=2,
        linger_s=0.2,
        reconnect_interval_s=0.02,
    )
    router = RouterChannel(cfg, context=ctx)
    endpoint = router.bind("tcp://127.0.0.1:0")
    dealers = [DealerChannel(cfg, identity=f"s{i}", context=ctx) for i in range(10)]
    try:
        for i, dealer in enumerate(dealers):
            dealer.connect(endpoint)
            dealer.send(Leave(site_id=f"s{i}", reason="hello"))
        hellos = 0
        deadline = time.monotonic() + WAIT_S
        while hellos < len(dealers):
            assert time.monotonic() < deadline, "the dealers did not connect"
            hellos += router.recv(0.05) is not None
        uploads = {f"s{i}": _upload(i, 1 << 20) for i in range(len(dealers))}
        for i, dealer in enumerate(dealers):
            dealer.send(uploads[f"s{i}"])  # its initial credit goes out now
        rx = router._receiver
        deadline = time.monotonic() + WAIT_S
        while rx.pending < len(dealers):  # no dealer moves on before every first chunk is in
            assert time.monotonic() < deadline, "the first chunks did not arrive"
            assert router.recv(0.01) is None
        assert rx.admitted == 2 and rx.waiting == len(dealers) - 2
        got: dict[str, Message] = {}
        deadline = time.monotonic() + WAIT_S * 2
        while len(got) < len(dealers):
            assert time.monotonic() < deadline, "the uploads did not finish"
            received = router.recv(0.01)
            if received is not None:
                assert isinstance(received[1], InitParams)
                got[received[1].site_id] = received[1]
            for dealer in dealers:
                assert dealer.recv(0.0) is None
        for site, msg in uploads.items():
            assert _wire(got[site]) == _wire(msg)
        one = sum(len(f) for f in _wire(uploads["s0"]))  # an upload's frames (all one size)
        assert one < rx.stats.peak_admitted_bytes <= 2 * (one + 1024)  # 1 KiB: headers
        assert rx.pending == 0 and rx.held_bytes == 0
        assert router.stats.transfers_waited == len(dealers) - 2
        assert router.stats.transfers_waiting == 0
        assert router.stats.reassembly_peak_bytes <= 2 * (one + 1024) + 8 * cfg.initial_credit_bytes
        # Each dealer that waited saw it: every chunk it had sent acknowledged, no credit left.
        assert sum(d.stats.credit_waits for d in dealers) == len(dealers) - 2
        assert router.stats.rejected == {} and all(d.stats.messages_dropped == 0 for d in dealers)
    finally:
        for dealer in dealers:
            dealer.close(flush_timeout_s=0)
        router.close(flush_timeout_s=0)


@pytest.mark.timeout(60)
def test_resumes_back_off_while_a_receiver_stays_silent(ctx: zmq.Context[Any]) -> None:
    """A receiver that takes chunks but acknowledges nothing (a slow one, or a cut link): each
    resume doubles the wait before the next, up to 16 stall timeouts, and the message is still
    dropped once it made no progress for the send timeout. Time is passed in, not slept."""
    cfg = ChannelConfig(
        chunk_bytes=64 << 10,
        initial_credit_bytes=256 << 10,
        stall_timeout_s=1.0,
        send_timeout_s=60.0,
        linger_s=0.0,
    )
    silent: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    dealer = DealerChannel(cfg, identity="s0", context=ctx)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(_upload(0, 1 << 20))
        (tx,) = dealer.outgoing()
        start = tx.last_progress_at
        assert start is not None
        tick_s = 1 / 8  # exact in binary: ticks land on the waits, not a rounding past them
        resumed_at: list[float] = []
        for tick in range(1, 560):
            now = start + tick * tick_s
            before = dealer.stats.transfer_resumes
            dealer._tick(now)
            if dealer.stats.transfer_resumes > before:
                resumed_at.append(now - start)
            if dealer.pending_transfers == 0:
                break
        # 1 s, then 2, 4, 8, 16 and 16 s after each resume: every chunk resent six times, not 60.
        # Each wait is measured from the tick the previous resume happened at, so a gap is its
        # wait, or one tick more where ``start + t`` rounds across a power of two.
        gaps = [b - a for a, b in zip([0.0, *resumed_at[:-1]], resumed_at, strict=True)]
        assert len(gaps) == 6, resumed_at
        for gap, wait in zip(gaps, [1.0, 2.0, 4.0, 8.0, 16.0, 16.0], strict=True):
            assert wait - 1e-9 <= gap <= wait + tick_s + 1e-9, resumed_at
        assert dealer.pending_transfers == 0 and dealer.stats.messages_dropped == 1
        # The send timeout (60 s), checked at the next stall: 16 s after the last resume (63 s).
        dropped_after = now - start - resumed_at[-1]
        assert 16.0 - 1e-9 <= dropped_after <= 16.0 + tick_s + 1e-9, (resumed_at, now - start)
    finally:
        dealer.close(flush_timeout_s=0)
        silent.close(linger=0)
