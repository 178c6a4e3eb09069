"""The sending half of a channel endpoint: flow-controlled chunking, per-peer order, stalls.

Messages whose frames exceed ``chunk_bytes`` travel as digested chunks under credit-based flow
control: only what the receiver's credit allows goes out at once, the rest as acknowledgements
arrive. Messages to one peer go out in the order they were sent (heartbeats may overtake). A
transfer whose acknowledgements stop advancing resumes from the last acknowledged chunk (each
resume without progress since doubles the wait before the next, up to 16 stall timeouts: one
TCP connection loses nothing unless it breaks, so a slow receiver needs time, not resends); one
whose acknowledged index does not advance for ``send_timeout_s`` is dropped and counted, with
what waits behind it, whatever acknowledgements came meanwhile (more credit alone is no
progress). A transfer the receiver holds back for its receive budget (every chunk sent
acknowledged, no credit beyond the initial one) waits without resending: the receiver's periodic
acknowledgements keep it, for ``credit_wait_timeout_s`` at most (see
:meth:`~comm.transport.outgoing._Outgoing.give_up_reason`).

What waits for a peer is charged to it in bytes: a message queued behind a large one counts its
size against ``max_unacked_bytes`` with what is held for the peer unacknowledged, and a message
given up for that bound is never sent afterwards (it leaves the queue, or its transfer stops).

Above the transfers sits acknowledged delivery (``comm.transport.delivering``): a message that
must arrive is numbered and held until the peer acknowledges it, and every message to a peer
carries this end's acknowledgement of what that peer sent.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from comm.transport.charges import PeerCharges
from comm.transport.credit import stall_timeout_s
from comm.transport.delivering import _DeliverySide
from comm.transport.faults import WireFaults
from comm.transport.linkest import LinkEstimator
from comm.transport.outgoing import _MAX_BACKOFF, _Outgoing, _Queue
from comm.transport.profile import _PEER_GONE, ChannelConfig, RejectHook
from comm.transport.receiver import TransferReceiver
from comm.transport.reliable import MUST_ARRIVE, Held
from comm.transport.sender import TransferSender
from comm.transport.stats import ChannelStats
from comm.wire.frames import (
    ReplayGuard,
    WireError,
    frames_nbytes,
    to_wire,
)
from comm.wire.schema import ChunkAck, ErrorCode, Heartbeat, Join, Message, Welcome

log = logging.getLogger(__name__)


class _SendSide(_DeliverySide):
    """The state every channel endpoint holds, and its sending: flow-controlled chunking,
    per-peer ordering, acknowledgements out, stall recovery. :class:`_Endpoint` adds receiving."""

    def __init__(self, sock: zmq.Socket[Any], cfg: ChannelConfig, on_reject: RejectHook | None):
        self._sock = sock
        self.cfg = cfg
        self.stats = ChannelStats()
        self._on_reject = on_reject
        self.transfer_cfg = cfg.transfer
        self.charges = PeerCharges(self.transfer_cfg.peer_hold_bytes)
        """What each peer makes this end hold (transfers it sends, messages held behind a gap),
        against its allowance (``comm.transport.charges``)."""
        self._receiver = TransferReceiver(self.transfer_cfg, self.charges)
        # Per peer, messages go out in the order they were sent: while a large one is in
        # transfer (one per peer at most), later ones wait behind it (heartbeats excepted).
        self._outgoing: dict[bytes, _Outgoing] = {}
        self._queued: dict[bytes, _Queue] = {}
        # Acknowledged delivery (see _DeliverySide).
        self.out_streams = {}
        self.in_streams = {}
        self._last_rseq = OrderedDict()
        self.given_up = deque(maxlen=1024)
        self.faults: WireFaults | None = None
        """A deterministic loss injector (tests and drills only)."""
        self.links: dict[bytes, LinkEstimator] = {}
        """Per peer: the path's RTT and the goodput of what the peer sends here, which sizes the
        credit window granted to it."""
        self.send_links: dict[bytes, LinkEstimator] = {}
        """Per peer: the path's RTT and the goodput of what is sent to it (bytes acknowledged),
        which sizes the stall timeout of transfers to it."""
        # Complete messages received while flush() serviced acknowledgements; recv returns them.
        self._backlog: deque[tuple[bytes, Message]] = deque()
        # Messages a delivery released along with the one returned (a gap filled): next.
        self._released: deque[tuple[bytes, Message]] = deque()
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        # First-chunk arrival per transfer: goodput = bytes after the first chunk / time since.
        self._transfer_start: dict[tuple[bytes, str], tuple[float, int]] = {}
        self._expire_at = 0.0  # next sweep of idle partly received transfers
        self._oversize: int | None = None  # the size of the frame list just read, if over
        # Replay protection: our session and sequence on every frame list we send; per sender,
        # the sessions seen and the last sequence of the current one (bounded, see ReplayGuard).
        self.session = os.urandom(8).hex()
        self._seq = 0
        self.replay = ReplayGuard()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- link estimates -------------------------------------------------------------------

    def link(self, peer: bytes) -> LinkEstimator:
        """The estimator of what ``peer`` sends here (RTT included); created on first use."""
        found = self.links.get(peer)
        if found is None:
            found = self.links[peer] = LinkEstimator()
        return found

    def send_link(self, peer: bytes) -> LinkEstimator:
        """The estimator of what is sent to ``peer`` (RTT included); created on first use."""
        found = self.send_links.get(peer)
        if found is None:
            found = self.send_links[peer] = LinkEstimator()
        return found

    def rtt_sample(self, peer: bytes, seconds: float, now: float) -> None:
        """One measured round trip to ``peer`` (the path's, so both directions' estimators)."""
        self.link(peer).on_rtt_sample(seconds, now)
        self.send_link(peer).on_rtt_sample(seconds, now)

    # -- sending --------------------------------------------------------------------------

    @property
    def pending_transfers(self) -> int:
        """Large messages still being sent (not every chunk acknowledged yet)."""
        return len(self._outgoing)

    @property
    def queued_messages(self) -> int:
        """Messages waiting behind a large one to the same peer."""
        return sum(len(q) for q in self._queued.values())

    def outgoing(self, peer: bytes | None = None) -> list[TransferSender]:
        """The transfer state of the large messages being sent (to ``peer``, or to anyone)."""
        return [o.tx for p, o in self._outgoing.items() if peer is None or p == peer]

    def _send_frames(self, peer: bytes, msg: Message) -> None:
        """Send ``msg`` to ``peer`` now, or queue it behind a large message still in transfer
        to that peer (messages arrive in the order they were sent). A heartbeat carries only
        liveness and may overtake. Raises ``zmq.ZMQError`` when the peer is unreachable; a
        message that must arrive stays held all the same, and goes again later. A ``Join`` (and
        the ``Welcome`` answering it) starts the conversation afresh: what was still held, queued
        or in transfer to the peer belonged to the membership it replaces and is given up (the
        peer stops waiting for it by the stream's floor).

        A message that waits is charged its size at once (``max_unacked_bytes``, with what is
        held for the peer); one that must arrive gives up the oldest held beyond the bound, any
        other is dropped when it would pass it."""
        held = None
        if isinstance(msg, Join | Welcome):
            self._restart_stream(peer)
        if type(msg) in MUST_ARRIVE:
            held = self._out_stream(peer).add(msg)
        waits = not isinstance(msg, Heartbeat) and (peer in self._outgoing or peer in self._queued)
        if waits and not self._enqueue(peer, msg, held):
            return
        if held is not None:
            self._bound_held(peer, held)
        if waits:
            if peer not in self._outgoing:
                self._release(peer)  # what it waited behind was given up
            return
        try:
            self._transmit(peer, msg, block=True, held=held)
        except zmq.ZMQError:
            if held is not None:  # tried: it goes again when the peer is heard from
                held.sent_at = time.monotonic()
                held.sends += 1
                held.failed = True
            raise

    def _transmit(
        self, peer: bytes, msg: Message, *, block: bool, held: Held | None = None
    ) -> None:
        prefix = self._prefix_for(peer)
        flags = 0 if block else zmq.NOBLOCK
        delivery = None
        if held is not None:
            delivery = (held.rseq, self.out_streams[peer].floor)
        inbound = self.in_streams.get(peer)
        frames = to_wire(
            msg,
            session=self.session,
            seq=self._next_seq(),
            delivery=delivery,
            ack=inbound.ack() if inbound is not None else None,
        )
        nbytes = frames_nbytes(frames)
        if held is not None:
            held.nbytes = nbytes
            held.sent_at = None  # set once it is out whole
            held.failed = False
        if nbytes <= self.cfg.chunk_bytes:
            if self.faults is None or not self.faults.lose(peer, msg):
                self._sock.send_multipart([*prefix, *frames], copy=False, flags=flags)
            self.stats.bytes_sent += nbytes
            self.stats.messages_sent += 1
            if held is not None:
                held.sent_at = time.monotonic()
                held.sends += 1
            return
        # The inner message keeps its sequence number; every chunk gets its own as well. Only
        # what the receiver's credit allows goes now: its acks (handled in recv and flush)
        # release the rest, and a stall resumes from the last acknowledged chunk (_tick).
        now = time.monotonic()
        tx = TransferSender(
            frames,
            chunk_bytes=self.transfer_cfg.chunk_bytes,
            initial_credit_bytes=self.transfer_cfg.initial_credit_bytes,
        )
        out = _Outgoing(peer=peer, prefix=prefix, tx=tx, progress_at=now, held=held)
        if self.faults is not None:
            self.faults.starting(peer, msg, tx.transfer_id)
        self._outgoing[peer] = out
        try:
            self._pump(out, now, block=block)
        except zmq.ZMQError:
            del self._outgoing[peer]
            raise
        self.stats.messages_sent += 1

    def _enqueue(self, peer: bytes, msg: Message, held: Held | None) -> bool:
        """Put ``msg`` behind what waits for ``peer``, charged its size; False: not held for
        delivery and over the peer's bound, dropped instead (counted)."""
        nbytes = frames_nbytes(to_wire(msg, session=self.session))  # header aside, its size
        waiting = self._queued.get(peer)
        if held is not None:
            held.nbytes = nbytes
        else:
            stream = self.out_streams.get(peer)
            holding = (0 if stream is None else stream.held_bytes) + (
                0 if waiting is None else waiting.unheld_bytes
            )
            if holding + nbytes > self._held_bound(peer):
                self.stats.messages_dropped += 1
                log.warning(
                    "peer %r: dropped a %s of %d bytes: %d bytes wait or are held for it already",
                    peer[:32],
                    type(msg).__name__,
                    nbytes,
                    holding,
                )
                return False
        if waiting is None:
            waiting = self._queued[peer] = _Queue()
        waiting.append(msg, held, nbytes)
        return True

    def _release(self, peer: bytes) -> None:
        """Send what waits for ``peer`` up to (and including the start of) the next large one."""
        waiting = self._queued.get(peer)
        while waiting and peer not in self._outgoing:
            msg, held = waiting.first()
            try:
                self._transmit(peer, msg, block=False, held=held)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EAGAIN:
                    return  # not draining right now: the next tick tries again
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._drop_queue(peer, "the peer is unreachable", failed=True)
                return
            waiting.popleft()
        if waiting is not None and not waiting:
            del self._queued[peer]

    def _drop_queue(self, peer: bytes, why: str, *, failed: bool = False) -> int:
        waiting = self._queued.pop(peer, None)
        if not waiting:
            return 0
        self.stats.messages_dropped += len(waiting)
        now = time.monotonic()
        for _, held in waiting:
            if held is not None:  # still held: it goes again at once, or once the peer speaks
                held.sent_at = now if failed else -math.inf
                held.sends += 1
                held.failed = failed
        log.warning("peer %r: dropped %d queued message(s): %s", peer[:32], len(waiting), why)
        return len(waiting)

    def _pump(self, out: _Outgoing, now: float, *, block: bool) -> None:
        """Send every chunk of ``out`` its credit allows. ``block``: a send that fails raises
        (the caller's send); otherwise a peer that is gone or not draining ends the pump, the
        unsent chunk counts as lost and the stall timer resends it."""
        tx = out.tx
        resent_before = tx.chunks_resent
        try:
            for chunk in tx.pending_chunks(now):
                parts = to_wire(chunk, session=self.session, seq=self._next_seq())
                if self.faults is not None and self.faults.lose_chunk(out.peer, tx.transfer_id):
                    self.stats.bytes_sent += frames_nbytes(parts)
                    self.stats.chunks_sent += 1
                    continue
                try:
                    self._sock.send_multipart(
                        [*out.prefix, *parts], copy=False, flags=0 if block else zmq.NOBLOCK
                    )
                except zmq.ZMQError as exc:
                    if block or exc.errno not in _PEER_GONE:
                        raise
                    return
                self.stats.bytes_sent += frames_nbytes(parts)
                self.stats.chunks_sent += 1
        finally:
            self.stats.chunks_resent += tx.chunks_resent - resent_before

    def _send_ack(self, peer: bytes, ack: ChunkAck) -> None:
        frames = to_wire(ack, session=self.session, seq=self._next_seq())
        try:
            self._sock.send_multipart([*self._prefix_for(peer), *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in _PEER_GONE:
                raise
            # The peer is gone or not draining: its stall timer recovers what this ack said.
            self.stats.acks_dropped += 1
            return
        self.stats.bytes_sent += frames_nbytes(frames)

    def _prefix_for(self, peer: bytes) -> list[bytes]:
        """The routing frames that address ``peer`` (none on a DEALER)."""
        raise NotImplementedError

    def _on_ack(self, peer: bytes, ack: ChunkAck, now: float | None = None) -> None:
        out = self._outgoing.get(peer)
        if out is None or out.tx.transfer_id != ack.transfer_id:
            return  # a late ack of a finished, dropped or forgotten transfer
        tx = out.tx
        now = time.monotonic() if now is None else now
        acked_before = tx.acked_bytes
        advanced_before = tx.last_advance_at
        try:
            rtt_s = tx.on_ack(ack.transfer_id, ack.next_index, ack.credit_bytes, now)
        except ValueError as exc:
            raise WireError(ErrorCode.MALFORMED, f"ack: {exc}") from None
        if rtt_s is not None:
            self.rtt_sample(peer, rtt_s, now)
        if tx.last_advance_at != advanced_before:
            # Acknowledged further, or admitted by a receiver that held it back: progress. A
            # keepalive while held back only restarts the transfer's stall timer.
            out.progress_at = now
            out.resumes_in_a_row = 0
        if tx.acked_bytes > acked_before:
            self.send_link(peer).on_bytes_acked(tx.acked_bytes - acked_before, now)
        if tx.waiting_for_credit and not out.waited:
            out.waited = True
            self.stats.credit_waits += 1
        if tx.done:
            del self._outgoing[peer]
            if out.held is not None:
                out.held.sent_at = now
                out.held.sends += 1
            self._release(peer)
        else:
            self._pump(out, now, block=False)

    def _tick(self, now: float) -> None:
        """Resume stalled transfers from their last acknowledged chunk; drop hopeless ones."""
        for peer in [p for p in self._queued if p not in self._outgoing]:
            self._release(peer)  # a queued send that found the peer not draining
        for peer, out in list(self._outgoing.items()):
            tx = out.tx
            base_s = stall_timeout_s(self.transfer_cfg, self.send_link(out.peer).snapshot())
            stall_s = base_s * 2 ** min(out.resumes_in_a_row, _MAX_BACKOFF)
            stalled = tx.stalled(now, stall_s)
            if not stalled and not tx.waiting_for_credit:
                continue
            tag = f"[transfer={tx.transfer_id} peer={out.peer[:32]!r}]"
            why = out.give_up_reason(
                now,
                base_s=base_s,
                send_timeout_s=self.cfg.send_timeout_s,
                credit_wait_s=self.cfg.credit_wait_timeout_s,
            )
            if why is not None:
                del self._outgoing[peer]
                self.stats.messages_dropped += 1
                # Known lost. A peer heard from since the transfer stopped moving is there: the
                # message goes again at once, on a new transfer; one silent since, when it is
                # heard from (or after its resend timeout).
                stream = self.out_streams.get(peer)
                silent = stream is None or stream.heard_at <= out.progress_at
                if out.held is not None:
                    out.held.sent_at = now if silent else -math.inf
                    out.held.sends += 1
                    out.held.failed = silent
                log.warning(
                    "%s %s: dropped at chunk %d of %d", tag, why, tx.acked_index, tx.num_chunks
                )
                self._drop_queue(peer, "a large message before them was dropped", failed=silent)
                continue
            if tx.waiting_for_credit or not stalled:
                continue  # nothing in flight, nothing to resend (its keepalives may be late)
            log.info(
                "%s no ack for %.2f s: resuming at chunk %d (sent up to %d of %d)",
                tag,
                stall_s,
                tx.acked_index,
                tx.high_water_index,
                tx.num_chunks,
            )
            tx.resume(now=now)
            out.resumes_in_a_row += 1
            self.stats.transfer_resumes += 1
            self._pump(out, now, block=False)
        self._resend_due(now)

    def _held_bound(self, peer: bytes) -> int:
        """The bytes this end may hold for ``peer`` (sent unacknowledged, or waiting): the
        channel's ``max_unacked_bytes``, or less where the owner's allowance for the peer
        (``comm.transport.charges``) is smaller, so a peer costs its allowance each way."""
        return min(self.cfg.max_unacked_bytes, self.charges.allowance(peer))

    def _end_in_stream(self, peer: bytes) -> None:
        """Forget what ``peer``'s session sent here, releasing what it held behind a gap."""
        stream = self.in_streams.pop(peer, None)
        if stream is not None and stream.pending_bytes:
            self.charges.release(peer, stream.pending_bytes)

    def _drop_peer_transfers(self, peer: bytes) -> int:
        """Forget every transfer to and from ``peer``, what waits behind them and both delivery
        streams; return how many messages to it were given up."""
        self._receiver.drop_sender(peer)
        self.stats.messages_abandoned += self._end_out_stream(peer)
        self._end_in_stream(peer)
        self.charges.forget(peer)
        for key in [k for k in self._transfer_start if k[0] == peer]:
            del self._transfer_start[key]
        dropped = int(self._outgoing.pop(peer, None) is not None)
        waiting = self._queued.pop(peer, None)
        return dropped + (len(waiting) if waiting else 0)
