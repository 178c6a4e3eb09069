"""Thin ZeroMQ drivers of a transfer: a DEALER sends, a ROUTER receives.

:class:`ZmqTransferSender` and :class:`ZmqTransferReceiver` only receive, tick and send; they
frame their traffic with a one-byte kind frame (:data:`KIND_CHUNK` and friends) and
:func:`~comm.transport.credit.encode_ack`. The benchmarks and tests use them directly; the
channels drive the same state machines with schema messages.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from comm.transport.credit import TransferConfig, decode_ack, encode_ack, stall_timeout_s
from comm.transport.linkest import LinkEstimator
from comm.transport.receiver import TransferReceiver
from comm.transport.sender import TransferSender
from comm.wire.frames import Frame, WireError, from_wire, to_wire
from comm.wire.schema import Chunk, ErrorCode

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Thin ZeroMQ drivers (DEALER sends, ROUTER receives)

KIND_CHUNK = b"c"
"""Sender to receiver: a :class:`~comm.wire.schema.Chunk` in ``comm.wire`` frames follows."""
KIND_ACK = b"a"
"""Receiver to sender: one :func:`encode_ack` frame follows."""
KIND_PING = b"p"
"""Sender to receiver before a transfer: a token follows; answered with :data:`KIND_PONG`."""
KIND_PONG = b"q"
"""Receiver to sender: the ping's token."""
KIND_ECHO = b"e"
"""Sender to receiver on a pong, ahead of any chunk: closes the receiver's RTT sample."""

_ZMQ_GONE = (zmq.EHOSTUNREACH, zmq.EAGAIN)


class TransferError(RuntimeError):
    """A transfer did not finish: too many stalls or past its deadline."""


@dataclass(frozen=True, kw_only=True)
class SendReport:
    """How one transfer went, from the sender's side."""

    transfer_id: str
    total_bytes: int
    num_chunks: int
    chunks_sent: int
    chunks_resent: int
    resumes: tuple[tuple[int, int], ...]
    """Per resume: (the chunk it went back to = the last acknowledged one, one past the highest
    chunk sent until then). Chunks resent are at most the sum of the differences."""
    max_window_bytes: int
    """The largest window the receiver granted."""
    rtt_s: float | None
    """The RTT measured by the ping before the transfer (None if it got no answer)."""
    started_at: float
    elapsed_s: float


