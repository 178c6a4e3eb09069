"""A channel endpoint: the sending half plus receiving, validation, flush and close.

Every received frame list is parsed by the frame codec; anything malformed, oversize, replayed
or of the wrong version is dropped, counted, and reported through ``on_reject`` without raising
to the caller. Chunks are reassembled and acknowledged; acknowledgements release what waits.
The receiver's other acknowledgements (grants when its receive budget admits a waiting transfer,
keepalives to transfers it holds back) go out after every chunk and on every poll slice.
A complete message's delivery acknowledgement releases what this end holds for the sender, and
a numbered message this end already has is dropped (``comm.transport.reliable``).

What a peer makes this end hold beyond the message at hand (transfers, messages behind a gap)
is charged to it (``comm.transport.charges``); a peer that holds bytes and sends nothing for
``idle_expire_s`` is dropped, which frees them. A frame list is read one frame at a time: one
with more frames or more bytes than a message may have is refused as it arrives, its frames
read and let go, never gathered (``max_message_bytes`` bounds a message, not each frame).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import zmq

from comm.transport.profile import _ms
from comm.transport.reliable import InStream
from comm.transport.sending import _SendSide
from comm.wire.frames import (
    Envelope,
    Frame,
    WireError,
    frames_nbytes,
    from_wire_envelope,
)
from comm.wire.payload import PACK_BELOW
from comm.wire.schema import Chunk, ChunkAck, ErrorCode, Message

log = logging.getLogger(__name__)


class _Endpoint(_SendSide):
    """What ROUTER and DEALER channels share: send with flow-controlled chunking, receive with
    validation, acknowledgements both ways."""

    def _check_replay(self, sender: bytes, session: str, seq: int, inner: bool) -> None:
        if self.replay.check(sender, session, seq, inner=inner):
            # The peer restarted: its transfer state is gone, so ours with it is void.
            dropped = self._drop_peer_transfers(sender)
            if dropped:
                self.stats.messages_dropped += dropped
                log.warning(
                    "peer %r has a new session: dropped %d message(s) to it", sender[:32], dropped
                )

    def _reject(self, sender: bytes, code: ErrorCode, detail: str) -> None:
        self.stats.rejected[code.name.lower()] += 1
        log.warning("rejected message from %r: %s: %s", sender[:32], code.name.lower(), detail)
        if self._on_reject is not None:
            self._on_reject(sender, code, detail)

    @property
    def max_message_frames(self) -> int:
        """The most frames a message sent whole may have: its header and fields, the pack of
        small buffers, and one frame per buffer of at least ``PACK_BELOW`` bytes."""
        return 16 + self.cfg.max_message_bytes // PACK_BELOW

    def _recv_frames(self) -> list[zmq.Frame]:
        """Read one frame list (one is waiting), a frame at a time. One with more frames or
        bytes than a message may have comes back cut to its first two frames (enough to tell
        who sent it), the rest read and let go; :meth:`_refuse_oversize` then rejects it."""
        sock, limit = self._sock, self.cfg.max_message_bytes + (64 << 10)  # + the routing id
        frames: list[zmq.Frame] = []
        nbytes, over = 0, False
        while True:
            frame = sock.recv(copy=False)
            nbytes += len(frame)
            if not over:
                frames.append(frame)
                over = len(frames) > self.max_message_frames + 1 or nbytes > limit
            more = frame.more
            if over:
                frames = frames[:2]  # the routing id and the first frame: who sent it
            if not more:
                break
        self._oversize = nbytes if over else None
        if over:
            self.stats.bytes_received += nbytes
        return frames

    def _refuse_oversize(self, sender: bytes) -> bool:
        """Whether the frame list just read was over the bounds (then it is rejected)."""
        nbytes, self._oversize = self._oversize, None
        if nbytes is None:
            return False
        self._reject(
            sender,
            ErrorCode.OVERSIZE,
            f"a message of over {self.max_message_frames} frames or "
            f"{self.cfg.max_message_bytes} bytes "
            f"({nbytes} bytes read and let go)",
        )
        return True

    def _parse(self, sender: bytes, frames: Sequence[Frame]) -> Message | None:
        """One received frame list to a complete message; None for an acknowledgement, a chunk
        of a message still partial, or anything rejected."""
        size = frames_nbytes(frames)
        self.stats.bytes_received += size
        self.charges.heard(sender, time.monotonic())
        got_size: int | None = None  # a chunked message's size
        try:
            msg, env = from_wire_envelope(frames, max_bytes=self.cfg.max_message_bytes)
            self._check_replay(sender, env.session, env.seq, inner=False)
            if isinstance(msg, ChunkAck):
                self._on_ack(sender, msg)
                return None
            if isinstance(msg, Chunk):
                now = time.monotonic()
                key = (sender, msg.transfer_id)
                try:
                    got = self._receiver.on_chunk(sender, msg, now, self.link(sender))
                finally:
                    self._send_receiver_acks(now)  # grants to transfers admitted meanwhile
                self._send_ack(sender, got.ack)
                new = not got.duplicate and got.frames is None and not got.waiting
                if new and key not in self._transfer_start:
                    # Goodput from here on: a transfer's time waiting for the budget is not
                    # the link's.
                    self._transfer_start[key] = (now, msg.offset + memoryview(msg.data).nbytes)
                    if len(self._transfer_start) > 4 * self.transfer_cfg.max_pending:
                        self._prune_transfer_starts()
                if got.frames is None:
                    return None
                first = self._transfer_start.pop(key, None)
                if first is not None and msg.num_chunks > 1 and now > first[0]:
                    self.stats.goodput_sample(8 * (msg.total_bytes - first[1]) / (now - first[0]))
                got_size = msg.total_bytes
                msg, env = from_wire_envelope(got.frames)
                self._check_replay(sender, env.session, env.seq, inner=True)
                if isinstance(msg, Chunk | ChunkAck):
                    raise WireError(ErrorCode.MALFORMED, "a chunk or ack inside a chunked transfer")
        except WireError as exc:
            self._reject(sender, exc.code, exc.detail)
            return None
        self.stats.messages_received += 1
        delivered = self._delivered(sender, env, msg, size if got_size is None else got_size)
        if not delivered:
            return None
        self._released.extend((sender, later) for later in delivered[1:])
        return delivered[0]

    def _delivered(self, sender: bytes, env: Envelope, msg: Message, nbytes: int) -> list[Message]:
        """Take a complete message's acknowledgement; what to deliver now, in the order sent:
        nothing for a numbered message this end already has (dropped, counted) or one held
        behind a gap, several when it fills one."""
        if env.ack is not None:
            self._on_delivery_ack(sender, env.ack)
        self._heard_from(sender)
        if env.delivery is None:
            return [msg]
        stream = self.in_streams.get(sender)
        if stream is None or stream.session != env.session:
            self._end_in_stream(sender)
            stream = self.in_streams[sender] = InStream(env.session)
        before, refused, held = stream.duplicates, stream.refused, stream.pending_bytes
        delivered = stream.offer(*env.delivery, msg, nbytes=nbytes, room=self.charges.room(sender))
        self.stats.duplicates_dropped += stream.duplicates - before
        if stream.pending_bytes > held:
            self.charges.charge(sender, stream.pending_bytes - held, "a message behind a gap")
        elif stream.pending_bytes < held:
            self.charges.release(sender, held - stream.pending_bytes)
        if stream.refused > refused:
            self._reject(
                sender,
                ErrorCode.OVERSIZE,
                f"message {env.delivery[0]} of {nbytes} bytes arrived behind a gap that holds "
                f"{len(stream.pending)} message(s) of {stream.pending_bytes} bytes: dropped "
                "unacknowledged, to be sent again",
            )
        return delivered

    def _send_receiver_acks(self, now: float) -> None:
        """Send what the receiver owes beyond the chunk at hand (grants to transfers it admitted,
        keepalives to those it holds back), and copy its figures into the stats."""
        for peer, ack in self._receiver.acks_due(now):
            self._send_ack(peer, ack)
        receiver, stats = self._receiver, self.stats
        stats.transfers_waited = receiver.stats.transfers_waited
        stats.transfers_waiting = receiver.waiting
        stats.reassembly_peak_bytes = receiver.stats.peak_held_bytes

    def _prune_transfer_starts(self) -> None:
        """Forget the start times of transfers the receiver no longer holds (it refused them)."""
        for key in list(self._transfer_start):
            if self._receiver.next_index(*key) is None:
                del self._transfer_start[key]

    def _expire_idle(self, now: float) -> None:
        """About once a second: drop partly received transfers that stopped making progress
        (their sender gave up or vanished), so their buffers do not stay forever."""
        if now < self._expire_at:
            return
        self._expire_at = now + 1.0
        for peer in self.charges.quiet(now, self.transfer_cfg.idle_expire_s):
            self._drop_quiet(peer)
        dropped = self._receiver.expire(now)
        if dropped:
            self.stats.rejected["transfer_idle"] += dropped
            log.warning(
                "dropped %d partly received transfer(s) idle for over %.0f s",
                dropped,
                self.transfer_cfg.idle_expire_s,
            )

    def _drop_quiet(self, peer: bytes) -> None:
        """``peer`` sent nothing for ``idle_expire_s``: drop what it holds here."""
        if peer in self._receiver.senders() or peer in self.in_streams:
            log.warning(
                "peer %r sent nothing for %.0f s: dropped what it held",
                peer[:32],
                self.transfer_cfg.idle_expire_s,
            )
            self.stats.rejected["peer_quiet"] += 1
        self._receiver.drop_sender(peer)
        self._end_in_stream(peer)

    def _recv_one(self) -> tuple[bytes, Message] | None:
        """Read one frame list (one is waiting) and handle it; a complete message is returned."""
        raise NotImplementedError

    def _poll(self, timeout_s: float) -> bool:
        """Wait for input up to ``timeout_s``, in slices, so stalled transfers resume meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            self._tick(now)
            self._expire_idle(now)
            self._send_receiver_acks(now)
            slice_s = min(deadline - now, 0.05)
            if self._poller.poll(max(0, int(slice_s * 1000))):
                return True
            if time.monotonic() >= deadline:
                return False

    def _next(self, timeout_s: float) -> tuple[bytes, Message] | None:
        if self._backlog:
            return self._backlog.popleft()
        if self._released:
            return self._released.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._poll(deadline - time.monotonic()):
                return None
            got = self._recv_one()
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                return None

    def flush(self, timeout_s: float) -> bool:
        """Service acknowledgements until no large message (nor one queued behind it) is left to
        send, or ``timeout_s`` passed; True when none is left. Messages that arrive meanwhile
        wait for ``recv``."""
        deadline = time.monotonic() + timeout_s
        while self._outgoing or self._queued:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._poll(min(left, 0.05)):
                got = self._recv_one()
                if got is not None:
                    self._backlog.append(got)
                self._backlog.extend(self._released)  # what it released follows it
                self._released.clear()
        return True

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Flush large messages still being sent (up to ``flush_timeout_s``, default
        ``linger_s``), then close the socket (which lingers ``linger_s`` for what is queued)."""
        timeout_s = self.cfg.linger_s if flush_timeout_s is None else flush_timeout_s
        if (self._outgoing or self._queued) and timeout_s > 0 and not self._sock.closed:
            try:
                if not self.flush(timeout_s):
                    log.warning(
                        "closing with %d large and %d queued message(s) unsent",
                        len(self._outgoing),
                        self.queued_messages,
                    )
            except zmq.ZMQError as exc:
                log.warning("flush before close failed: %s", exc)
        self._sock.close(linger=_ms(self.cfg.linger_s))
