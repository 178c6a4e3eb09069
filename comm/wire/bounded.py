"""Bounded msgpack decoding of what a peer sent: :func:`unpack_bounded` is every decoder's way
from peer bytes to Python objects.

msgpack bounds the length of one string, array or map (``max_*_len``) but not how many objects a
message builds, and it allocates an array's slots when it reads the array's header, before the
items arrive. A few bytes can therefore cost a lot: 16 MiB of one-byte empty lists, which zstd
packs into a few hundred bytes, build 16 million lists (over 1 GiB). So before msgpack builds
anything, :func:`count_objects` walks the bytes' structure (headers and lengths only, nothing is
built) and refuses them when the objects they would build, those already read plus the items
the open containers still promise, exceed the caller's bound. What msgpack then builds is at
most ``max_objects`` objects, whatever the nesting.

The limits come from the schema: :class:`UnpackLimits` per decoder, sized from what a
legitimate message of that kind holds (see ``comm.wire.frames`` and ``comm.wire.payload``).
Strings and binaries cost what they weigh, so their bound is the input's size where no tighter
one is known. Extension types are never sent and always refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from comm.wire.errors import WireError
from comm.wire.schema import ErrorCode


@dataclass(frozen=True, kw_only=True)
class UnpackLimits:
    """What one decoded msgpack value may hold."""

    max_objects: int
    """Objects in all (every value, map key and container counts one)."""
    max_array_len: int
    """Items of one array."""
    max_map_len: int
    """Pairs of one map."""
    max_str_len: int
    """Bytes of one string."""
    max_bin_len: int
    """Bytes of one binary."""
    per_item_objects: int | None = None
    """When the value is an array: at most this many objects per item, so the bound is
    ``min(max_objects, 1 + items x per_item_objects)`` (a list of records of a known shape)."""

    def __post_init__(self) -> None:
        for name in ("max_objects", "max_array_len", "max_map_len", "max_str_len", "max_bin_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"UnpackLimits.{name} must be >= 1")
        if self.per_item_objects is not None and self.per_item_objects < 1:
            raise ValueError("UnpackLimits.per_item_objects must be >= 1")


# The msgpack format by first byte: (kind, width of the length or value that follows). Kinds:
# _SCALAR (the width is the value's size), _STR/_BIN (a length of that width, then the bytes),
# _ARRAY/_MAP (a count of that width), _FIX* (the count or length is in the byte itself), _BAD.
_SCALAR, _STR, _BIN, _ARRAY, _MAP, _FIXSTR, _FIXARRAY, _FIXMAP, _BAD = range(9)


def _table() -> list[tuple[int, int]]:
    t = [(_BAD, 0)] * 256
    for b in range(0x00, 0x80):
        t[b] = (_SCALAR, 0)
    for b in range(0xE0, 0x100):
        t[b] = (_SCALAR, 0)
    for b in range(0x80, 0x90):
        t[b] = (_FIXMAP, 0)
    for b in range(0x90, 0xA0):
        t[b] = (_FIXARRAY, 0)
    for b in range(0xA0, 0xC0):
        t[b] = (_FIXSTR, 0)
    t[0xC0] = t[0xC2] = t[0xC3] = (_SCALAR, 0)  # nil, false, true
    t[0xC4], t[0xC5], t[0xC6] = (_BIN, 1), (_BIN, 2), (_BIN, 4)
    t[0xCA], t[0xCB] = (_SCALAR, 4), (_SCALAR, 8)  # float 32, 64
    for b, width in zip(range(0xCC, 0xD4), (1, 2, 4, 8) * 2, strict=True):
        t[b] = (_SCALAR, width)  # uint 8..64, int 8..64
    t[0xD9], t[0xDA], t[0xDB] = (_STR, 1), (_STR, 2), (_STR, 4)
    t[0xDC], t[0xDD] = (_ARRAY, 2), (_ARRAY, 4)
    t[0xDE], t[0xDF] = (_MAP, 2), (_MAP, 4)
    return t  # 0xC1 (never used) and the extension types 0xC7-0xC9, 0xD4-0xD8 stay _BAD


_KINDS = _table()
_WIDTH = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


def count_objects(data: bytes | memoryview, limits: UnpackLimits) -> int:
    """How many objects msgpack would build from ``data`` (one value, nothing after it);
    ValueError, before anything is built, when that is more than ``limits`` allow or the bytes
    are not one msgpack value."""
    view = memoryview(data).cast("B")
    end = view.nbytes
    budget = limits.max_objects
    pos = objects = 0
    todo = 1  # values still to read: the one at the top, and every open container's rest
    while todo:
        if pos >= end:
            raise ValueError("truncated")
        kind, width = _KINDS[view[pos]]
        pos += 1
        objects += 1
        todo -= 1
        if kind == _SCALAR:
            pos += width
            continue
        if kind == _BAD:
            raise ValueError(f"unsupported type byte 0x{view[pos - 1]:02x} at {pos - 1}")
        if kind in (_FIXSTR, _FIXARRAY, _FIXMAP):
            n = view[pos - 1] & (0x1F if kind == _FIXSTR else 0x0F)
        else:
            if pos + width > end:
                raise ValueError("truncated")
            n = _WIDTH[width].unpack_from(view, pos)[0]
            pos += width
        if kind in (_STR, _FIXSTR, _BIN):
            most = limits.max_bin_len if kind == _BIN else limits.max_str_len
            if n > most:
                raise ValueError(f"a {n}-byte {'binary' if kind == _BIN else 'string'} > {most}")
            pos += n
            continue
        is_map = kind in (_MAP, _FIXMAP)
        if n > (limits.max_map_len if is_map else limits.max_array_len):
            raise ValueError(f"a {'map' if is_map else 'array'} of {n} > its bound")
        items = 2 * n if is_map else n
        if objects == 1 and not is_map and limits.per_item_objects is not None:
            budget = min(budget, 1 + n * limits.per_item_objects)
        todo += items
        # Every promised item is an object to come and takes at least a byte: refuse now,
        # before msgpack allocates the container's slots.
        if objects + todo > budget or todo > end - pos:
            raise ValueError(
                f"{objects + todo} objects promised by byte {pos} of {end}: bound {budget}"
            )
    if pos != end:
        raise ValueError(f"{end - pos} bytes after the value" if pos < end else "truncated")
    return objects


def unpack_bounded(data: bytes | memoryview, limits: UnpackLimits, what: str) -> Any:
    """The msgpack value ``data`` holds (strings as ``str``, maps keyed by ``str`` or ``int``);
    :class:`WireError` (malformed) naming ``what`` when it is not one value within ``limits``."""
    try:
        count_objects(data, limits)
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(ErrorCode.MALFORMED, f"{what}: {exc}") from None
