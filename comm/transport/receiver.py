"""The receiving side of a chunked transfer: reassembly, duplicates, and the credit it grants.

:class:`TransferReceiver` wraps a :class:`~comm.wire.chunking.Reassembler` and answers every
chunk with a :class:`~comm.wire.schema.ChunkAck` whose credit is ``max(min_window, factor x
bandwidth x RTT)`` from the sender's link estimate, clamped to ``max_window``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from comm.transport.credit import _MAX_TRANSFER_ID_CHARS, TransferConfig, grant_window_bytes
from comm.transport.linkest import LinkEstimator
from comm.wire.chunking import Reassembler
from comm.wire.frames import WireError
from comm.wire.schema import Chunk, ChunkAck, ErrorCode

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
    last_at: float = 0.0  # when its latest new chunk arrived
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
    transfers_expired: int = 0


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
        self._check_bounds(chunk)
        nbytes = memoryview(chunk.data).nbytes
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
        self._count(state, chunk.index, duplicate)
        if not duplicate:
            state.last_at = now
        if link is not None and not duplicate:
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

    def _check_bounds(self, chunk: Chunk) -> None:
        """The bounds every chunk must meet before anything is looked up or allocated."""
        if len(chunk.transfer_id) > _MAX_TRANSFER_ID_CHARS:
            raise WireError(ErrorCode.MALFORMED, "transfer id too long")
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

    def _count(self, state: _Incoming, index: int, duplicate: bool) -> None:
        """Count a chunk in; a new one advances ``next_index`` over every chunk now held."""
        self.stats.chunks_received += 1
        if duplicate:
            self.stats.duplicates += 1
            return
        state.received[index] = 1
        while state.next_index < state.num_chunks and state.received[state.next_index]:
            state.next_index += 1

    def _remember(self, key: tuple[bytes, str], num_chunks: int) -> None:
        self._completed[key] = num_chunks
        while len(self._completed) > self.config.completed_memory:
            self._completed.popitem(last=False)

    def drop_sender(self, sender: bytes) -> None:
        """Forget a sender's open transfers (it left)."""
        self._reassembler.drop_sender(sender)
        for key in [k for k in self._incoming if k[0] == sender]:
            del self._incoming[key]

    def expire(self, now: float, max_idle_s: float | None = None) -> int:
        """Forget the transfers that got no new chunk for ``max_idle_s`` (default: the config's
        ``idle_expire_s``), freeing their buffers; return how many."""
        idle_s = self.config.idle_expire_s if max_idle_s is None else max_idle_s
        self._reassembler.expire(now, idle_s)
        old = [k for k, s in self._incoming.items() if now - s.last_at > idle_s]
        for key in old:
            del self._incoming[key]
        self.stats.transfers_expired += len(old)
        return len(old)
