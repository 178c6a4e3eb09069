"""Chunked transfers: a message too large for one frame travels as digested chunks.

The frames of a message are laid out as one byte stream (a length table, then each frame) and cut
into :class:`~comm.wire.schema.Chunk` messages of at most ``chunk_bytes``, each carrying its offset and
a BLAKE2b digest. :class:`Reassembler` puts a stream back together, checks every digest, every
offset and every size against bounds before it keeps a byte, and returns the original frames
(views into one buffer, not copies). Its buffer grows as chunks arrive, never ahead of them: a
transfer's claimed size costs nothing until its bytes come.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from comm.wire.frames import Frame, WireError
from comm.wire.schema import Chunk, ErrorCode

_LEN = struct.Struct("<Q")
_MAX_FRAMES = 1 << 20


def chunk_digest(data: bytes | memoryview) -> str:
    """The digest a chunk carries: 128-bit BLAKE2b, hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def new_transfer_id() -> str:
    return os.urandom(8).hex()


def _stream_parts(frames: Sequence[Frame]) -> list[memoryview]:
    views = [memoryview(f).cast("B") for f in frames]
    table = _LEN.pack(len(views)) + b"".join(_LEN.pack(v.nbytes) for v in views)
    return [memoryview(table), *views]


def split_frames(
    frames: Sequence[Frame], chunk_bytes: int, transfer_id: str | None = None
) -> Iterator[Chunk]:
    """Yield the chunks of one message's frames; the last chunk may be short."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    parts = _stream_parts(frames)
    total = sum(p.nbytes for p in parts)
    num_chunks = max(1, -(-total // chunk_bytes))
    tid = transfer_id or new_transfer_id()
    part_i, part_off = 0, 0
    for index in range(num_chunks):
        want = min(chunk_bytes, total - index * chunk_bytes)
        pieces: list[memoryview] = []
        while want > 0:
            part = parts[part_i]
            take = min(want, part.nbytes - part_off)
            pieces.append(part[part_off : part_off + take])
            part_off += take
            want -= take
            if part_off == part.nbytes:
                part_i, part_off = part_i + 1, 0
        data: bytes | memoryview = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        yield Chunk(
            transfer_id=tid,
            index=index,
            num_chunks=num_chunks,
            offset=index * chunk_bytes,
            total_bytes=total,
            digest=chunk_digest(data),
            data=data,
        )


@dataclass
class _Partial:
    num_chunks: int
    total_bytes: int
    buffer: bytearray
    """The stream's bytes from its start up to the first one missing."""
    ahead: dict[int, bytes]
    """Chunks beyond the first gap, by offset (after a reconnect lost some), until it fills."""
    received: set[int]
    filled: int
    started: float
    last: float
    """When its latest new chunk arrived."""

    def place(self, offset: int, data: memoryview) -> None:
        """Put a new chunk's bytes in: appended where the buffer ends, else kept aside."""
        if offset != len(self.buffer):
            self.ahead[offset] = bytes(data)
            return
        self.buffer += data
        while (more := self.ahead.pop(len(self.buffer), None)) is not None:
            self.buffer += more


class Reassembler:
    """Collects chunks per (sender, transfer id); bounded in bytes per transfer and in open
    transfers per sender (so many senders do not crowd each other out)."""

    def __init__(self, *, max_transfer_bytes: int, max_pending: int = 16) -> None:
        self.max_transfer_bytes = max_transfer_bytes
        self.max_pending = max_pending
        self._partial: dict[tuple[bytes, str], _Partial] = {}

    @property
    def pending(self) -> int:
        return len(self._partial)

    def drop_sender(self, sender: bytes) -> None:
        for key in [k for k in self._partial if k[0] == sender]:
            del self._partial[key]

    def discard(self, sender: bytes, transfer_id: str) -> None:
        """Forget one partly received transfer (nothing if it is not open)."""
        self._partial.pop((sender, transfer_id), None)

    def expire(self, now: float, max_idle_s: float) -> int:
        """Forget transfers that received no new chunk for ``max_idle_s`` (their memory is
        freed); return how many were dropped."""
        old = [k for k, p in self._partial.items() if now - p.last > max_idle_s]
        for k in old:
            del self._partial[k]
        return len(old)

    def add(self, sender: bytes, chunk: Chunk, now: float) -> list[memoryview] | None:
        """Take one chunk; return the message's frames once all chunks arrived, else None."""
        data = memoryview(chunk.data).cast("B")
        if chunk_digest(data) != chunk.digest:
            raise WireError(ErrorCode.BAD_DIGEST, f"chunk {chunk.index} of {chunk.transfer_id}")
        if not 0 < chunk.total_bytes <= self.max_transfer_bytes:
            raise WireError(
                ErrorCode.OVERSIZE,
                f"transfer of {chunk.total_bytes} bytes (bound {self.max_transfer_bytes})",
            )
        if not 0 <= chunk.index < chunk.num_chunks or chunk.num_chunks > chunk.total_bytes:
            raise WireError(ErrorCode.MALFORMED, f"chunk index {chunk.index}/{chunk.num_chunks}")
        if chunk.offset < 0 or chunk.offset + data.nbytes > chunk.total_bytes or not data.nbytes:
            raise WireError(ErrorCode.MALFORMED, f"chunk range {chunk.offset}+{data.nbytes}")
        key = (sender, chunk.transfer_id)
        part = self._partial.get(key)
        if part is None:
            if sum(1 for k in self._partial if k[0] == sender) >= self.max_pending:
                detail = f"more than {self.max_pending} open transfers from this sender"
                raise WireError(ErrorCode.OVERSIZE, detail)
            part = _Partial(
                chunk.num_chunks, chunk.total_bytes, bytearray(), {}, set(), 0, now, now
            )
            self._partial[key] = part
        if (part.num_chunks, part.total_bytes) != (chunk.num_chunks, chunk.total_bytes):
            del self._partial[key]
            raise WireError(ErrorCode.MALFORMED, f"chunk {chunk.index} disagrees on transfer size")
        if chunk.index in part.received:
            return None  # a resent chunk after a reconnect: already have it
        part.place(chunk.offset, data)
        part.received.add(chunk.index)
        part.filled += data.nbytes
        part.last = now
        if len(part.received) < part.num_chunks:
            return None
        del self._partial[key]
        if part.filled != part.total_bytes or len(part.buffer) != part.total_bytes:
            raise WireError(ErrorCode.MALFORMED, "chunks do not cover the transfer")
        return _unstream(memoryview(part.buffer))


def _unstream(stream: memoryview) -> list[memoryview]:
    if stream.nbytes < _LEN.size:
        raise WireError(ErrorCode.MALFORMED, "stream shorter than its length table")
    (count,) = _LEN.unpack_from(stream, 0)
    table_end = _LEN.size * (1 + count)
    if count > _MAX_FRAMES or table_end > stream.nbytes:
        raise WireError(ErrorCode.MALFORMED, f"stream claims {count} frames")
    lengths = [_LEN.unpack_from(stream, _LEN.size * (1 + i))[0] for i in range(count)]
    if table_end + sum(lengths) != stream.nbytes:
        raise WireError(ErrorCode.MALFORMED, "frame lengths do not add up to the stream")
    frames, pos = [], table_end
    for n in lengths:
        frames.append(stream[pos : pos + n])
        pos += n
    return frames
