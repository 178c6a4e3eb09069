"""Credit-based flow control for large messages: how many chunks may be on the wire at once.

This module owns the transfer protocol's configuration and credit arithmetic, above
``comm.wire.chunking``. A large message is cut into the
digested chunks of :func:`~comm.wire.chunking.split_frames` (its frames laid out as one byte stream);
the receiver answers chunks with :class:`~comm.wire.schema.ChunkAck` ``(transfer_id, next_index,
credit_bytes)``: ``next_index`` is the first chunk it does not hold (every chunk below it is in),
``credit_bytes`` how many bytes from the start of that chunk the sender may have sent. The
sender keeps the right edge ``offset(next_index) + credit_bytes`` of every acknowledgement it got
(never moving it back), and sends a chunk only if the chunk ends within that edge: the bytes in
flight never exceed the granted window. The receiver grants ``max(min_window, factor x bandwidth
x RTT)`` from the link estimator (``comm.transport.linkest``), clamped to ``max_window``, and never moves
its own edge back either.

A receiver also bounds what it reassembles at once, over all its senders
(``receive_max_transfers``, ``receive_budget_bytes``): a transfer beyond that waits. Its sender
sends its initial credit, the receiver holds those chunks and acknowledges them with no further
credit, so the sender has nothing in flight and nothing to resend; the receiver acknowledges it
again every half stall timeout (an acknowledgement while every sent chunk is acknowledged counts
as progress, so the sender neither resumes nor gives up), and grants a window once it admits
the transfer. With a small initial credit, a waiting sender costs the receiver at most that.

Loss only happens when a connection breaks (ZeroMQ over one TCP connection delivers in order, but
drops what the old connection had taken). A sender that sees no acknowledgement advance for a
stall timeout calls ``TransferSender.resume``: it goes back to the last acknowledged chunk,
never to zero, and sends on from there; the receiver drops chunks it already holds and answers
them, so its next acknowledgement lets the sender skip what arrived after the gap.

The sender (``comm.transport.sender``) and the receiver (``comm.transport.receiver``) are pure state machines (time passed in);
the benchmarks' drivers (``crossdc.bench.transfer_drivers``) are thin, over a DEALER and a
ROUTER socket that only receive, tick and send; they frame their traffic with a one-byte kind
frame (``KIND_CHUNK`` and friends) and :func:`encode_ack`. The channels drive the same
state machines over its DEALER/ROUTER channels, with ``ChunkAck`` sent as a schema message under
the channel's (session, sequence) header.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from comm.transport.linkest import LinkEstimate
from comm.wire.bounded import UnpackLimits, unpack_bounded
from comm.wire.frames import Frame, WireError
from comm.wire.schema import ChunkAck, ErrorCode

_LEN_BYTES = struct.calcsize("<Q")  # one entry of the stream's length table (comm.wire.chunking)
_MAX_TRANSFER_ID_CHARS = 128
_ACK_LIMITS = UnpackLimits(
    max_objects=4,
    max_array_len=3,
    max_map_len=1,
    max_str_len=4 * _MAX_TRANSFER_ID_CHARS,
    max_bin_len=1,
)
"""An acknowledgement is ``[transfer_id, next_index, credit_bytes]`` (``comm.wire.bounded``)."""


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """Chunking, window and recovery settings of one endpoint (both ends should agree)."""

    chunk_bytes: int = 1 << 20
    """Bytes per chunk (the last one may be short)."""
    initial_credit_bytes: int = 8 << 20
    """What a sender may send before the first acknowledgement; the receiver assumes the same."""
    min_window_bytes: int = 8 << 20
    """Smallest window a receiver grants."""
    max_window_bytes: int = 256 << 20
    """Largest window a receiver grants, whatever the link estimate says."""
    window_factor: float = 2.0
    """Window = factor x the link's bandwidth-delay product (then clamped); above 1, so a
    window-limited goodput estimate still lets the window grow towards the link's capacity."""
    max_transfer_bytes: int = 4 << 30
    """Largest transfer a receiver accepts; bounds its reassembly buffer."""
    max_pending: int = 16
    """Transfers a receiver keeps open at once from one sender (each sender has its own)."""
    idle_expire_s: float = 300.0
    """A partly received transfer with no new chunk for this long is dropped and its buffer
    freed (its sender gave up, or vanished without leaving)."""
    max_chunks: int = 1 << 20
    """Most chunks one transfer may be cut into; bounds a receiver's per-transfer bookkeeping
    (4 GiB in 4 KiB chunks)."""
    completed_memory: int = 1024
    """Finished transfers a receiver remembers, to answer late duplicates of their chunks."""
    stall_timeout_s: float = 1.0
    """Least time without an advancing acknowledgement before a sender resumes from the last
    acknowledged chunk (see :func:`stall_timeout_s`). A receiver re-sends the acknowledgement of
    a transfer that got no chunk for half of it (see :meth:`TransferReceiver.acks_due`)."""
    receive_max_transfers: int = 8
    """Transfers a receiver reassembles at once, over all its senders. Another one waits: its
    first chunks (up to the initial credit) are held, acknowledged, and no more credit is granted
    until a transfer being reassembled finishes. Waiting senders hold (nothing in flight, kept
    alive by the receiver's acknowledgements) and resend nothing."""
    receive_budget_bytes: int = 1 << 30
    """Bytes a receiver reassembles at once, over all its senders (the sizes of the transfers it
    admitted). A transfer that would exceed it waits like one over ``receive_max_transfers``;
    one is always admitted when none is being reassembled, so a transfer larger than the budget
    still arrives (alone). Transfers no larger than the initial credit never wait: their sender
    may send them whole before any acknowledgement."""

    peer_hold_bytes: int = 0
    """Bytes one sender may make a receiver hold at once (its open transfers' sizes and chunk
    flags) where the receiver's owner gives no allowance of its own (``comm.transport.charges``);
    0: twice ``max_transfer_bytes``."""
    min_progress_bytes_per_s: float = 4096.0
    """An admitted transfer whose new bytes since its admission fall below this rate over more
    than ``progress_window_s`` is dropped like an idle one (a sender trickling chunks)."""
    progress_window_s: float = 120.0
    """How long an admitted transfer may take before its rate is held against
    ``min_progress_bytes_per_s``."""

    def __post_init__(self) -> None:
        if not self.peer_hold_bytes:
            object.__setattr__(self, "peer_hold_bytes", 2 * self.max_transfer_bytes)
        for name in (
            "peer_hold_bytes",
            "chunk_bytes",
            "max_transfer_bytes",
            "max_pending",
            "max_chunks",
            "completed_memory",
            "receive_max_transfers",
            "receive_budget_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"transfer.{name} must be an integer >= 1, got {value!r}")
        for name in ("initial_credit_bytes", "min_window_bytes"):
            if getattr(self, name) < self.chunk_bytes:
                raise ValueError(f"transfer.{name} must be >= transfer.chunk_bytes")
        if self.max_window_bytes < self.min_window_bytes:
            raise ValueError("transfer.max_window_bytes must be >= transfer.min_window_bytes")
        if not (math.isfinite(self.window_factor) and self.window_factor >= 1.0):
            raise ValueError(f"transfer.window_factor must be >= 1, got {self.window_factor!r}")
        if not (math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0):
            raise ValueError(f"transfer.stall_timeout_s must be > 0, got {self.stall_timeout_s!r}")
        for name in ("min_progress_bytes_per_s", "progress_window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"transfer.{name} must be >= 0, got {value!r}")
        if not (math.isfinite(self.idle_expire_s) and self.idle_expire_s > 0):
            raise ValueError(f"transfer.idle_expire_s must be > 0, got {self.idle_expire_s!r}")

    @property
    def high_water_mark(self) -> int:
        """Socket HWM (messages) that never blocks a sender keeping to the window: a full window
        queued before a reconnect plus a full window resent after it, and room for control."""
        return 2 * -(-self.max_window_bytes // self.chunk_bytes) + 64


def encode_ack(ack: ChunkAck) -> bytes:
    """One msgpack frame for ``ack``."""
    packed: bytes = msgpack.packb(
        [ack.transfer_id, ack.next_index, ack.credit_bytes], use_bin_type=True
    )
    return packed


def decode_ack(frame: Frame) -> ChunkAck:
    """Parse :func:`encode_ack`'s frame; :class:`WireError` (malformed) on anything else."""
    value = unpack_bounded(memoryview(frame).cast("B"), _ACK_LIMITS, "ack is not msgpack")
    if (
        not isinstance(value, list)
        or len(value) != 3
        or not isinstance(value[0], str)
        or len(value[0]) > _MAX_TRANSFER_ID_CHARS
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value[1:])
    ):
        raise WireError(ErrorCode.MALFORMED, "ack must be [transfer_id, next_index, credit_bytes]")
    return ChunkAck(transfer_id=value[0], next_index=value[1], credit_bytes=value[2])


def stream_bytes(frames: Sequence[Frame]) -> int:
    """Length of the byte stream ``split_frames`` cuts: a length table, then every frame."""
    return _LEN_BYTES * (1 + len(frames)) + sum(memoryview(f).nbytes for f in frames)


def grant_window_bytes(config: TransferConfig, link: LinkEstimate | None) -> int:
    """The window a receiver grants: ``max(min_window, factor x BDP)``, at most ``max_window``."""
    bdp = 0 if link is None else link.bdp_bytes()
    wanted = max(config.min_window_bytes, math.ceil(config.window_factor * bdp))
    return min(config.max_window_bytes, wanted)


def stall_timeout_s(config: TransferConfig, link: LinkEstimate | None) -> float:
    """How long a sender waits for an advancing acknowledgement before it resumes.

    Two RTTs plus two chunks' transmission time at the measured goodput, at least
    ``config.stall_timeout_s``: one chunk must cross the link and its acknowledgement come back.
    """
    if link is None:
        return config.stall_timeout_s
    chunk_s = config.chunk_bytes * 8.0 / link.goodput_bps
    return max(config.stall_timeout_s, 2.0 * link.rtt_s + 2.0 * chunk_s)
