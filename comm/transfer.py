"""Credit-based flow control for large messages: how many chunks may be on the wire at once.

This module owns the transfer protocol above ``comm.wire.chunking``. A large message is cut into the
digested chunks of :func:`~comm.wire.chunking.split_frames` (its frames laid out as one byte stream);
the receiver answers chunks with :class:`~comm.wire.schema.ChunkAck` ``(transfer_id, next_index,
credit_bytes)``: ``next_index`` is the first chunk it does not hold (every chunk below it is in),
``credit_bytes`` how many bytes from the start of that chunk the sender may have sent. The
sender keeps the right edge ``offset(next_index) + credit_bytes`` of every acknowledgement it got
(never moving it back), and sends a chunk only if the chunk ends within that edge: the bytes in
flight never exceed the granted window. The receiver grants ``max(min_window, factor x bandwidth
x RTT)`` from the link estimator (``comm.linkest``), clamped to ``max_window``, and never moves
its own edge back either.

Loss only happens when a connection breaks (ZeroMQ over one TCP connection delivers in order, but
drops what the old connection had taken). A sender that sees no acknowledgement advance for a
stall timeout calls :meth:`TransferSender.resume`: it goes back to the last acknowledged chunk,
never to zero, and sends on from there; the receiver drops chunks it already holds and answers
them, so its next acknowledgement lets the sender skip what arrived after the gap.

:class:`TransferSender` and :class:`TransferReceiver` are pure state machines (time passed in);
:class:`ZmqTransferSender` and :class:`ZmqTransferReceiver` are thin drivers over a DEALER and a
ROUTER socket that only receive, tick and send; they frame their traffic with a one-byte kind
frame (:data:`KIND_CHUNK` and friends) and :func:`encode_ack`. ``comm.channel`` drives the same
state machines over its DEALER/ROUTER channels, with ``ChunkAck`` sent as a schema message under
the channel's (session, sequence) header.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from comm.linkest import LinkEstimate, LinkEstimator
from comm.wire.chunking import Reassembler, new_transfer_id, split_frames
from comm.wire.frames import Frame, WireError, from_wire, to_wire
from comm.wire.schema import Chunk, ChunkAck, ErrorCode

log = logging.getLogger(__name__)

_LEN_BYTES = struct.calcsize("<Q")  # one entry of the stream's length table (comm.wire.chunking)
_MAX_TRANSFER_ID_CHARS = 128


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
    """Transfers a receiver keeps open at once (over all senders)."""
    max_chunks: int = 1 << 20
    """Most chunks one transfer may be cut into; bounds a receiver's per-transfer bookkeeping
    (4 GiB in 4 KiB chunks)."""
    completed_memory: int = 1024
    """Finished transfers a receiver remembers, to answer late duplicates of their chunks."""
    stall_timeout_s: float = 1.0
    """Least time without an advancing acknowledgement before a sender resumes from the last
    acknowledged chunk (see :func:`stall_timeout_s`)."""

    def __post_init__(self) -> None:
        for name in (
            "chunk_bytes",
            "max_transfer_bytes",
            "max_pending",
            "max_chunks",
            "completed_memory",
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
    try:
        value = msgpack.unpackb(memoryview(frame).cast("B"), raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(ErrorCode.MALFORMED, f"ack is not msgpack: {exc}") from None
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


# --------------------------------------------------------------------------------------------
# The sender


class TransferSender:
    """Which chunk of one message may go next, given the receiver's acknowledgements.

    Invariant (asserted in tests at every step): ``bytes_in_flight <= window_bytes``, i.e. no
    chunk ever sent ends beyond the right edge the receiver granted (or the initial credit).
    Chunks are cut lazily, so the first goes out before the last digest is computed.
    """

    def __init__(
        self,
        frames: Sequence[Frame],
        *,
        chunk_bytes: int,
        transfer_id: str | None = None,
        initial_credit_bytes: int | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes!r}")
        credit = chunk_bytes if initial_credit_bytes is None else initial_credit_bytes
        if credit < chunk_bytes:
            raise ValueError("initial_credit_bytes must be >= chunk_bytes")
        self.transfer_id = transfer_id or new_transfer_id()
        self.chunk_bytes = chunk_bytes
        self.total_bytes = stream_bytes(frames)
        self.num_chunks = max(1, -(-self.total_bytes // chunk_bytes))
        self._source = split_frames(frames, chunk_bytes, self.transfer_id)
        self._chunks: list[Chunk | None] = []  # None: acknowledged, released
        self._released = 0  # chunks below this are released
        self._acked = 0  # the receiver's next_index as last acknowledged
        self._next = 0  # next chunk to send
        self._high = 0  # one past the highest chunk ever sent
        self._edge = credit  # absolute stream offset no sent byte may reach
        self._sent_at: dict[int, float] = {}  # first-send times, for RTT samples (Karn)
        self._progress_at: float | None = None
        self.chunks_sent = 0
        self.chunks_resent = 0
        self.resumes = 0

    # -- state ----------------------------------------------------------------------------

    def _start(self, index: int) -> int:
        return min(self.total_bytes, index * self.chunk_bytes)

    def _end(self, index: int) -> int:
        return min(self.total_bytes, (index + 1) * self.chunk_bytes)

    @property
    def acked_index(self) -> int:
        """The receiver's last acknowledged ``next_index``: every chunk below it has arrived."""
        return self._acked

    @property
    def next_index(self) -> int:
        """The chunk :meth:`next_chunk` would send next."""
        return self._next

    @property
    def high_water_index(self) -> int:
        """One past the highest chunk ever sent."""
        return self._high

    @property
    def done(self) -> bool:
        """Every chunk acknowledged."""
        return self._acked >= self.num_chunks

    @property
    def acked_bytes(self) -> int:
        return self._start(self._acked)

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of the chunks sent from the last acknowledged one on."""
        return (
            self._end(self._next - 1) - self._start(self._acked) if self._next > self._acked else 0
        )

    @property
    def window_bytes(self) -> int:
        """The granted window: bytes from the last acknowledged chunk up to the right edge."""
        return max(0, self._edge - self._start(self._acked))

    @property
    def last_progress_at(self) -> float | None:
        """When an acknowledgement last advanced (or the first send, or the last resume)."""
        return self._progress_at

    def can_send(self) -> bool:
        return self._next < self.num_chunks and self._end(self._next) <= self._edge

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Whether nothing advanced for ``timeout_s`` while chunks are unacknowledged."""
        if self.done or self._progress_at is None:
            return False
        return now - self._progress_at >= timeout_s

    # -- events ---------------------------------------------------------------------------

    def _chunk(self, index: int) -> Chunk:
        while len(self._chunks) <= index:
            self._chunks.append(next(self._source))
        chunk = self._chunks[index]
        assert chunk is not None, f"chunk {index} was released"
        return chunk

    def next_chunk(self, now: float | None = None) -> Chunk | None:
        """The next chunk the window allows (marked sent), or None: window full or all sent."""
        if not self.can_send():
            return None
        index = self._next
        chunk = self._chunk(index)
        assert chunk.num_chunks == self.num_chunks and chunk.total_bytes == self.total_bytes
        if index < self._high:
            self.chunks_resent += 1
        else:
            self._high = index + 1
            if now is not None:
                self._sent_at[index] = now
        self._next += 1
        self.chunks_sent += 1
        if self._progress_at is None and now is not None:
            self._progress_at = now
        return chunk

    def pending_chunks(self, now: float | None = None) -> Iterator[Chunk]:
        """Yield every chunk the window allows now."""
        while (chunk := self.next_chunk(now)) is not None:
            yield chunk

    def on_ack(
        self, transfer_id: str, next_index: int, credit_bytes: int, now: float | None = None
    ) -> float | None:
        """Take one acknowledgement; return an RTT sample (seconds) when ``now`` is given and it
        newly covers a chunk sent only once (a resent chunk's sample would be ambiguous).

        Acknowledgements that arrive late (``next_index`` below the last one) are ignored except
        for their credit, which can only move the right edge forward.
        """
        if transfer_id != self.transfer_id:
            raise ValueError(f"ack for transfer {transfer_id!r}, this is {self.transfer_id!r}")
        if credit_bytes < 0 or not 0 <= next_index <= self.num_chunks:
            raise ValueError(f"ack index {next_index}/{self.num_chunks} credit {credit_bytes}")
        if next_index > self._high:
            raise ValueError(f"ack of chunk {next_index - 1}, never sent (sent {self._high})")
        self._edge = max(self._edge, self._start(next_index) + credit_bytes)
        if next_index <= self._acked:
            return None
        sample: float | None = None
        sent_at = self._sent_at.get(next_index - 1)
        if now is not None and sent_at is not None:
            sample = now - sent_at
        for index in [i for i in self._sent_at if i < next_index]:
            del self._sent_at[index]
        self._acked = next_index
        self._next = max(self._next, next_index)  # the receiver already holds those
        if now is not None:
            self._progress_at = now
        # Chunks below the acknowledgement are never sent again (a resume goes back to it at
        # most); chunks spanning frame boundaries are copies, so let them go.
        for index in range(self._released, min(next_index, len(self._chunks))):
            self._chunks[index] = None
        self._released = max(self._released, min(next_index, len(self._chunks)))
        return sample

    def resume(self, from_index: int | None = None, now: float | None = None) -> None:
        """Send again from ``from_index`` (default: the last acknowledged chunk).

        After a reconnect the receiver's own acknowledgement names where it stands; anything
        sent from there on may have been lost with the old connection. ``from_index`` above the
        last acknowledgement counts as an acknowledgement; below it is a ValueError: those
        chunks were acknowledged (and released), a transfer never goes back behind that.
        """
        start = self._acked if from_index is None else from_index
        if not self._acked <= start <= self._high:
            raise ValueError(f"resume from {start}: acknowledged {self._acked}, sent {self._high}")
        self._acked = start
        self._next = start
        self._sent_at.clear()
        self.resumes += 1
        if now is not None:
            self._progress_at = now


