"""ZeroMQ channels with the WAN socket profile: ROUTER on the coordinator, DEALER on a site.

The channel owns sockets, framing, chunking, flow control and rejection of bad input; it knows
nothing about rounds or models. Messages whose frames exceed ``chunk_bytes`` travel as digested
chunks under credit-based flow control (``comm.transfer``): ``send`` puts out only what the
receiver's credit allows, the receiver answers chunks with :class:`~comm.wire.schema.ChunkAck`, and the
rest goes out as those acknowledgements arrive, inside ``recv`` (or ``flush``). Messages to one
peer arrive in the order they were sent: those sent while a large one is in transfer wait behind
it (only heartbeats, which carry nothing but liveness, may overtake). A transfer whose
acknowledgements stop advancing resumes from the last acknowledged chunk; one that makes no
progress for ``send_timeout_s`` is dropped and counted, with what waits behind it. Chunks and
acknowledgements carry the sender's (session, sequence) like every other message, so a resent
chunk is a new send with a new sequence number. Every received message is parsed by
``comm.wire``; anything malformed, oversize, replayed or of the wrong version is dropped, counted,
and reported through ``on_reject`` without raising to the caller. :class:`SiteLink` runs a DEALER
on its own I/O thread so a site keeps its liveness (heartbeats) and its transfers moving while
its main thread trains.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from comm.linkest import LinkEstimator
from comm.security.identity import CurveKeys, PeerIdentity, peer_of
from comm.transfer import TransferConfig, TransferReceiver, TransferSender, stall_timeout_s
from comm.wire.frames import (
    Frame,
    ReplayGuard,
    WireError,
    frames_nbytes,
    from_wire_envelope,
    to_wire,
)
from comm.wire.schema import Chunk, ChunkAck, ErrorCode, Heartbeat, Message

log = logging.getLogger(__name__)

RejectHook = Callable[[bytes, ErrorCode, str], None]

COORDINATOR_PEER = b"coordinator"
"""How a DEALER channel names its one peer (in rejections, transfers and link estimates)."""

_PEER_GONE = (zmq.EHOSTUNREACH, zmq.EAGAIN)


@dataclass(frozen=True, kw_only=True)
class ChannelConfig:
    """Socket profile for a WAN link (DESIGN.md §3)."""

    heartbeat_interval_s: float = 1.0
    """ZMTP PING interval; also the period of application heartbeats sent by a site."""
    heartbeat_timeout_s: float = 10.0
    """A peer silent this long is considered gone (ZMTP) and its connection dropped."""
    reconnect_interval_s: float = 0.1
    """First reconnect delay after a connection is lost."""
    reconnect_interval_max_s: float = 5.0
    """Reconnect back-off ceiling."""
    chunk_bytes: int = 256 << 10
    """Messages larger than this travel as chunks of this size, each with its own digest
    (small enough that most transfers span several chunks, which is how goodput is measured)."""
    max_transfer_bytes: int = 4 << 30
    """Largest chunked message accepted; bounds the reassembly buffer."""
    linger_s: float = 2.0
    """How long close() waits to flush queued messages."""
    send_timeout_s: float = 30.0
    """A send blocked this long (peer not draining) fails instead of hanging."""
    high_water_mark: int = 1024
    """Messages queued per peer; sized for a credit window of chunk-sized messages."""
    curve: CurveKeys | None = None
    """CURVE keys; None runs unencrypted (insecure mode)."""
    min_window_bytes: int = 8 << 20
    """Smallest credit window a receiver grants for a chunked message, and what a sender may
    send before the first acknowledgement (at least one chunk)."""
    max_window_bytes: int = 256 << 20
    """Largest credit window a receiver grants, whatever the link estimate says."""
    stall_timeout_s: float = 1.0
    """Least time without an advancing acknowledgement before a chunked message resumes from
    its last acknowledged chunk (longer on a slow or distant link, see
    ``comm.transfer.stall_timeout_s``)."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "reconnect_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"channel.{name} must be > 0, got {getattr(self, name)}")
        if self.reconnect_interval_max_s < self.reconnect_interval_s:
            raise ValueError("channel.reconnect_interval_max_s must be >= reconnect_interval_s")
        if not 4096 <= self.chunk_bytes <= 64 << 20:
            raise ValueError(
                f"channel.chunk_bytes must be in [4 KiB, 64 MiB], got {self.chunk_bytes}"
            )
        if self.max_transfer_bytes < self.chunk_bytes:
            raise ValueError("channel.max_transfer_bytes must be >= channel.chunk_bytes")
        if self.high_water_mark < 16:
            raise ValueError("channel.high_water_mark must be >= 16")
        if self.min_window_bytes < 1:
            raise ValueError(f"channel.min_window_bytes must be >= 1, got {self.min_window_bytes}")
        if self.max_window_bytes < self.min_window_bytes:
            raise ValueError("channel.max_window_bytes must be >= channel.min_window_bytes")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"channel.stall_timeout_s must be > 0, got {self.stall_timeout_s}")

    @property
    def transfer(self) -> TransferConfig:
        """The flow control of chunked messages on this channel (``comm.transfer``)."""
        window = max(self.min_window_bytes, self.chunk_bytes)
        return TransferConfig(
            chunk_bytes=self.chunk_bytes,
            initial_credit_bytes=window,
            min_window_bytes=window,
            max_window_bytes=max(self.max_window_bytes, window),
            max_transfer_bytes=self.max_transfer_bytes,
            stall_timeout_s=self.stall_timeout_s,
        )

    @property
    def max_message_bytes(self) -> int:
        """Largest unchunked message accepted: one chunk plus its header."""
        return self.chunk_bytes + (64 << 10)


