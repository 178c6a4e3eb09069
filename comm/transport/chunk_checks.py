"""What a receiver checks of a chunk before it holds it: the bounds of its config, the chunk
layout, and (for a chunk held outside the reassembler) its digest.

Pure functions of the chunk (and the config); each raises :class:`~comm.wire.frames.WireError`
with the code the sender is answered with, and changes nothing.
"""

from __future__ import annotations

from comm.transport.credit import _MAX_TRANSFER_ID_CHARS, TransferConfig
from comm.wire.chunking import chunk_digest
from comm.wire.frames import WireError
from comm.wire.schema import Chunk, ErrorCode


def check_bounds(chunk: Chunk, config: TransferConfig) -> None:
    """The bounds every chunk must meet before anything is looked up or allocated."""
    if len(chunk.transfer_id) > _MAX_TRANSFER_ID_CHARS:
        raise WireError(ErrorCode.MALFORMED, "transfer id too long")
    if not 0 < chunk.total_bytes <= config.max_transfer_bytes:
        raise WireError(
            ErrorCode.OVERSIZE,
            f"transfer of {chunk.total_bytes} bytes (bound {config.max_transfer_bytes})",
        )
    if not 0 <= chunk.index < chunk.num_chunks:
        raise WireError(ErrorCode.MALFORMED, f"chunk index {chunk.index}/{chunk.num_chunks}")
    if chunk.num_chunks > config.max_chunks:
        raise WireError(
            ErrorCode.OVERSIZE,
            f"transfer of {chunk.num_chunks} chunks (bound {config.max_chunks})",
        )


def chunk_stride(chunk: Chunk, nbytes: int) -> int:
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


def check_digest(chunk: Chunk) -> None:
    """What the reassembler checks first, for a chunk held outside it."""
    if chunk_digest(memoryview(chunk.data).cast("B")) != chunk.digest:
        raise WireError(ErrorCode.BAD_DIGEST, f"chunk {chunk.index} of {chunk.transfer_id}")
