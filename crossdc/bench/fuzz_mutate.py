"""Structure-aware mutations of fuzz inputs: bytes, frame lists, and msgpack inside frames.

A decoder refuses most random bytes at its first check; what reaches its deeper checks is a
valid input changed a little where it has structure. :class:`Mutator` changes an input by the
layout its target declares (``crossdc.bench.fuzz_targets``): raw bytes get byte-level edits;
a frame list gets a frame edited, dropped, repeated, swapped or spliced from another input, and
a frame that holds msgpack (a header, a payload index) gets one value inside it replaced by an
edge case (a huge or negative integer, NaN, an empty or long string, another type, a missing
or extra key) and is packed again; a list of frame lists gets one of its lists so changed, or
its lists reordered. Deterministic for a given ``random.Random``.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from crossdc.bench.fuzz_seeds import pack_frames, unpack_frames

INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    7,
    255,
    256,
    -129,
    65535,
    65536,
    (1 << 31) - 1,
    -(1 << 31),
    1 << 32,
    (1 << 63) - 1,
    -(1 << 63),
    (1 << 64) - 1,
)
INTERESTING_FLOATS = (0.0, -0.0, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf)
MAX_FRAMES = 255
MAX_FRAME_BYTES = (1 << 16) - 1


class Mutator:
    """``mutate(data, shape, other)``: ``data`` changed once or a few times."""

    def __init__(
        self, rng: random.Random, *, max_size: int = 1 << 16, tokens: Sequence[str] = ()
    ) -> None:
        self.rng = rng
        self.max_size = max_size
        self.tokens = list(tokens) or ["x"]
        """Strings a string value may become (``fuzz_targets.tokens``: the seeds' own)."""

    def mutate(self, data: bytes, shape: str, other: bytes | None = None) -> bytes:
        out = data
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            if shape == "frames":
                out = self._frames(out, other)
            elif shape == "nested":
                out = self._nested(out, other)
            else:
                out = self._bytes(out, other)
        return out[: self.max_size]

    # ---- layouts ------------------------------------------------------------------------

    def _nested(self, data: bytes, other: bytes | None) -> bytes:
        messages = unpack_frames(data)
        if not messages or self.rng.random() < 0.3:
            return self._frame_list(messages, unpack_frames(other or b""), nested=True)
        i = self.rng.randrange(len(messages))
        messages[i] = self._frames(messages[i], None)
        return _pack(messages)

    def _frames(self, data: bytes, other: bytes | None) -> bytes:
        frames = unpack_frames(data)
        if not frames or self.rng.random() < 0.05:
            return self._bytes(data, other)  # the container itself
        return self._frame_list(frames, unpack_frames(other or b""), nested=False)

    def _frame_list(self, frames: list[bytes], others: list[bytes], *, nested: bool) -> bytes:
        rng = self.rng
        op = rng.randrange(10)
        if op <= 5 and frames and not nested:
            i = rng.randrange(len(frames))
            frames[i] = self._value(frames[i]) if op <= 2 else self._bytes(frames[i], None)
        elif op == 6 and frames:
            del frames[rng.randrange(len(frames))]
        elif op == 7 and frames:
            i = rng.randrange(len(frames))
            frames.insert(rng.randrange(len(frames) + 1), frames[i])
        elif op == 8 and len(frames) > 1:
            i, j = rng.randrange(len(frames)), rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        elif others:
            frames.insert(rng.randrange(len(frames) + 1), rng.choice(others))
        elif frames:
            i = rng.randrange(len(frames))
            frames[i] = self._bytes(frames[i], None)
        return _pack(frames)

    # ---- msgpack values -----------------------------------------------------------------

    def _value(self, frame: bytes) -> bytes:
        """One value inside a msgpack frame replaced (byte edits if it is not msgpack)."""
        try:
            root = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception:  # msgpack raises several unrelated types on garbage
            return self._bytes(frame, None)
        holder: list[Any] = [root]
        slots = _slots(holder, 0, [])
        if not slots:
            return self._bytes(frame, None)
        parent, key = self.rng.choice(slots)
        if isinstance(parent, dict) and self.rng.random() < 0.15:
            if self.rng.random() < 0.5:
                del parent[key]
            else:
                parent[self.rng.choice(("zz", "", 0, key * 2))] = parent[key]
        else:
            parent[key] = self._edge(parent[key])
        try:
            packed = msgpack.packb(holder[0], use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return frame
        return bytes(packed)

    def _edge(self, value: Any) -> Any:
        rng = self.rng
        if rng.random() < 0.15:  # another type
            return rng.choice((None, True, 0, -1, 1.5, "", b"", [], {}, "x" * 70))
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return rng.choice((*INTERESTING_INTS, value + 1, value - 1, value * 2))
        if isinstance(value, float):
            return rng.choice((*INTERESTING_FLOATS, value * 1e6))
        if isinstance(value, str):
            if rng.random() < 0.5:
                return rng.choice(self.tokens)
            return rng.choice(("", value * rng.randint(2, 40), value[:-1], "\x00", "é∂", "a" * 129))
        if isinstance(value, bytes):
            return self._bytes(value, None)
        if isinstance(value, list):
            if value and rng.random() < 0.5:
                return value[: rng.randrange(len(value))]
            return [*value, rng.choice(value) if value else 0]
        if isinstance(value, dict):
            return {} if rng.random() < 0.3 else {**value, "zz": 1}
        return 0

    # ---- bytes --------------------------------------------------------------------------

    def _bytes(self, data: bytes, other: bytes | None) -> bytes:
        rng = self.rng
        buf = bytearray(data)
        op = rng.randrange(9)
        if not buf:
            return bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        pos = rng.randrange(len(buf))
        if op == 0:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:
            del buf[pos : pos + rng.randint(1, 16)]
        elif op == 4:
            end = min(len(buf), pos + rng.randint(1, 32))
            buf[pos:pos] = buf[pos:end]
        elif op == 5:
            fmt = rng.choice(("<H", ">H", "<I", ">I", "<Q", ">Q"))
            n = rng.choice(INTERESTING_INTS) % (1 << (8 * struct.calcsize(fmt)))
            buf[pos : pos + struct.calcsize(fmt)] = struct.pack(fmt, n)
        elif op == 6:
            del buf[pos:]
        elif op == 7 and other:
            cut = rng.randrange(len(other))
            buf[pos:] = other[cut:]
        else:
            buf[pos] = (buf[pos] + rng.choice((1, -1, 16, -16))) % 256
        return bytes(buf)


def _slots(
    parent: Any, key: Any, out: list[tuple[Any, Any]], depth: int = 0
) -> list[tuple[Any, Any]]:
    """Every (container, key) holding a value under ``parent[key]``, that one included (to a
    depth of 16: deeper values are left as they are)."""
    out.append((parent, key))
    value = parent[key]
    if depth < 16 and isinstance(value, dict):
        for k in list(value):
            _slots(value, k, out, depth + 1)
    elif depth < 16 and isinstance(value, list):
        for i in range(len(value)):
            _slots(value, i, out, depth + 1)
    return out


def _pack(frames: list[bytes]) -> bytes:
    return pack_frames([f[:MAX_FRAME_BYTES] for f in frames[:MAX_FRAMES]])