@dataclass
class ChannelStats:
    """Byte and rejection counts of one channel (all threads read, one writes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    rtt_s: float = 0.0
    """EWMA of measured round trips (0: none yet)."""
    goodput_bps: float = 0.0
    """EWMA of measured receive goodput of chunked transfers, bits/s (0: none yet)."""
    chunks_sent: int = 0
    """Chunks of large messages put on the wire, resends included."""
    chunks_resent: int = 0
    """Chunks sent again after a stall (the receiver may or may not have held them)."""
    transfer_resumes: int = 0
    """Times a large message went back to its last acknowledged chunk."""
    messages_dropped: int = 0
    """Messages given up after ``send`` took them: a large one that made no progress for
    ``send_timeout_s`` or whose peer restarted, and those queued behind it."""
    acks_dropped: int = 0
    """Acknowledgements that could not be sent (peer gone or not draining)."""
    echoes_received: int = 0
    """Heartbeats the peer echoed back (a coordinator echoes only a member's heartbeats)."""

    def rtt_sample(self, seconds: float, alpha: float = 0.2) -> None:
        self.rtt_s = seconds if self.rtt_s == 0 else (1 - alpha) * self.rtt_s + alpha * seconds

    def goodput_sample(self, bps: float, alpha: float = 0.3) -> None:
        self.goodput_bps = (
            bps if self.goodput_bps == 0 else (1 - alpha) * self.goodput_bps + alpha * bps
        )


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _apply_profile(sock: zmq.Socket[Any], cfg: ChannelConfig, *, server: bool) -> None:
    sock.setsockopt(zmq.LINGER, _ms(cfg.linger_s))
    # Room for two credit windows of chunks (one queued before a reconnect, one resent after
    # it): a sender keeping to its window never blocks on the high-water mark.
    hwm = max(cfg.high_water_mark, cfg.transfer.high_water_mark)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, _ms(cfg.send_timeout_s))
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_message_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(cfg.heartbeat_interval_s))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(cfg.heartbeat_timeout_s))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(cfg.heartbeat_timeout_s))
    sock.setsockopt(zmq.RECONNECT_IVL, _ms(cfg.reconnect_interval_s))
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, _ms(cfg.reconnect_interval_max_s))
    if cfg.curve is not None:
        sock.setsockopt(zmq.ZAP_DOMAIN, b"crossdc")
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, cfg.curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve.secret)
        if server:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
        else:
            if cfg.curve.server_public is None:
                raise ValueError("a client's CurveKeys need server_public")
            sock.setsockopt(zmq.CURVE_SERVERKEY, cfg.curve.server_public)


@dataclass
class _Outgoing:
    """A large message being sent: where to, its transfer state, when it last made progress."""

    peer: bytes
    prefix: list[bytes]
    """The routing frames that address the peer."""
    tx: TransferSender
    progress_at: float
    """When the acknowledged index last advanced (or the transfer began)."""


