"""Chunked transfers: split, reassemble, reject tampering and oversize."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.wire.chunking import Reassembler, split_frames
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=5),
    st.integers(min_value=1, max_value=97),
)
def test_split_then_reassemble_is_identity(frames: list[bytes], chunk_bytes: int) -> None:
    r = Reassembler(max_transfer_bytes=1 << 20)
    chunks = list(split_frames(frames, chunk_bytes))
    assert all(len(bytes(c.data)) <= chunk_bytes for c in chunks)
    out = None
    for i, c in enumerate(chunks):
        out = r.add(b"peer", c, 0.0)
        assert (out is None) == (i < len(chunks) - 1)
    assert out is not None
    assert [bytes(f) for f in out] == frames
    assert r.pending == 0


def test_out_of_order_and_duplicate_chunks() -> None:
    frames = [b"header", np.arange(1000, dtype=np.float32)]
    chunks = list(split_frames(frames, 512))
    r = Reassembler(max_transfer_bytes=1 << 20)
    order = list(reversed(chunks))
    results = [r.add(b"p", c, 0.0) for c in order[:-1]]
    assert results.count(None) == len(results)
    assert r.add(b"p", order[1], 0.0) is None  # duplicate: ignored
    out = r.add(b"p", order[-1], 0.0)
    assert out is not None
    assert bytes(out[1]) == frames[1].tobytes()


def test_tampered_chunk_is_rejected() -> None:
    chunk = next(split_frames([b"x" * 100], 64))
    bad = dataclasses.replace(chunk, data=b"y" + bytes(chunk.data)[1:])
    with pytest.raises(WireError) as info:
        Reassembler(max_transfer_bytes=1 << 20).add(b"p", bad, 0.0)
    assert info.value.code is ErrorCode.BAD_DIGEST


def test_oversize_transfer_is_rejected_before_allocation() -> None:
    chunk = next(split_frames([b"x" * 100], 64))
    huge = dataclasses.replace(chunk, total_bytes=1 << 40)
    with pytest.raises(WireError) as info:
        Reassembler(max_transfer_bytes=1 << 20).add(b"p", huge, 0.0)
    assert info.value.code is ErrorCode.OVERSIZE


def test_range_outside_transfer_is_rejected() -> None:
    chunk = next(split_frames([b"x" * 100], 64))
    bad = dataclasses.replace(chunk, offset=chunk.total_bytes - 1)
    with pytest.raises(WireError) as info:
        Reassembler(max_transfer_bytes=1 << 20).add(b"p", bad, 0.0)
    assert info.value.code is ErrorCode.MALFORMED


def test_pending_transfers_are_bounded_per_sender_and_expire_when_idle() -> None:
    r = Reassembler(max_transfer_bytes=1 << 20, max_pending=2)
    for tid in ("a", "b"):
        r.add(b"p", next(split_frames([b"x" * 100], 10, transfer_id=tid)), 0.0)
    with pytest.raises(WireError) as info:
        r.add(b"p", next(split_frames([b"x" * 100], 10, transfer_id="c")), 0.0)
    assert info.value.code is ErrorCode.OVERSIZE and "this sender" in info.value.detail
    # The bound is per sender: forty others open theirs while "p" holds two.
    for i in range(40):
        r.add(f"s{i}".encode(), next(split_frames([b"x" * 100], 10, transfer_id="a")), 0.0)
    assert r.pending == 42
    # Idle time counts from the latest new chunk, not from the start.
    chunks = list(split_frames([b"x" * 100], 10, transfer_id="a"))
    r.add(b"s0", chunks[1], 9.0)
    assert r.expire(now=15.0, max_idle_s=10.0) == 41 and r.pending == 1
    assert r.expire(now=20.0, max_idle_s=10.0) == 1 and r.pending == 0
