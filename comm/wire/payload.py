"""A message's encoded tensors as frames, and back: the payload index and its buffers.

Each tensor's entry in the index (``{"n": name, "s": shape, "c": codec, "m": meta, "b":
buffers}``, and ``"r": [start, stop]`` for a slice of rows of a tensor, see
:attr:`~comm.codecs.base.EncodedTensor.rows`; a whole tensor's entry has no ``"r"``) lists its buffers as ``[dtype, nbytes]`` (the buffer is a frame of its own, sent
without a copy) or ``[dtype, nbytes, offset]`` (the buffer lies at ``offset`` in the *pack*, one
frame before the others holding every buffer smaller than :data:`PACK_BELOW` back to back, each
at the next multiple of 8). A sparse update is hundreds of buffers of a few hundred bytes: as
frames of their own, each would cost its framing and, under CURVE, its own box. An index whose
msgpack is :data:`COMPRESS_INDEX_FROM` bytes or more travels zstd-compressed (as bytes in place
of the list): the entries of a sparse broadcast repeat the same names, codec and meta per update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zstandard

from comm.codecs.base import EncodedTensor
from comm.wire.bounded import UnpackLimits, unpack_bounded
from comm.wire.errors import WireError
from comm.wire.schema import ErrorCode

Frame = Any

PACK_BELOW = 1 << 16
"""Buffers smaller than this share the pack frame."""
COMPRESS_INDEX_FROM = 2048
"""An index whose msgpack is at least this long is sent zstd-compressed."""
MAX_INDEX_BYTES = 16 << 20
"""The most a compressed index may expand to."""
MAX_TENSORS = 1 << 16
"""The most tensors one message carries."""
MAX_OBJECTS_PER_TENSOR = 48
"""The most msgpack objects one tensor's index entry holds (every key, value and container;
a chunked top-k entry of a matrix holds 35, and the rows of a slice 4 more)."""
INDEX_LIMITS = UnpackLimits(
    max_objects=1 + MAX_TENSORS * MAX_OBJECTS_PER_TENSOR,
    per_item_objects=MAX_OBJECTS_PER_TENSOR,
    max_array_len=MAX_TENSORS,
    max_map_len=MAX_OBJECTS_PER_TENSOR,
    max_str_len=1 << 16,
    max_bin_len=1 << 16,
)
"""What a compressed index may expand into (``comm.wire.bounded``): at most
:data:`MAX_OBJECTS_PER_TENSOR` objects for each tensor it lists, names and other strings up to
64 KiB."""
ALLOWED_DTYPES = frozenset(
    {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "float16", "float32"}
)
_ALIGN = 8
_ENTRY_KEYS = frozenset({"n", "s", "c", "m", "b"})


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_payload(payload: Sequence[EncodedTensor]) -> tuple[list[Any] | bytes, list[Frame]]:
    """The index (a list, or its compressed msgpack) and the frames that follow it."""
    index: list[dict[str, Any]] = []
    pack = bytearray()
    own: list[np.ndarray] = []
    for enc in payload:
        specs: list[list[Any]] = []
        for b in (np.ascontiguousarray(b) for b in enc.buffers):
            if b.nbytes < PACK_BELOW:
                offset = _aligned(len(pack))
                pack.extend(bytes(offset - len(pack)))
                pack.extend(b.tobytes())
                specs.append([str(b.dtype), int(b.nbytes), offset])
            else:
                specs.append([str(b.dtype), int(b.nbytes)])
                own.append(b)
        entry: dict[str, Any] = {
            "n": enc.name,
            "s": list(enc.shape),
            "c": enc.codec,
            "m": enc.meta,
            "b": specs,
        }
        if enc.rows is not None:
            entry["r"] = [int(enc.rows[0]), int(enc.rows[1])]
        index.append(entry)
    frames: list[Frame] = [bytes(pack), *own] if pack else list(own)
    packed = msgpack.packb(index, use_bin_type=True)
    if len(packed) >= COMPRESS_INDEX_FROM:
        return zstandard.ZstdCompressor(level=3).compress(packed), frames
    return index, frames


def _index(index: Any) -> Any:
    """The index as a list: a compressed one expanded (at most :data:`MAX_INDEX_BYTES`, within
    :data:`INDEX_LIMITS`)."""
    if not isinstance(index, bytes):
        return index
    try:
        raw = zstandard.ZstdDecompressor().decompress(index, max_output_size=MAX_INDEX_BYTES)
    except Exception as exc:  # zstd raises several unrelated types on garbage
        raise WireError(ErrorCode.MALFORMED, f"compressed payload index: {exc}") from None
    return unpack_bounded(raw, INDEX_LIMITS, "compressed payload index")


def _check(kind: type, value: Any, where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireError(ErrorCode.MALFORMED, f"{where} must be a {kind.__name__}")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    ):
        raise WireError(ErrorCode.MALFORMED, f"{where} must be a list of ints")
    if any(d < 0 for d in value):
        raise WireError(ErrorCode.MALFORMED, f"{where} has a negative dimension")
    return tuple(value)


def _rows(value: Any, shape: tuple[int, ...], where: str) -> tuple[int, int]:
    """A slice's rows ``[start, stop)``: ints with 0 <= start < stop, as many as its shape's."""
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise WireError(ErrorCode.MALFORMED, f"{where} rows must be [start, stop]")
    start, stop = value
    if not 0 <= start < stop or not shape or shape[0] != stop - start:
        raise WireError(
            ErrorCode.MALFORMED, f"{where} rows {start}:{stop} do not fit its shape {shape}"
        )
    return start, stop


class _Buffers:
    """Hands out the buffers the specs name: the next frame of its own, or a slice of the pack
    at exactly the next aligned offset; ``finish`` checks that nothing is left over."""

    def __init__(self, specs: list[Any], frames: Sequence[Frame]) -> None:
        packed = any(isinstance(s, list) and len(s) == 3 for s in specs)
        if packed and not frames:
            raise WireError(ErrorCode.MALFORMED, "payload has packed buffers but no frames")
        self.pack = memoryview(frames[0]).cast("B") if packed else memoryview(b"")
        self.frames = frames[1:] if packed else frames
        self.pos = 0  # next frame of its own
        self.end = 0  # end of the last packed buffer

    def take(self, spec: Any, where: str) -> np.ndarray:
        if (
            not isinstance(spec, list)
            or len(spec) not in (2, 3)
            or not isinstance(spec[0], str)
            or spec[0] not in ALLOWED_DTYPES
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in spec[1:])
        ):
            raise WireError(ErrorCode.MALFORMED, f"{where} has a bad buffer spec")
        dtype, nbytes = np.dtype(spec[0]), spec[1]
        if nbytes < 0 or nbytes % dtype.itemsize:
            raise WireError(ErrorCode.MALFORMED, f"{where} buffer of {nbytes} bytes")
        if len(spec) == 3:
            offset = _aligned(self.end)
            if spec[2] != offset or offset + nbytes > self.pack.nbytes:
                raise WireError(
                    ErrorCode.MALFORMED,
                    f"{where} packed at {spec[2]}+{nbytes}, expected {offset} in "
                    f"{self.pack.nbytes} bytes",
                )
            self.end = offset + nbytes
            return np.frombuffer(self.pack[offset : self.end], dtype=dtype)
        if self.pos >= len(self.frames):
            raise WireError(ErrorCode.MALFORMED, f"{where} is missing frames")
        raw = memoryview(self.frames[self.pos]).cast("B")
        self.pos += 1
        if raw.nbytes != nbytes:
            raise WireError(
                ErrorCode.MALFORMED, f"{where} frame holds {raw.nbytes} bytes, header says {nbytes}"
            )
        return np.frombuffer(raw, dtype=dtype)

    def finish(self) -> None:
        if self.pos != len(self.frames):
            raise WireError(
                ErrorCode.MALFORMED,
                f"{len(self.frames) - self.pos} frames left over after the payload",
            )
        if self.end != self.pack.nbytes:
            raise WireError(
                ErrorCode.MALFORMED, f"{self.pack.nbytes - self.end} bytes left over in the pack"
            )


def decode_payload(index: Any, frames: Sequence[Frame]) -> tuple[EncodedTensor, ...]:
    """The encoded tensors ``index`` describes, their buffers taken from ``frames`` (not copied);
    :class:`WireError` names the first thing wrong."""
    index = _index(index)
    if not isinstance(index, list) or len(index) > MAX_TENSORS:
        raise WireError(ErrorCode.MALFORMED, "payload index must be a bounded list")
    for i, item in enumerate(index):
        if not isinstance(item, dict) or set(item) - {"r"} != _ENTRY_KEYS:
            raise WireError(ErrorCode.MALFORMED, f"payload entry {i} has the wrong keys")
        if not isinstance(item["b"], list):
            raise WireError(ErrorCode.MALFORMED, f"payload[{i}] buffer list is not a list")
    buffers = _Buffers([s for item in index for s in item["b"]], frames)
    out: list[EncodedTensor] = []
    for i, item in enumerate(index):
        name = _check(str, item["n"], f"payload[{i}].name")
        shape = _shape(item["s"], f"payload[{i}].shape")
        codec = _check(str, item["c"], f"payload[{i}].codec")
        meta = item["m"]
        if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
            raise WireError(
                ErrorCode.MALFORMED, f"payload[{i}].meta must be a map with string keys"
            )
        rows = _rows(item["r"], shape, f"payload[{i}] {name!r}") if "r" in item else None
        bufs = tuple(buffers.take(spec, f"payload[{i}] {name!r}") for spec in item["b"])
        out.append(
            EncodedTensor(name=name, shape=shape, codec=codec, meta=meta, buffers=bufs, rows=rows)
        )
    buffers.finish()
    return tuple(out)
