"""The WAN socket profile: a channel's configuration and how it sets up a ZeroMQ socket.

:class:`ChannelConfig` holds buffer sizes, heartbeats, reconnect intervals, timeouts, chunking
and CURVE keys; :func:`_apply_profile` applies it to a ROUTER (server) or DEALER (client).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from comm.security.identity import CurveKeys
from comm.transport.credit import TransferConfig
from comm.wire.schema import ErrorCode

RejectHook = Callable[[bytes, ErrorCode, str], None]

COORDINATOR_PEER = b"coordinator"
"""How a DEALER channel names its one peer (in rejections, transfers and link estimates)."""

_PEER_GONE = (zmq.EHOSTUNREACH, zmq.EAGAIN)


@dataclass(frozen=True, kw_only=True)
class ChannelConfig:
    """Socket profile for a WAN link."""

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
    """A send blocked this long (peer not draining) fails instead of hanging; a chunked message
    whose acknowledged chunk does not advance for this long is dropped, with what waits behind
    it, whatever else the peer answers."""
    credit_wait_timeout_s: float = 600.0
    """Longest a chunked message waits, kept by the receiver's keepalives, while the receiver
    holds it back for its receive budget (every chunk sent acknowledged, no credit granted
    beyond the initial credit); then it is dropped like one that made no progress, with what
    waits behind it. Raise it where an upload may queue longer at the coordinator."""
    high_water_mark: int = 1024
    """Messages queued per peer; sized for a credit window of chunk-sized messages."""
    curve: CurveKeys | None = None
    """CURVE keys; None runs unencrypted (insecure mode)."""
    min_window_bytes: int = 8 << 20
    """Smallest credit window a receiver grants for a chunked message (at least one chunk)."""
    initial_credit_bytes: int = 1 << 20
    """What a sender may send of a chunked message before its first acknowledgement (at least
    one chunk); both ends must agree. Small, so that a receiver holding transfers back for its
    receive budget is not sent more than this by each sender that waits."""
    receive_max_transfers: int = 8
    """Chunked messages a receiver reassembles at once, over all its peers; further ones wait
    (their senders hold, resending nothing) until one finishes. With model-sized updates this
    bounds a coordinator's reassembly memory to a few updates, whatever the number of sites."""
    receive_budget_bytes: int = 1 << 30
    """Bytes of chunked messages a receiver reassembles at once, over all its peers (one message
    is always let through alone, however large)."""
    max_window_bytes: int = 256 << 20
    """Largest credit window a receiver grants, whatever the link estimate says."""
    resend_timeout_min_s: float = 0.2
    """Least time a message that must arrive waits for its acknowledgement before it is sent
    again (longer with the RTT, the message's size and the heartbeat interval, see
    ``comm.transport.reliable.resend_timeout_s``)."""
    max_unacked_messages: int = 4096
    """Messages that must arrive held per peer until acknowledged; the oldest beyond it is
    given up (counted)."""
    max_unacked_bytes: int = 8 << 30
    """Bytes held per peer for it: messages that must arrive, sent and not acknowledged or
    waiting to be sent, and any other message waiting behind a large one (each at its size on
    the wire). The oldest held beyond it is given up (counted) and never sent afterwards; any
    other message that would pass it is dropped. Whatever a peer does, this end holds for it at
    most this plus the newest message (mostly shared with what the sender keeps anyway: the
    model, an update being built)."""
    stall_timeout_s: float = 1.0
    """Least time without an advancing acknowledgement before a chunked message resumes from
    its last acknowledged chunk (longer on a slow or distant link, see
    ``comm.transport.credit.stall_timeout_s``)."""

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
        for name in (
            "min_window_bytes",
            "initial_credit_bytes",
            "receive_max_transfers",
            "receive_budget_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"channel.{name} must be an integer >= 1, got {value!r}")
        if self.max_window_bytes < self.min_window_bytes:
            raise ValueError("channel.max_window_bytes must be >= channel.min_window_bytes")
        if not (math.isfinite(self.resend_timeout_min_s) and self.resend_timeout_min_s > 0):
            raise ValueError(
                f"channel.resend_timeout_min_s must be > 0, got {self.resend_timeout_min_s}"
            )
        for name in ("max_unacked_messages", "max_unacked_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"channel.{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.credit_wait_timeout_s) and self.credit_wait_timeout_s > 0):
            raise ValueError(
                f"channel.credit_wait_timeout_s must be > 0, got {self.credit_wait_timeout_s}"
            )
        if not self.stall_timeout_s > 0:
            raise ValueError(f"channel.stall_timeout_s must be > 0, got {self.stall_timeout_s}")

    @property
    def transfer(self) -> TransferConfig:
        """The flow control of chunked messages on this channel (``comm.transport``)."""
        window = max(self.min_window_bytes, self.chunk_bytes)
        return TransferConfig(
            chunk_bytes=self.chunk_bytes,
            initial_credit_bytes=max(self.initial_credit_bytes, self.chunk_bytes),
            min_window_bytes=window,
            max_window_bytes=max(self.max_window_bytes, window),
            max_transfer_bytes=self.max_transfer_bytes,
            stall_timeout_s=self.stall_timeout_s,
            receive_max_transfers=self.receive_max_transfers,
            receive_budget_bytes=self.receive_budget_bytes,
        )

    @property
    def max_message_bytes(self) -> int:
        """Largest unchunked message accepted: one chunk plus its header."""
        return self.chunk_bytes + (64 << 10)


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
    # A frame larger than a whole message may be can never be valid: libzmq drops the
    # connection that sends one before holding it. (It bounds each frame, not a message: the
    # frames of one message are held until its last arrives; docs/security.md.)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    # A ROUTER sends no ZMTP heartbeats: libzmq (4.3.5) aborts the whole process when a
    # heartbeat falls due on a connection whose peer hung up while its receive pipe was full
    # ("Assertion failed: !_io_error", stream_engine_base.cpp), which any peer that floods
    # and hangs up can cause. It still answers its peers' heartbeats, and cuts connections
    # that go silent itself (comm.transport.connections).
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0 if server else _ms(cfg.heartbeat_interval_s))
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