# --------------------------------------------------------------------------------------------
# The receiver


@dataclass
class _Incoming:
    num_chunks: int
    total_bytes: int
    stride: int
    edge: int
    started_at: float
    received: bytearray  # one flag per chunk
    next_index: int = 0


@dataclass(frozen=True, kw_only=True)
class Received:
    """What one chunk did: the acknowledgement to send back, and the message if it completed."""

    ack: ChunkAck
    frames: list[memoryview] | None
    """The complete message's frames (views into one buffer), once its last chunk arrived."""
    duplicate: bool
    """The chunk was already held (a resend after a reconnect); it changed nothing."""


@dataclass
class ReceiverStats:
    chunks_received: int = 0
    duplicates: int = 0
    transfers_completed: int = 0


def _stride_of(chunk: Chunk, nbytes: int) -> int:
    """The chunk size a transfer was cut with, from one of its chunks; checks the chunk's place.

    ``split_frames`` puts chunk ``i`` at ``i x stride`` with ``stride`` bytes (the last one
    shorter), so one chunk pins the layout and a chunk that does not fit it is malformed.
    """
    total, index, num = chunk.total_bytes, chunk.index, chunk.num_chunks
    if index > 0:
        stride, rest = divmod(chunk.offset, index)
        if rest:
            stride = 0
    else:
        stride = nbytes if num > 1 else total
    if (
        stride < 1
        or not stride * (num - 1) < total <= stride * num
        or chunk.offset != index * stride
        or nbytes != min(stride, total - chunk.offset)
    ):
        raise WireError(
            ErrorCode.MALFORMED,
            f"chunk {index}/{num} at {chunk.offset}+{nbytes} of {total} fits no chunk layout",
        )
    return stride


