"""The send queue of a channel endpoint against a receiver that answers but never takes more.

A dealer sends to a bare ROUTER socket that reads nothing; the test plays the receiver by
handing the dealer acknowledgements (``_on_ack``) and the clock (``_tick``), so time is passed
in, never slept. What must hold: only an acknowledgement that moves a transfer on is progress,
so acknowledgements alone (zero credit, keepalives, crumbs of credit) never keep a transfer, and
what waits behind it, past a documented bound; what waits for a peer is charged its bytes; and a
message given up is never sent afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import zmq

from comm.codecs.floats import Fp32Codec
from comm.transport.dealer import DealerChannel
from comm.transport.faults import WireFaults
from comm.transport.profile import COORDINATOR_PEER, ChannelConfig
from comm.transport.sender import TransferSender
from comm.wire.frames import frames_nbytes, to_wire
from comm.wire.schema import ChunkAck, Error, InitParams, Leave, Message

PEER = COORDINATOR_PEER
TICK_S = 1 / 8  # exact in binary: ticks land on the bounds, not a rounding past them

CFG = ChannelConfig(
    chunk_bytes=64 << 10,
    initial_credit_bytes=256 << 10,
    stall_timeout_s=1.0,
    send_timeout_s=30.0,
    credit_wait_timeout_s=120.0,
    linger_s=0.0,
)


def _upload(seed: int, nbytes: int = 1 << 20) -> InitParams:
    values = np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)
    enc = Fp32Codec().encode("w", values)
    return InitParams(site_id=f"s{seed}", model_fingerprint=f"fp{seed}", payload=(enc,))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
def dealer_factory(ctx: zmq.Context[Any]) -> Iterator[Any]:
    """Dealers connected to a ROUTER that takes their chunks and never answers."""
    silent: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    made: list[DealerChannel] = []

    def make(cfg: ChannelConfig = CFG) -> DealerChannel:
        dealer = DealerChannel(cfg, identity=f"s{len(made)}", context=ctx)
        made.append(dealer)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        return dealer

    try:
        yield make
    finally:
        for dealer in made:
            dealer.close(flush_timeout_s=0)
        silent.close(linger=0)


def _ack(tx: TransferSender, next_index: int, credit_bytes: int) -> ChunkAck:
    return ChunkAck(transfer_id=tx.transfer_id, next_index=next_index, credit_bytes=credit_bytes)


class _Recording(WireFaults):
    """Loses nothing; notes each small message as it goes out, and whether it was still held
    for delivery then (a message given up must not go)."""

    def __init__(self, dealer: DealerChannel) -> None:
        super().__init__()
        self._dealer = dealer
        self.sent: list[tuple[Message, bool]] = []

    def lose(self, peer: bytes, msg: Message) -> bool:
        stream = self._dealer.out_streams.get(peer)
        held = stream is not None and any(h.msg is msg for h in stream.held.values())
        self.sent.append((msg, held))
        return False


# ---- progress is an advance -------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_only_an_advance_or_the_admitting_grant_is_progress() -> None:
    tx = TransferSender([bytes(10_000)], chunk_bytes=1000, initial_credit_bytes=2000)
    assert [c.index for c in tx.pending_chunks(0.0)] == [0, 1]
    tx.on_ack(tx.transfer_id, 2, 0, now=1.0)  # both in, no credit: held back
    assert tx.waiting_for_credit and tx.last_advance_at == 1.0 and not tx.admitted
    tx.on_ack(tx.transfer_id, 2, 0, now=5.0)  # a keepalive: the stall timer only
    assert tx.last_progress_at == 5.0 and tx.last_advance_at == 1.0
    tx.on_ack(tx.transfer_id, 2, 3000, now=6.0)  # the grant that admits it
    assert tx.admitted and tx.last_advance_at == 6.0
    assert [c.index for c in tx.pending_chunks(6.0)] == [2, 3, 4]
    tx.on_ack(tx.transfer_id, 2, 3001, now=7.0)  # one byte more, nothing acknowledged
    tx.on_ack(tx.transfer_id, 2, 3002, now=8.0)
    assert tx.last_advance_at == 6.0 and tx.last_progress_at == 6.0
    assert tx.stalled(7.0, 1.0)


# ---- acknowledgements alone keep nothing ------------------------------------------------------


@pytest.mark.timeout(60)
def test_keepalives_without_credit_keep_a_transfer_only_for_the_credit_wait(
    dealer_factory: Any,
) -> None:
    """A receiver that takes the initial credit and then only says "still holding it" (as one
    holding the transfer back for its receive budget does, or a hostile one forever): the
    transfer waits past the send timeout (that is legitimate), and is dropped with what waits
    behind it once it has waited ``credit_wait_timeout_s``, keepalives or not."""
    dealer = dealer_factory()
    dealer.send(_upload(0))
    dealer.send(Leave(site_id="s0", reason="behind the upload"))
    (tx,) = dealer.outgoing()
    start = tx.last_progress_at
    assert start is not None and dealer.queued_messages == 1
    dealer._on_ack(PEER, _ack(tx, tx.high_water_index, 0), now=start)
    assert tx.waiting_for_credit
    dropped_at = None
    for tick in range(1, int(2 * CFG.credit_wait_timeout_s / TICK_S)):
        now = start + tick * TICK_S
        if tick % 4 == 0:  # a keepalive every half stall timeout
            dealer._on_ack(PEER, _ack(tx, tx.acked_index, 0), now=now)
        dealer._tick(now)
        if dealer.pending_transfers == 0:
            dropped_at = now - start
            break
    assert dropped_at is not None, "keepalives kept the transfer forever"
    assert CFG.send_timeout_s < CFG.credit_wait_timeout_s <= dropped_at
    assert dropped_at <= CFG.credit_wait_timeout_s + TICK_S
    assert dealer.queued_messages == 0 and dealer.stats.messages_dropped == 2


@pytest.mark.timeout(60)
def test_credit_without_acknowledgement_keeps_a_transfer_only_for_the_send_timeout(
    dealer_factory: Any,
) -> None:
    """A receiver that grants a byte more credit every half second and acknowledges no chunk:
    more credit is not progress, so the transfer is dropped once its acknowledged chunk has not
    moved for the send timeout (checked when it stalls, at most 16 stall timeouts apart)."""
    dealer = dealer_factory()
    dealer.send(_upload(1))
    (tx,) = dealer.outgoing()
    start = tx.last_progress_at
    assert start is not None
    credit = CFG.initial_credit_bytes
    dropped_at = None
    for tick in range(1, int(4 * CFG.send_timeout_s / TICK_S)):
        now = start + tick * TICK_S
        if tick % 4 == 0:
            credit += 1 if tick > 4 else CFG.chunk_bytes  # the first grant admits it
            dealer._on_ack(PEER, _ack(tx, 0, credit), now=now)
        dealer._tick(now)
        if dealer.pending_transfers == 0:
            dropped_at = now - start
            break
    assert dropped_at is not None, "crumbs of credit kept the transfer forever"
    assert CFG.send_timeout_s <= dropped_at <= CFG.send_timeout_s + 16 * CFG.stall_timeout_s + 1
    assert tx.acked_index == 0 and dealer.stats.messages_dropped == 1


# ---- what waits is charged its bytes ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_messages_waiting_behind_a_transfer_count_against_the_held_bytes(
    dealer_factory: Any,
) -> None:
    """Uploads queued behind one that is not moving count their size: the oldest beyond
    ``max_unacked_bytes`` is given up, and what the dealer holds for the peer stays within it
    plus the newest message, however many it is asked to send."""
    cfg = replace(CFG, max_unacked_bytes=3 << 20)
    dealer = dealer_factory(cfg)
    one = frames_nbytes(to_wire(_upload(0)))
    for seed in range(8):
        dealer.send(_upload(seed))
    stream = dealer.out_streams[PEER]
    assert dealer.stats.messages_abandoned >= 8 - 3
    assert stream.held_bytes <= cfg.max_unacked_bytes + one
    assert dealer.pending_transfers + dealer.queued_messages <= 4


@pytest.mark.timeout(60)
def test_other_messages_waiting_behind_a_transfer_are_bounded_in_bytes(
    dealer_factory: Any,
) -> None:
    """Messages not held for delivery (errors) queue behind a transfer too: once what is held
    and waiting for the peer reaches ``max_unacked_bytes``, further ones are dropped."""
    cfg = replace(CFG, max_unacked_bytes=2 << 20)
    dealer = dealer_factory(cfg)
    dealer.send(_upload(0))  # held, in transfer: about 1 MiB of the 2
    error = Error(code=1, detail="x" * 1000)
    for _ in range(2000):  # about 2 MB of errors
        dealer.send(error)
    size = frames_nbytes(to_wire(error))
    waiting = dealer.queued_messages * size
    assert waiting + dealer.out_streams[PEER].held_bytes <= cfg.max_unacked_bytes
    assert dealer.queued_messages < 2000 and dealer.stats.messages_dropped == 2000 - (
        dealer.queued_messages
    )


# ---- what is given up is not sent ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_message_given_up_is_never_sent_afterwards(dealer_factory: Any) -> None:
    """Over ``max_unacked_messages`` the oldest held message is given up: the upload in
    transfer stops (a grant for it sends no chunk), and every message that goes out is still
    held when it goes."""
    cfg = replace(CFG, max_unacked_messages=2)
    dealer = dealer_factory(cfg)
    dealer.faults = faults = _Recording(dealer)
    dealer.send(_upload(0))
    (tx,) = dealer.outgoing()
    start = tx.last_progress_at
    assert start is not None
    leaves = [Leave(site_id="s0", reason=str(i)) for i in range(3)]
    for leave in leaves:
        dealer.send(leave)
    assert dealer.stats.messages_abandoned == 2  # the upload, then the first leave
    chunks = dealer.stats.chunks_sent
    dealer._on_ack(PEER, _ack(tx, tx.high_water_index, 1 << 30), now=start + 0.01)
    dealer._on_ack(PEER, _ack(tx, tx.num_chunks, 0), now=start + 0.02)
    assert dealer.stats.chunks_sent == chunks and dealer.pending_transfers == 0
    dealer._tick(start + 0.03)
    sent = [msg for msg, _ in faults.sent]
    assert sent[-2:] == leaves[1:]  # the ones still held went, in order
    assert all(held for _, held in faults.sent), faults.sent
