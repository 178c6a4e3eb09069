"""ZeroMQ channels with the WAN socket profile: ROUTER on the coordinator, DEALER on a site.

The channel owns sockets, framing, chunking and rejection of bad input; it knows nothing about
rounds or models. Messages whose frames exceed ``chunk_bytes`` travel as digested chunks
(``comm.chunking``). Every received message is parsed by ``comm.wire``; anything malformed,
oversize or of the wrong version is dropped, counted, and reported through ``on_reject`` without
raising to the caller. :class:`SiteLink` runs a DEALER on its own I/O thread so a site keeps its
liveness (heartbeats) while its main thread trains.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from comm.chunking import Reassembler, split_frames
from comm.schema import Chunk, ErrorCode, Heartbeat, Message
from comm.wire import Frame, WireError, frames_nbytes, from_wire_envelope, to_wire

log = logging.getLogger(__name__)

RejectHook = Callable[[bytes, ErrorCode, str], None]

# ZAP metadata a CURVE connection carries once the coordinator's handler accepted it.
USER_ID = "User-Id"
SERIAL_PROPERTY = "X-Cert-Serial"


@dataclass(frozen=True, kw_only=True)
class PeerIdentity:
    """Who sent a frame, as the ZAP handler certified at the connection's handshake."""

    site_id: str
    serial: str