class _Endpoint:
    """What ROUTER and DEALER channels share: send with flow-controlled chunking, receive with
    validation, acknowledgements both ways."""

    def __init__(self, sock: zmq.Socket[Any], cfg: ChannelConfig, on_reject: RejectHook | None):
        self._sock = sock
        self.cfg = cfg
        self.stats = ChannelStats()
        self._on_reject = on_reject
        self.transfer_cfg = cfg.transfer
        self._receiver = TransferReceiver(self.transfer_cfg)
        # Per peer, messages go out in the order they were sent: while a large one is in
        # transfer (one per peer at most), later ones wait behind it (heartbeats excepted).
        self._outgoing: dict[bytes, _Outgoing] = {}
        self._queued: dict[bytes, deque[Message]] = {}
        self.links: dict[bytes, LinkEstimator] = {}
        """Per peer: the path's RTT and the goodput of what the peer sends here, which sizes the
        credit window granted to it."""
        self.send_links: dict[bytes, LinkEstimator] = {}
        """Per peer: the path's RTT and the goodput of what is sent to it (bytes acknowledged),
        which sizes the stall timeout of transfers to it."""
        # Complete messages received while flush() serviced acknowledgements; recv returns them.
        self._backlog: deque[tuple[bytes, Message]] = deque()
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        # First-chunk arrival per transfer: goodput = bytes after the first chunk / time since.
        self._transfer_start: dict[tuple[bytes, str], tuple[float, int]] = {}
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
        liveness and may overtake. Raises ``zmq.ZMQError`` when the peer is unreachable."""
        if not isinstance(msg, Heartbeat) and (peer in self._outgoing or peer in self._queued):
            self._queued.setdefault(peer, deque()).append(msg)
            return
        self._transmit(peer, msg, block=True)

    def _transmit(self, peer: bytes, msg: Message, *, block: bool) -> None:
        prefix = self._prefix_for(peer)
        flags = 0 if block else zmq.NOBLOCK
        frames = to_wire(msg, session=self.session, seq=self._next_seq())
        if frames_nbytes(frames) <= self.cfg.chunk_bytes:
            self._sock.send_multipart([*prefix, *frames], copy=False, flags=flags)
            self.stats.bytes_sent += frames_nbytes(frames)
            self.stats.messages_sent += 1
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
        out = _Outgoing(peer=peer, prefix=prefix, tx=tx, progress_at=now)
        self._outgoing[peer] = out
        try:
            self._pump(out, now, block=block)
        except zmq.ZMQError:
            del self._outgoing[peer]
            raise
        self.stats.messages_sent += 1

    def _release(self, peer: bytes) -> None:
        """Send what waits for ``peer`` up to (and including the start of) the next large one."""
        waiting = self._queued.get(peer)
        while waiting and peer not in self._outgoing:
            try:
                self._transmit(peer, waiting[0], block=False)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EAGAIN:
                    return  # not draining right now: the next tick tries again
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._drop_queue(peer, "the peer is unreachable")
                return
            waiting.popleft()
        if waiting is not None and not waiting:
            del self._queued[peer]

    def _drop_queue(self, peer: bytes, why: str) -> int:
        waiting = self._queued.pop(peer, None)
        if not waiting:
            return 0
        self.stats.messages_dropped += len(waiting)
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

    def _on_ack(self, peer: bytes, ack: ChunkAck) -> None:
        out = self._outgoing.get(peer)
        if out is None or out.tx.transfer_id != ack.transfer_id:
            return  # a late ack of a finished, dropped or forgotten transfer
        tx = out.tx
        now = time.monotonic()
        acked_before = tx.acked_bytes
        try:
            rtt_s = tx.on_ack(ack.transfer_id, ack.next_index, ack.credit_bytes, now)
        except ValueError as exc:
            raise WireError(ErrorCode.MALFORMED, f"ack: {exc}") from None
        if rtt_s is not None:
            self.rtt_sample(peer, rtt_s, now)
        if tx.acked_bytes > acked_before:
            out.progress_at = now
            self.send_link(peer).on_bytes_acked(tx.acked_bytes - acked_before, now)
        if tx.done:
            del self._outgoing[peer]
            self._release(peer)
        else:
            self._pump(out, now, block=False)

    def _tick(self, now: float) -> None:
        """Resume stalled transfers from their last acknowledged chunk; drop hopeless ones."""
        for peer in [p for p in self._queued if p not in self._outgoing]:
            self._release(peer)  # a queued send that found the peer not draining
        for peer, out in list(self._outgoing.items()):
            tx = out.tx
            stall_s = stall_timeout_s(self.transfer_cfg, self.send_link(out.peer).snapshot())
            if not tx.stalled(now, stall_s):
                continue
            tag = f"[transfer={tx.transfer_id} peer={out.peer[:32]!r}]"
            if now - out.progress_at >= max(self.cfg.send_timeout_s, 3 * stall_s):
                del self._outgoing[peer]
                self.stats.messages_dropped += 1
                log.warning(
                    "%s no progress for %.1f s: dropped at chunk %d of %d",
                    tag,
                    now - out.progress_at,
                    tx.acked_index,
                    tx.num_chunks,
                )
                self._drop_queue(peer, "a large message before them was dropped")
                continue
            log.info(
                "%s no ack for %.2f s: resuming at chunk %d (sent up to %d of %d)",
                tag,
                stall_s,
                tx.acked_index,
                tx.high_water_index,
                tx.num_chunks,
            )
            tx.resume(now=now)
            self.stats.transfer_resumes += 1
            self._pump(out, now, block=False)

    def _drop_peer_transfers(self, peer: bytes) -> int:
        """Forget every transfer to and from ``peer`` and what waits behind them; return how many
        messages to it were given up."""
        self._receiver.drop_sender(peer)
        for key in [k for k in self._transfer_start if k[0] == peer]:
            del self._transfer_start[key]
        dropped = int(self._outgoing.pop(peer, None) is not None)
        waiting = self._queued.pop(peer, None)
        return dropped + (len(waiting) if waiting else 0)

    # -- receiving ------------------------------------------------------------------------

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

    def _parse(self, sender: bytes, frames: Sequence[Frame]) -> Message | None:
        """One received frame list to a complete message; None for an acknowledgement, a chunk
        of a message still partial, or anything rejected."""
        size = frames_nbytes(frames)
        self.stats.bytes_received += size
        try:
            msg, env = from_wire_envelope(frames, max_bytes=self.cfg.max_message_bytes)
            self._check_replay(sender, env.session, env.seq, inner=False)
            if isinstance(msg, ChunkAck):
                self._on_ack(sender, msg)
                return None
            if isinstance(msg, Chunk):
                now = time.monotonic()
                key = (sender, msg.transfer_id)
                got = self._receiver.on_chunk(sender, msg, now, self.link(sender))
                self._send_ack(sender, got.ack)
                if not got.duplicate and got.frames is None and key not in self._transfer_start:
                    self._transfer_start[key] = (now, size)
                    if len(self._transfer_start) > 4 * self.transfer_cfg.max_pending:
                        self._prune_transfer_starts()
                if got.frames is None:
                    return None
                first = self._transfer_start.pop(key, None)
                if first is not None and msg.num_chunks > 1 and now > first[0]:
                    self.stats.goodput_sample(8 * (msg.total_bytes - first[1]) / (now - first[0]))
                msg, env = from_wire_envelope(got.frames)
                self._check_replay(sender, env.session, env.seq, inner=True)
                if isinstance(msg, Chunk | ChunkAck):
                    raise WireError(ErrorCode.MALFORMED, "a chunk or ack inside a chunked transfer")
        except WireError as exc:
            self._reject(sender, exc.code, exc.detail)
            return None
        self.stats.messages_received += 1
        return msg

    def _prune_transfer_starts(self) -> None:
        """Forget the start times of transfers the receiver no longer holds (it refused them)."""
        for key in list(self._transfer_start):
            if self._receiver.next_index(*key) is None:
                del self._transfer_start[key]

    def _recv_one(self) -> tuple[bytes, Message] | None:
        """Read one frame list (one is waiting) and handle it; a complete message is returned."""
        raise NotImplementedError

    def _poll(self, timeout_s: float) -> bool:
        """Wait for input up to ``timeout_s``, in slices, so stalled transfers resume meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            self._tick(now)
            slice_s = min(deadline - now, 0.05)
            if self._poller.poll(max(0, int(slice_s * 1000))):
                return True
            if time.monotonic() >= deadline:
                return False

    def _next(self, timeout_s: float) -> tuple[bytes, Message] | None:
        if self._backlog:
            return self._backlog.popleft()
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