class TransferReceiver:
    """Reassembles chunked transfers from any number of senders and answers every chunk.

    Digest, size and bound checks are ``comm.wire.chunking.Reassembler``'s (this wraps one), plus the
    chunk layout; a bad chunk raises :class:`WireError` and changes nothing. Feeds the bytes it
    receives into the sender's link estimator and grants windows from it.
    """

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self._reassembler = Reassembler(
            max_transfer_bytes=self.config.max_transfer_bytes, max_pending=self.config.max_pending
        )
        self._incoming: dict[tuple[bytes, str], _Incoming] = {}
        self._completed: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        self.stats = ReceiverStats()

    @property
    def pending(self) -> int:
        return len(self._incoming)

    def window_bytes(self, link: LinkEstimator | None = None) -> int:
        return grant_window_bytes(self.config, None if link is None else link.snapshot())

    def next_index(self, sender: bytes, transfer_id: str) -> int | None:
        """Where an open transfer stands (None: not open)."""
        state = self._incoming.get((sender, transfer_id))
        return None if state is None else state.next_index

    def on_chunk(
        self, sender: bytes, chunk: Chunk, now: float, link: LinkEstimator | None = None
    ) -> Received:
        """Take one chunk from ``sender``; ``link`` is that sender's link estimator."""
        key = (sender, chunk.transfer_id)
        finished = self._completed.get(key)
        if finished is not None:
            self.stats.duplicates += 1
            ack = ChunkAck(transfer_id=chunk.transfer_id, next_index=finished, credit_bytes=0)
            return Received(ack=ack, frames=None, duplicate=True)
        if len(chunk.transfer_id) > _MAX_TRANSFER_ID_CHARS:
            raise WireError(ErrorCode.MALFORMED, "transfer id too long")
        nbytes = memoryview(chunk.data).nbytes
        if not 0 < chunk.total_bytes <= self.config.max_transfer_bytes:
            raise WireError(
                ErrorCode.OVERSIZE,
                f"transfer of {chunk.total_bytes} bytes (bound {self.config.max_transfer_bytes})",
            )
        if not 0 <= chunk.index < chunk.num_chunks:
            raise WireError(ErrorCode.MALFORMED, f"chunk index {chunk.index}/{chunk.num_chunks}")
        if chunk.num_chunks > self.config.max_chunks:
            raise WireError(
                ErrorCode.OVERSIZE,
                f"transfer of {chunk.num_chunks} chunks (bound {self.config.max_chunks})",
            )
        stride = _stride_of(chunk, nbytes)
        state = self._incoming.get(key)
        if state is not None:
            if (state.num_chunks, state.total_bytes) != (chunk.num_chunks, chunk.total_bytes):
                # The reassembler drops its partial transfer on this too (and raises below).
                del self._incoming[key]
                state = None
            elif state.stride != stride:
                raise WireError(ErrorCode.MALFORMED, f"chunk {chunk.index} disagrees on layout")
        duplicate = state is not None and bool(state.received[chunk.index])
        frames = self._reassembler.add(sender, chunk, now)  # digest and bounds; may raise
        if state is None:
            state = _Incoming(
                num_chunks=chunk.num_chunks,
                total_bytes=chunk.total_bytes,
                stride=stride,
                edge=self.config.initial_credit_bytes,
                started_at=now,
                received=bytearray(chunk.num_chunks),
            )
            self._incoming[key] = state
        self.stats.chunks_received += 1
        if duplicate:
            self.stats.duplicates += 1
        else:
            state.received[chunk.index] = 1
            while state.next_index < state.num_chunks and state.received[state.next_index]:
                state.next_index += 1
            if link is not None:
                link.on_bytes_acked(nbytes, now)
        if frames is not None:
            assert state.next_index == state.num_chunks, "reassembled before all chunks arrived"
            del self._incoming[key]
            self._remember(key, state.num_chunks)
            self.stats.transfers_completed += 1
            ack = ChunkAck(
                transfer_id=chunk.transfer_id, next_index=state.num_chunks, credit_bytes=0
            )
            return Received(ack=ack, frames=frames, duplicate=False)
        start = state.next_index * stride
        state.edge = max(state.edge, start + max(stride, self.window_bytes(link)))
        ack = ChunkAck(
            transfer_id=chunk.transfer_id,
            next_index=state.next_index,
            credit_bytes=state.edge - start,
        )
        return Received(ack=ack, frames=None, duplicate=duplicate)

    def _remember(self, key: tuple[bytes, str], num_chunks: int) -> None:
        self._completed[key] = num_chunks
        while len(self._completed) > self.config.completed_memory:
            self._completed.popitem(last=False)

    def drop_sender(self, sender: bytes) -> None:
        """Forget a sender's open transfers (it left)."""
        self._reassembler.drop_sender(sender)
        for key in [k for k in self._incoming if k[0] == sender]:
            del self._incoming[key]

    def expire(self, now: float, max_age_s: float) -> int:
        """Forget transfers started more than ``max_age_s`` ago; return how many."""
        self._reassembler.expire(now, max_age_s)
        old = [k for k, s in self._incoming.items() if now - s.started_at > max_age_s]
        for key in old:
            del self._incoming[key]
        return len(old)


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
    over). One :class:`~comm.linkest.LinkEstimator` per peer is kept in :attr:`links`.
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

    def poll_once(self, timeout_s: float) -> tuple[bytes, list[memoryview]] | None:
        """Handle at most one incoming message; return ``(peer, frames)`` when one completes."""
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