class ZmqTransferSender:
    """Sends messages as credit-controlled transfers over a connected DEALER socket.

    The caller owns the socket (and sets its profile: ``ROUTING_ID`` stable across reconnects,
    ``RECONNECT_IVL``, ``SNDHWM >= config.high_water_mark``). One transfer at a time.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        config: TransferConfig | None = None,
        *,
        link: LinkEstimator | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_resumes: int = 50,
    ) -> None:
        self._sock = sock
        self.config = config or TransferConfig()
        self.link = link if link is not None else LinkEstimator()
        self._clock = clock
        self.max_resumes = max_resumes

    def _recv(self, timeout_s: float) -> list[zmq.Frame] | None:
        if not self._sock.poll(max(0, math.ceil(timeout_s * 1000)), zmq.POLLIN):
            return None
        frames: list[zmq.Frame] = self._sock.recv_multipart(copy=False)
        return frames

    def _probe_rtt(self, deadline: float) -> float | None:
        """One ping before the transfer, on an idle link: a clean RTT for both ends."""
        token = os.urandom(8)
        sent_at = self._clock()
        self._sock.send_multipart([KIND_PING, token])
        wait_until = min(deadline, sent_at + stall_timeout_s(self.config, self.link.snapshot()))
        while (now := self._clock()) < wait_until:
            frames = self._recv(wait_until - now)
            if frames is None:
                break
            if len(frames) == 2 and frames[0].bytes == KIND_PONG and frames[1].bytes == token:
                now = self._clock()
                rtt = self.link.on_rtt_sample(now - sent_at, now)
                self._sock.send_multipart([KIND_ECHO, token])
                return rtt
        log.info("no answer to the RTT ping within %.2f s", wait_until - sent_at)
        return None

    def send(
        self,
        frames: Sequence[Frame],
        *,
        transfer_id: str | None = None,
        timeout_s: float = 600.0,
        probe_rtt: bool = True,
    ) -> SendReport:
        """Send one message and return once the receiver acknowledged all of it."""
        started_at = self._clock()
        deadline = started_at + timeout_s
        rtt = self._probe_rtt(deadline) if probe_rtt else None
        sender = TransferSender(
            frames,
            chunk_bytes=self.config.chunk_bytes,
            transfer_id=transfer_id,
            initial_credit_bytes=self.config.initial_credit_bytes,
        )
        resumes: list[tuple[int, int]] = []
        max_window = sender.window_bytes
        tag = f"[transfer={sender.transfer_id}]"
        while not sender.done:
            now = self._clock()
            for chunk in sender.pending_chunks(now):
                self._sock.send_multipart([KIND_CHUNK, *to_wire(chunk)], copy=False)
            stall_s = stall_timeout_s(self.config, self.link.snapshot())
            progress_at = sender.last_progress_at
            wait_s = stall_s if progress_at is None else progress_at + stall_s - now
            got = self._recv(min(wait_s, deadline - now))
            now = self._clock()
            if got is not None:
                self._on_message(sender, got, now)
                max_window = max(max_window, sender.window_bytes)
            if sender.done:
                break
            if now >= deadline:
                raise TransferError(f"{tag} not acknowledged within {timeout_s} s")
            if sender.stalled(now, stall_s):
                self._resume(sender, resumes, stall_s, now)
        return SendReport(
            transfer_id=sender.transfer_id,
            total_bytes=sender.total_bytes,
            num_chunks=sender.num_chunks,
            chunks_sent=sender.chunks_sent,
            chunks_resent=sender.chunks_resent,
            resumes=tuple(resumes),
            max_window_bytes=max_window,
            rtt_s=rtt,
            started_at=started_at,
            elapsed_s=self._clock() - started_at,
        )

    def _resume(
        self, sender: TransferSender, resumes: list[tuple[int, int]], stall_s: float, now: float
    ) -> None:
        """Go back to the last acknowledged chunk of a stalled transfer (at most
        ``max_resumes`` times), noting where it stood in ``resumes``."""
        tag = f"[transfer={sender.transfer_id}]"
        if len(resumes) >= self.max_resumes:
            raise TransferError(f"{tag} stalled {len(resumes)} times")
        resumes.append((sender.acked_index, sender.high_water_index))
        log.info(
            "%s no progress for %.2f s: resuming at chunk %d (sent up to %d)",
            tag,
            stall_s,
            sender.acked_index,
            sender.high_water_index,
        )
        sender.resume(now=now)

    def _on_message(self, sender: TransferSender, frames: list[zmq.Frame], now: float) -> None:
        if len(frames) != 2 or frames[0].bytes != KIND_ACK:
            return  # a late pong, or noise: nothing a sender acts on
        try:
            ack = decode_ack(frames[1].buffer)
        except WireError as exc:
            log.warning("[transfer=%s] dropped an ack: %s", sender.transfer_id, exc)
            return
        if ack.transfer_id != sender.transfer_id:
            return  # a late answer about an earlier transfer
        acked_before = sender.acked_bytes
        try:
            sample = sender.on_ack(ack.transfer_id, ack.next_index, ack.credit_bytes, now)
        except ValueError as exc:
            log.warning("[transfer=%s] dropped an ack: %s", sender.transfer_id, exc)
            return
        if sample is not None:
            self.link.on_rtt_sample(sample, now)
        if sender.acked_bytes > acked_before:
            self.link.on_bytes_acked(sender.acked_bytes - acked_before, now)


class ZmqTransferReceiver:
    """Serves a bound ROUTER socket: chunks in, acknowledgements out, whole messages up.

    The caller owns the socket (``ROUTER_MANDATORY=1`` so an ack to a peer that is gone fails
    at once and is dropped; ``ROUTER_HANDOVER=1`` so a reconnecting peer takes its routing id
    over). One :class:`~comm.transport.linkest.LinkEstimator` per peer is kept in :attr:`links`.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        config: TransferConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = sock
        self.config = config or TransferConfig()
        self.receiver = TransferReceiver(self.config)
        self.links: dict[bytes, LinkEstimator] = {}
        self._clock = clock
        self._pings: dict[bytes, tuple[bytes, float]] = {}
        self.rejected: Counter[str] = Counter()
        self.acks_sent = 0
        self.acks_dropped = 0
        self.max_credit_bytes = 0

    def link(self, peer: bytes) -> LinkEstimator:
        found = self.links.get(peer)
        if found is None:
            found = self.links[peer] = LinkEstimator()
        return found

    def _reply(self, peer: bytes, parts: list[bytes]) -> None:
        try:
            self._sock.send_multipart([peer, *parts], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in _ZMQ_GONE:
                raise
            # The peer's connection is gone: its stall timer recovers what this answer said.
            self.acks_dropped += 1

    def _send_due(self, now: float) -> None:
        """The receiver's grants and keepalives (its receive budget, ``comm.transport.receive_budget``)."""
        for peer, ack in self.receiver.acks_due(now):
            self._reply(peer, [KIND_ACK, encode_ack(ack)])
            self.acks_sent += 1

    def poll_once(self, timeout_s: float) -> tuple[bytes, list[memoryview]] | None:
        """Handle at most one incoming message; return ``(peer, frames)`` when one completes."""
        self._send_due(self._clock())
        if not self._sock.poll(max(0, math.ceil(timeout_s * 1000)), zmq.POLLIN):
            return None
        frames: list[zmq.Frame] = self._sock.recv_multipart(copy=False)
        now = self._clock()
        if len(frames) < 2:
            self.rejected["malformed"] += 1
            return None
        peer, kind = frames[0].bytes, frames[1].bytes
        if kind == KIND_PING and len(frames) == 3:
            self._pings[peer] = (frames[2].bytes, now)
            self._reply(peer, [KIND_PONG, frames[2].bytes])
            return None
        if kind == KIND_ECHO and len(frames) == 3:
            token, sent_at = self._pings.pop(peer, (b"", 0.0))
            if token and token == frames[2].bytes:
                self.link(peer).on_rtt_sample(now - sent_at, now)
            return None
        if kind != KIND_CHUNK:
            self.rejected["malformed"] += 1
            return None
        try:
            chunk = from_wire(
                [f.buffer for f in frames[2:]], max_bytes=self.config.chunk_bytes + (64 << 10)
            )
            if not isinstance(chunk, Chunk):
                raise WireError(ErrorCode.UNEXPECTED, f"{type(chunk).__name__} is not a chunk")
            got = self.receiver.on_chunk(peer, chunk, now, self.link(peer))
        except WireError as exc:
            self.rejected[exc.code.name.lower()] += 1
            log.warning("rejected a chunk from %r: %s", peer[:32], exc)
            return None
        self.max_credit_bytes = max(self.max_credit_bytes, got.ack.credit_bytes)
        self._reply(peer, [KIND_ACK, encode_ack(got.ack)])
        self.acks_sent += 1
        self._send_due(now)
        return None if got.frames is None else (peer, got.frames)

    def serve(
        self,
        stop: threading.Event,
        on_message: Callable[[bytes, list[memoryview]], None],
        *,
        poll_s: float = 0.02,
    ) -> None:
        """Handle messages until ``stop`` is set; whole messages go to ``on_message``."""
        while not stop.is_set():
            done = self.poll_once(poll_s)
            if done is not None:
                on_message(*done)