class RouterChannel(_Endpoint):
    """The coordinator's listening socket; peers are addressed by their routing id."""

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        context: zmq.Context[Any] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        _apply_profile(sock, cfg, server=True)
        super().__init__(sock, cfg, on_reject)
        self.identities: dict[bytes, PeerIdentity] = {}
        """The ZAP-certified identity of each sender (CURVE mode only)."""

    def bind(self, endpoint: str) -> str:
        """Bind (``tcp://127.0.0.1:0`` picks a port) and return the endpoint actually bound."""
        if endpoint.endswith(":0"):
            endpoint = endpoint[:-2] + ":*"
        self._sock.bind(endpoint)
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(bound, bytes)
        return bound.decode()

    def _prefix_for(self, peer: bytes) -> list[bytes]:
        return [peer]

    def send(self, peer: bytes, msg: Message) -> bool:
        """Send to one peer; False when the peer is not connected (never raises for that).

        A large message is under way when this returns: its first credit window is queued and
        the rest follows as the peer acknowledges, inside :meth:`recv` and :meth:`flush`.
        Messages sent while one is under way wait behind it (True: the peer was there when that
        one started); they are dropped with it if it makes no progress for ``send_timeout_s``.
        """
        try:
            self._send_frames(peer, msg)
        except zmq.ZMQError as exc:
            if exc.errno in _PEER_GONE:
                log.info("peer %r unreachable: %s", peer, exc)
                return False
            raise
        return True

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        """The next complete, valid message and its sender, or None after ``timeout_s``."""
        return self._next(timeout_s)

    def _recv_one(self) -> tuple[bytes, Message] | None:
        frames = self._sock.recv_multipart(copy=False)
        sender = frames[0].bytes
        if len(frames) < 2:
            self._reject(sender, ErrorCode.MALFORMED, "no frames after the routing id")
            return None
        if self.cfg.curve is not None:
            peer = peer_of(frames[1])
            if peer is None:
                self._reject(sender, ErrorCode.UNAUTHENTICATED, "no certified identity")
                return None
            # Routing ids are "<site_id>/<random>": a certified site may not take over
            # another site's routing id (ROUTER_HANDOVER would let it).
            if sender.split(b"/", 1)[0] != peer.site_id.encode():
                self._reject(
                    sender, ErrorCode.UNAUTHENTICATED, f"routing id is not {peer.site_id}'s"
                )
                return None
            self.identities[sender] = peer
        msg = self._parse(sender, [f.buffer for f in frames[1:]])
        return None if msg is None else (sender, msg)

    def forget(self, peer: bytes) -> None:
        """Drop a departed peer's transfers, both directions, what was measured about it, and
        its replay state (the routing id names one site process: a restart gets a new one)."""
        self._drop_peer_transfers(peer)
        self.replay.forget(peer)
        self.identities.pop(peer, None)
        self.links.pop(peer, None)
        self.send_links.pop(peer, None)