def peer_of(frame: zmq.Frame) -> PeerIdentity | None:
    """The certified identity carried by a frame received with ``copy=False``; None when the
    connection was not authenticated by a ZAP handler (no CURVE, or another handler)."""
    try:
        site_id = frame.get(USER_ID)
        serial = frame.get(SERIAL_PROPERTY)
    except zmq.ZMQError:
        return None
    if not isinstance(site_id, str) or not isinstance(serial, str) or not site_id:
        return None
    return PeerIdentity(site_id=site_id, serial=serial)


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """Z85-encoded CURVE keys for one endpoint; ``server_public`` only on a client."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None


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
    sock.setsockopt(zmq.SNDHWM, cfg.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, cfg.high_water_mark)
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


class _Endpoint:
    """What ROUTER and DEALER channels share: send with chunking, receive with validation."""

    def __init__(self, sock: zmq.Socket[Any], cfg: ChannelConfig, on_reject: RejectHook | None):
        self._sock = sock
        self.cfg = cfg
        self.stats = ChannelStats()
        self._on_reject = on_reject
        self._reassembler = Reassembler(max_transfer_bytes=cfg.max_transfer_bytes)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        # First-chunk arrival per transfer: goodput = bytes after the first chunk / time since.
        self._transfer_start: dict[tuple[bytes, str], tuple[float, int]] = {}
        # Replay protection: our session and sequence on every frame list we send; per sender,
        # the sessions seen and the last sequence of the current one.
        self.session = os.urandom(8).hex()
        self._seq = 0
        self._peer_session: dict[bytes, tuple[str, int]] = {}
        self._old_sessions: dict[bytes, set[str]] = {}

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send_frames(self, prefix: list[bytes], msg: Message) -> None:
        frames = to_wire(msg, session=self.session, seq=self._next_seq())
        if frames_nbytes(frames) <= self.cfg.chunk_bytes:
            self._sock.send_multipart([*prefix, *frames], copy=False)
            self.stats.bytes_sent += frames_nbytes(frames)
            self.stats.messages_sent += 1
            return
        # The inner message keeps its sequence number; every chunk gets its own as well.
        for chunk in split_frames(frames, self.cfg.chunk_bytes):
            parts = to_wire(chunk, session=self.session, seq=self._next_seq())
            self._sock.send_multipart([*prefix, *parts], copy=False)
            self.stats.bytes_sent += frames_nbytes(parts)
        self.stats.messages_sent += 1

    def _check_replay(self, sender: bytes, session: str, seq: int, inner: bool) -> None:
        current = self._peer_session.get(sender)
        if current is not None and current[0] == session:
            if seq <= current[1] and not inner:
                raise WireError(
                    ErrorCode.REPLAY, f"session {session} sequence {seq} <= {current[1]}"
                )
            if inner:
                return  # a reassembled message: its chunks were checked one by one
            self._peer_session[sender] = (session, seq)
            return
        if session in self._old_sessions.get(sender, set()):
            raise WireError(ErrorCode.REPLAY, f"session {session} of this peer has ended")
        if current is not None:
            self._old_sessions.setdefault(sender, set()).add(current[0])
        self._peer_session[sender] = (session, seq)

    def _reject(self, sender: bytes, code: ErrorCode, detail: str) -> None:
        self.stats.rejected[code.name.lower()] += 1
        log.warning("rejected message from %r: %s: %s", sender[:32], code.name.lower(), detail)
        if self._on_reject is not None:
            self._on_reject(sender, code, detail)

    def _parse(self, sender: bytes, frames: Sequence[Frame]) -> Message | None:
        """One received frame list to a complete message, None while a chunked one is partial."""
        size = frames_nbytes(frames)
        self.stats.bytes_received += size
        try:
            msg, env = from_wire_envelope(frames, max_bytes=self.cfg.max_message_bytes)
            self._check_replay(sender, env.session, env.seq, inner=False)
            if isinstance(msg, Chunk):
                now = time.monotonic()
                key = (sender, msg.transfer_id)
                first = self._transfer_start.setdefault(key, (now, size))
                whole = self._reassembler.add(sender, msg, now)
                if whole is None:
                    return None
                del self._transfer_start[key]
                if msg.num_chunks > 1 and now > first[0]:
                    self.stats.goodput_sample(8 * (msg.total_bytes - first[1]) / (now - first[0]))
                msg, env = from_wire_envelope(whole)
                self._check_replay(sender, env.session, env.seq, inner=True)
                if isinstance(msg, Chunk):
                    raise WireError(ErrorCode.MALFORMED, "a chunk inside a chunked transfer")
        except WireError as exc:
            self._reject(sender, exc.code, exc.detail)
            return None
        self.stats.messages_received += 1
        return msg

    def _poll(self, timeout_s: float) -> bool:
        return bool(self._poller.poll(max(0, int(timeout_s * 1000))))

    def close(self) -> None:
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

    def send(self, peer: bytes, msg: Message) -> bool:
        """Send to one peer; False when the peer is not connected (never raises for that)."""
        try:
            self._send_frames([peer], msg)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                log.info("peer %r unreachable: %s", peer, exc)
                return False
            raise
        return True

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        """The next complete, valid message and its sender, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._poll(deadline - time.monotonic()):
                return None
            frames = self._sock.recv_multipart(copy=False)
            sender = frames[0].bytes
            if len(frames) < 2:
                self._reject(sender, ErrorCode.MALFORMED, "no frames after the routing id")
                continue
            if self.cfg.curve is not None:
                peer = peer_of(frames[1])
                if peer is None:
                    self._reject(sender, ErrorCode.UNAUTHENTICATED, "no certified identity")
                    continue
                # Routing ids are "<site_id>/<random>": a certified site may not take over
                # another site's routing id (ROUTER_HANDOVER would let it).
                if sender.split(b"/", 1)[0] != peer.site_id.encode():
                    self._reject(
                        sender, ErrorCode.UNAUTHENTICATED, f"routing id is not {peer.site_id}'s"
                    )
                    continue
                self.identities[sender] = peer
            msg = self._parse(sender, [f.buffer for f in frames[1:]])
            if msg is not None:
                return sender, msg
            if time.monotonic() >= deadline:
                return None

    def forget(self, peer: bytes) -> None:
        """Drop partial transfers of a peer that left."""
        self._reassembler.drop_sender(peer)
        self.identities.pop(peer, None)


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

    def send(self, msg: Message) -> None:
        self._send_frames([], msg)

    def recv(self, timeout_s: float) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._poll(deadline - time.monotonic()):
                return None
            frames = self._sock.recv_multipart(copy=False)
            msg = self._parse(b"coordinator", [f.buffer for f in frames])
            if msg is not None:
                return msg
            if time.monotonic() >= deadline:
                return None


class SiteLink:
    """A DEALER on its own I/O thread: queued sends, a receive queue, periodic heartbeats.

    ``heartbeat`` builds the liveness message sent every ``heartbeat_interval_s``; it is called
    on the I/O thread and must only read simple shared state.
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
        self.stats = ChannelStats()

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
                while True:
                    try:
                        self._send(chan, self._outbox.get_nowait())
                    except queue.Empty:
                        break
                msg = chan.recv(0.005)
                if isinstance(msg, Heartbeat):  # the coordinator's echo of one of ours
                    self.stats.rtt_sample(time.monotonic() - msg.sent_at)
                elif msg is not None:
                    self._inbox.put(msg)
            while True:  # flush what the owner queued before close()
                try:
                    self._send(chan, self._outbox.get_nowait())
                except queue.Empty:
                    break
        except BaseException as exc:  # surfaced to the owner on its next call
            self._failure = exc
            log.exception("site link I/O thread failed")
        finally:
            ready.set()
            chan.close()

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

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.linger_s + 5)
            self._thread = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> SiteLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
