"""Acknowledged delivery on a channel endpoint: what it holds for each peer and when it resends.

The sending half (``comm.transport.sending``) numbers each message that must arrive and holds it
(:class:`~comm.transport.reliable.OutStream`); this mixin releases what the peer acknowledges,
gives up what exceeds the bounds, and sends again, in number order and behind whatever is queued
for the peer, what is still unacknowledged after :meth:`_DeliverySide.resend_timeout`. A message
given up is never sent afterwards: it leaves the queue, and its transfer stops if it was in one.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from comm.transport.linkest import LinkEstimator
from comm.transport.outgoing import _Queue
from comm.transport.profile import _PEER_GONE, ChannelConfig
from comm.transport.reliable import Held, InStream, OutStream, resend_timeout_s
from comm.transport.stats import ChannelStats
from comm.wire.schema import Message

log = logging.getLogger(__name__)

MAX_REMEMBERED_PEERS = 1 << 16
"""Peers whose last delivery number is remembered after their stream ended."""

RESEND_BURST = 16
"""Held messages sent again to one peer per pass at most (the oldest first)."""


class _DeliverySide:
    """The part of :class:`~comm.transport.sending._SendSide` that does acknowledged delivery."""

    cfg: ChannelConfig
    stats: ChannelStats
    session: str
    out_streams: dict[bytes, OutStream]
    """Per peer: what was sent to it that it has not acknowledged."""
    in_streams: dict[bytes, InStream[Message]]
    """Per peer: what its current session sent here."""
    _last_rseq: OrderedDict[bytes, int]
    given_up: deque[tuple[bytes, Message]]
    """Messages that must arrive given up over a peer's bound, with the peer, for the owner to
    learn the peer does not hold them (bounded: the oldest fall out)."""
    _outgoing: dict[bytes, Any]
    _queued: dict[bytes, _Queue]

    def send_link(self, peer: bytes) -> LinkEstimator:
        raise NotImplementedError

    def _held_bound(self, peer: bytes) -> int:
        raise NotImplementedError

    def _transmit(
        self, peer: bytes, msg: Message, *, block: bool, held: Held | None = None
    ) -> None:
        raise NotImplementedError

    def _out_stream(self, peer: bytes) -> OutStream:
        found = self.out_streams.get(peer)
        if found is None:
            found = self.out_streams[peer] = OutStream(after=self._last_rseq.pop(peer, 0))
        return found

    def _end_out_stream(self, peer: bytes) -> int:
        """Drop the stream to ``peer`` (it restarted or left), remembering the last number used
        in case it comes back; return how many messages it still held."""
        stream = self.out_streams.pop(peer, None)
        if stream is None:
            return 0
        self._last_rseq[peer] = stream.next_rseq - 1
        self._last_rseq.move_to_end(peer)
        while len(self._last_rseq) > MAX_REMEMBERED_PEERS:
            self._last_rseq.popitem(last=False)
        return stream.abandon()

    def _bound_held(self, peer: bytes, newest: Held) -> None:
        """Give up the oldest held messages to ``peer`` beyond the configured bounds, counting
        what waits for it unsent (queued messages are charged their size) and keeping
        ``newest``, the message just added: what the peer makes this end hold for it stays
        within its bound (``max_unacked_bytes``, or its allowance where smaller) plus that one
        message. What is given up is not sent."""
        stream = self.out_streams[peer]
        waiting = self._queued.get(peer)
        unheld = 0 if waiting is None else waiting.unheld_bytes
        before = list(stream.held.values())
        dropped = stream.abandon(
            keep=self.cfg.max_unacked_messages,
            keep_bytes=max(0, self._held_bound(peer) - unheld) + newest.nbytes,
        )
        if not dropped:
            return
        self.given_up.extend((peer, h.msg) for h in before if h.rseq not in stream.held)
        self.stats.messages_abandoned += dropped
        log.warning(
            "peer %r: gave up %d unacknowledged message(s): over %d messages or %d bytes held",
            peer[:32],
            dropped,
            self.cfg.max_unacked_messages,
            self._held_bound(peer),
        )
        out = self._outgoing.get(peer)
        if out is not None and out.held is not None and out.held.rseq not in stream.held:
            del self._outgoing[peer]  # its chunks stop: the stream's floor tells the peer
        if waiting is not None:
            waiting.discard_given_up(stream.held)
            if not waiting:
                del self._queued[peer]

    def _restart_stream(self, peer: bytes) -> None:
        """Give up everything on its way to ``peer``: held, queued, in transfer."""
        dropped = int(self._outgoing.pop(peer, None) is not None)
        dropped += len(self._queued.pop(peer, ()))
        self.stats.messages_dropped += dropped
        stream = self.out_streams.get(peer)
        abandoned = stream.abandon() if stream is not None else 0
        self.stats.messages_abandoned += abandoned
        if dropped or abandoned:
            log.info(
                "peer %r: starting afresh, gave up %d held and %d queued message(s)",
                peer[:32],
                abandoned,
                dropped,
            )

    def resend_timeout(self, peer: bytes, nbytes: int) -> float:
        """How long a message of ``nbytes`` to ``peer`` waits for its acknowledgement."""
        link = self.send_link(peer).snapshot()
        return resend_timeout_s(
            rtt_s=link.rtt_s,
            goodput_bps=link.goodput_bps,
            nbytes=nbytes,
            ack_delay_s=self.cfg.heartbeat_interval_s,
            floor_s=self.cfg.resend_timeout_min_s,
        )

    def _on_delivery_ack(self, peer: bytes, ack: tuple[str, int, tuple[int, ...]]) -> None:
        session, contig, above = ack
        stream = self.out_streams.get(peer)
        if stream is None or session != self.session:
            return  # nothing held, or an acknowledgement of an earlier incarnation of this end
        self.stats.messages_acked += stream.on_ack(contig, above)

    def _heard_from(self, peer: bytes) -> None:
        """``peer`` is connected now: what failed to reach it goes again at once, and what it
        has not acknowledged goes again after the first timeout, not a backed-off one."""
        stream = self.out_streams.get(peer)
        if stream is None:
            return
        stream.heard_at = time.monotonic()
        for held in stream.held.values():
            if held.failed:
                held.failed = False
                held.sent_at = -float("inf")

    def _resend_due(self, now: float) -> None:
        """Send again, in number order, the held messages whose acknowledgement is late, to
        every peer with nothing queued or in transfer (a resend waits behind those)."""
        for peer, stream in list(self.out_streams.items()):
            if peer in self._outgoing or peer in self._queued or not stream.held:
                continue

            def timeout_s(held: Held, peer: bytes = peer) -> float:
                return self.resend_timeout(peer, held.nbytes)

            # At most a burst per pass: a peer that never acknowledges (broken, or hostile)
            # costs a few messages per resend timeout, not everything held for it.
            due = stream.due(now, timeout_s)[:RESEND_BURST]
            for held in due:
                self.stats.messages_resent += 1
                log.info(
                    "peer %r: no acknowledgement of message %d (%s) after %d send(s): sending it "
                    "again",
                    peer[:32],
                    held.rseq,
                    type(held.msg).__name__,
                    held.sends,
                )
                if peer in self._outgoing or peer in self._queued:
                    self._queued.setdefault(peer, _Queue()).append(held.msg, held)
                    continue
                try:
                    self._transmit(peer, held.msg, block=False, held=held)
                except zmq.ZMQError as exc:
                    if exc.errno not in _PEER_GONE:
                        raise
                    held.sent_at = now  # not connected or not draining: try again later
                    held.sends += 1
                    held.failed = exc.errno == zmq.EHOSTUNREACH