class DealerChannel(_Endpoint):
    """A site's connection to the coordinator. Not thread-safe: one thread owns it."""

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        identity: str,
        context: zmq.Context[Any] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        ctx = context or zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        # A stable routing id per process lets the coordinator address us across reconnects.
        routing_id = f"{identity}/{os.urandom(16).hex()}".encode()
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        _apply_profile(sock, cfg, server=False)
        super().__init__(sock, cfg, on_reject)
        self.routing_id = routing_id

    def connect(self, endpoint: str) -> None:
        self._sock.connect(endpoint)

    def _prefix_for(self, peer: bytes) -> list[bytes]:
        return []

    def send(self, msg: Message) -> None:
        """Send to the coordinator. A large message is under way when this returns: the rest
        follows as the coordinator acknowledges, inside :meth:`recv` and :meth:`flush`, and
        messages sent meanwhile wait behind it (heartbeats excepted)."""
        self._send_frames(COORDINATOR_PEER, msg)

    def recv(self, timeout_s: float) -> Message | None:
        got = self._next(timeout_s)
        return None if got is None else got[1]

    def _recv_one(self) -> tuple[bytes, Message] | None:
        frames = self._sock.recv_multipart(copy=False)
        msg = self._parse(COORDINATOR_PEER, [f.buffer for f in frames])
        return None if msg is None else (COORDINATOR_PEER, msg)


