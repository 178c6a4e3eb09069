"""A hostile peer's bytes cost a bounded number of objects: every msgpack decoder of peer input
(the header, the compressed payload index, a transfer's acknowledgement) refuses, as malformed
and before building anything, bytes that would build more than what a legitimate message holds.

Allocation is measured with ``tracemalloc`` (what Python allocated, deterministic), never time.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard

from comm.codecs.registry import get_codec
from comm.transport.credit import decode_ack, encode_ack
from comm.wire.bounded import UnpackLimits, count_objects
from comm.wire.frames import HEADER_LIMITS, WireError, from_wire, to_wire
from comm.wire.payload import MAX_INDEX_BYTES, MAX_OBJECTS_PER_TENSOR, encode_payload
from comm.wire.schema import PROTOCOL_VERSION, ChunkAck, ErrorCode, InitParams, MessageType

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _peak_bytes(call: Callable[[], Any]) -> tuple[int, BaseException | None]:
    """Peak bytes Python allocated while ``call`` ran, and what it raised."""
    tracemalloc.start()
    try:
        call()
        raised: BaseException | None = None
    except Exception as exc:
        raised = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, raised


def _init_params(index: object) -> list[bytes]:
    head = {"v": PROTOCOL_VERSION, "t": int(MessageType.INIT_PARAMS), "s": "", "q": 0}
    head["f"] = {"site_id": "x", "model_fingerprint": "f"}
    head["p"] = index
    return [msgpack.packb(head, use_bin_type=True)]


def _array_header(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def test_a_compressed_index_of_sixteen_million_lists_is_refused_before_it_builds() -> None:
    # The issue's bomb: 16 MiB of one-byte empty lists, under a thousand bytes compressed.
    n = MAX_INDEX_BYTES - 5
    bomb = zstandard.ZstdCompressor(level=19).compress(_array_header(n) + b"\x90" * n)
    assert len(bomb) < 1024
    frames = _init_params(bomb)
    peak, raised = _peak_bytes(lambda: from_wire(frames))
    assert isinstance(raised, WireError) and raised.code == ErrorCode.MALFORMED
    assert "compressed payload index" in raised.detail
    # The decompressed bytes themselves (16 MiB), and nothing built from them.
    assert peak < MAX_INDEX_BYTES + 4 * MiB


def test_a_compressed_index_of_many_short_lists_is_refused_before_it_builds() -> None:
    # The same within msgpack's per-array bounds: 32 entries, each a list of 65,536 lists.
    entry = b"\xdc\xff\xff" + b"\x90" * 0xFFFF
    raw = b"\xdc" + (32).to_bytes(2, "big") + entry * 32
    frames = _init_params(zstandard.ZstdCompressor().compress(raw))
    peak, raised = _peak_bytes(lambda: from_wire(frames))
    assert isinstance(raised, WireError) and raised.code == ErrorCode.MALFORMED
    assert "objects promised" in raised.detail
    assert peak < len(raw) + 2 * MiB


def test_a_header_of_many_lists_is_refused_before_it_builds() -> None:
    # Under the 1 MiB header bound: 300,000 empty lists in five lists, as a message's fields.
    inner = b"\xdc" + (60_000).to_bytes(2, "big") + b"\x90" * 60_000
    fields = b"\x95" + inner * 5
    head = msgpack.packb(
        {"v": PROTOCOL_VERSION, "t": int(MessageType.HEARTBEAT), "s": "", "q": 0, "p": []}
    )
    # Append the "f" key to the map by hand: a 6-entry fixmap.
    frame = bytes([0x86]) + head[1:] + msgpack.packb("f") + fields
    assert len(frame) < MiB
    peak, raised = _peak_bytes(lambda: from_wire([frame]))
    assert isinstance(raised, WireError) and raised.code == ErrorCode.MALFORMED
    assert "header" in raised.detail
    assert peak < len(frame) + MiB


def test_an_ack_holding_a_list_bomb_is_refused_before_it_builds() -> None:
    frame = b"\x93" + b"\xdc\xff\xff" + b"\x90" * 0xFFFF + b"\x00\x00"
    peak, raised = _peak_bytes(lambda: decode_ack(frame))
    assert isinstance(raised, WireError) and raised.code == ErrorCode.MALFORMED
    assert peak < 256 * 1024
    ack = ChunkAck(transfer_id="t" * 128, next_index=3, credit_bytes=1 << 40)
    assert decode_ack(encode_ack(ack)) == ack


@pytest.mark.parametrize(
    "spec", ["fp32", "fp16", "int8", "int4+zstd", "topk:0.1", "chunktopk", "int3+zstd"]
)
def test_every_codec_entry_fits_the_per_tensor_bound(spec: str) -> None:
    rng = np.random.default_rng(0)
    enc = get_codec(spec).encode("blocks.0.attn.weight", rng.standard_normal((8, 4, 2, 64)))
    index, _ = encode_payload([enc] * 100)
    raw = zstandard.ZstdDecompressor().decompress(index) if isinstance(index, bytes) else None
    packed = raw if raw is not None else msgpack.packb(index, use_bin_type=True)
    limits = UnpackLimits(
        max_objects=1 << 20, max_array_len=1 << 16, max_map_len=64, max_str_len=64, max_bin_len=64
    )
    assert count_objects(packed, limits) <= 1 + 100 * MAX_OBJECTS_PER_TENSOR


def test_a_large_legitimate_index_still_decodes() -> None:
    codec = get_codec("chunktopk")
    rng = np.random.default_rng(1)
    payload = tuple(
        codec.encode(f"layers.{i}.mlp.weight", rng.standard_normal((4, 64))) for i in range(2000)
    )
    msg = InitParams(site_id="eu", model_fingerprint="f", payload=payload)
    back = from_wire(to_wire(msg))
    assert isinstance(back, InitParams)
    assert [e.name for e in back.payload] == [e.name for e in payload]


@pytest.mark.parametrize(
    ("data", "objects"),
    [
        (msgpack.packb(None), 1),
        (msgpack.packb([1, "ab", b"cd", 2.5, -7, 1 << 40]), 7),
        (msgpack.packb({"a": [1, 2], "b": {"c": None}}), 9),
        (msgpack.packb(["x" * 40, list(range(20))]), 23),
    ],
)
def test_count_objects_counts_what_msgpack_builds(data: bytes, objects: int) -> None:
    assert count_objects(data, HEADER_LIMITS) == objects


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x92\x01", "promised"),
        (b"\x92\x01\xcd\x01", "truncated"),
        (b"\x01\x02", "after the value"),
        (b"\xd4\x01\x00", "unsupported type"),
        (b"\xc1", "unsupported type"),
        (_array_header(5) + b"\x00" * 4, "promised"),
        (b"\xd9\x05abc", "truncated"),
    ],
)
def test_count_objects_refuses_what_is_not_one_value(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        count_objects(data, HEADER_LIMITS)