class SiteLink:
    """A DEALER on its own I/O thread: queued sends, a receive queue, periodic heartbeats.

    The I/O thread also services the acknowledgements of large messages, so their transfers keep
    moving while the owner trains. ``heartbeat`` builds the liveness message sent every
    ``heartbeat_interval_s``; it is called on the I/O thread and must only read simple shared
    state.
    """

    def __init__(
        self,
        cfg: ChannelConfig,
        *,
        identity: str,
        endpoint: str,
        heartbeat: Callable[[], Message] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        self.cfg = cfg
        self.identity = identity
        self.endpoint = endpoint
        self._heartbeat = heartbeat
        self._on_reject = on_reject
        self._outbox: queue.Queue[Message] = queue.Queue()
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context[Any] | None = None
        self._failure: BaseException | None = None
        self._flush_timeout_s = cfg.heartbeat_timeout_s
        self._pending_sends = 0  # written by the I/O thread only
        self.stats = ChannelStats()

    @property
    def pending_sends(self) -> int:
        """Messages the I/O thread took but has not finished sending (as of its last pass):
        large ones in transfer and those queued behind them."""
        return self._pending_sends

    def start(self) -> None:
        assert self._thread is None, "SiteLink started twice"
        self._context = zmq.Context()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"sitelink-{self.identity}", daemon=True
        )
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        assert self._context is not None
        chan = DealerChannel(
            self.cfg, identity=self.identity, context=self._context, on_reject=self._on_reject
        )
        self.stats = chan.stats
        try:
            chan.connect(self.endpoint)
            ready.set()
            next_beat = time.monotonic() + self.cfg.heartbeat_interval_s
            while not self._stop.is_set():
                now = time.monotonic()
                if self._heartbeat is not None and now >= next_beat:
                    self._send(chan, self._heartbeat())
                    next_beat = now + self.cfg.heartbeat_interval_s
                self._drain_outbox(chan)
                msg = chan.recv(0.005)  # also takes acks, sends on and resumes transfers
                self._pending_sends = chan.pending_transfers + chan.queued_messages
                if isinstance(msg, Heartbeat):  # the coordinator's echo of one of ours
                    self.stats.echoes_received += 1
                    now = time.monotonic()
                    self.stats.rtt_sample(now - msg.sent_at)
                    chan.rtt_sample(COORDINATOR_PEER, now - msg.sent_at, now)
                elif msg is not None:
                    self._inbox.put(msg)
            # Send what the owner queued before close(), and let large messages finish.
            self._drain_outbox(chan)
            if not chan.flush(self._flush_timeout_s):
                log.warning(
                    "[site=%s] closing with %d large and %d queued message(s) unsent",
                    self.identity,
                    chan.pending_transfers,
                    chan.queued_messages,
                )
            self._pending_sends = chan.pending_transfers + chan.queued_messages
        except BaseException as exc:  # surfaced to the owner on its next call
            self._failure = exc
            log.exception("site link I/O thread failed")
        finally:
            ready.set()
            chan.close(flush_timeout_s=0)

    def _drain_outbox(self, chan: DealerChannel) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._send(chan, msg)
            finally:
                self._pending_sends = chan.pending_transfers + chan.queued_messages
                self._outbox.task_done()

    def _send(self, chan: DealerChannel, msg: Message) -> None:
        try:
            chan.send(msg)
        except zmq.Again:
            # The coordinator has not drained for send_timeout_s: the round protocol recovers
            # (deadline, rejoin); the loss is counted, not hidden.
            self.stats.rejected["send_timeout"] += 1
            log.warning("[site=%s] send of %s timed out", self.identity, type(msg).__name__)

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"site link failed: {self._failure!r}") from self._failure

    def send(self, msg: Message) -> None:
        self._check()
        self._outbox.put(msg)

    def recv(self, timeout_s: float) -> Message | None:
        self._check()
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued message is sent and every large one acknowledged, or
        ``timeout_s`` passed; True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks or self._pending_sends:
            self._check()
            if self._thread is None or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Stop the I/O thread once it sent what was queued and flushed large messages (for at
        most ``flush_timeout_s``, default ``heartbeat_timeout_s``: a peer silent that long is
        gone), then close the socket."""
        if flush_timeout_s is not None:
            self._flush_timeout_s = flush_timeout_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._flush_timeout_s + self.cfg.linger_s + 5)
            self._thread = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> SiteLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
