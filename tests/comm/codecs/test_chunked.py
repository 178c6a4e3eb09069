"""Chunked (streaming) encoding: chunks joined give the whole tensor's bytes, bad chunks are
refused, and tiling changes nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from comm.codecs import base
from comm.codecs.registry import encode_chunks, get_codec, join_chunks
from tests.support.codecs import CHUNKABLE, sample

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("spec", CHUNKABLE)
@pytest.mark.parametrize("n", [1, 255, 4096, 10_001])
def test_chunked_encoding_equals_whole(spec: str, n: int) -> None:
    codec = get_codec(spec)
    x = sample(n, seed=n).reshape(-1)
    whole = codec.encode("w", x)
    chunk = codec.chunk_multiple * 3
    parts = list(encode_chunks(codec, "w", x, chunk))
    assert len(parts) == math.ceil(n / chunk)
    joined = join_chunks(codec, "w", (n,), parts)
    assert joined.meta == whole.meta and joined.shape == whole.shape
    for got, want in zip(joined.buffers, whole.buffers, strict=True):
        assert got.tobytes() == np.asarray(want).tobytes()
    # Each chunk also decodes on its own to the matching slice of the whole.
    decoded = codec.decode(whole)
    for i, part in enumerate(parts):
        assert np.array_equal(codec.decode(part), decoded[i * chunk : (i + 1) * chunk])


def test_chunked_encoding_rejects_bad_chunks() -> None:
    x = sample(1000)
    with pytest.raises(ValueError, match="multiple of 64"):
        list(encode_chunks(get_codec("int4"), "w", x, 100))
    with pytest.raises(ValueError, match="whole tensor"):
        list(encode_chunks(get_codec("topk:0.1"), "w", x, 100))
    with pytest.raises(ValueError, match="whole tensor"):
        list(encode_chunks(get_codec("int8+zstd"), "w", x, 256))
    parts = list(encode_chunks(get_codec("int8"), "w", x, 256))
    with pytest.raises(ValueError, match="elements"):
        join_chunks(get_codec("int8"), "w", (999,), parts)


def test_tiling_does_not_change_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Encode and decode with tiny internal tiles (many tiles, a partial last one, a partial
    # last block) and with the default ones: identical bytes and values.
    x = sample(40_000 + 17, seed=5)
    for spec in ("int8", "int4", "int4:block=32", "topk:0.01"):
        codec = get_codec(spec)
        whole = codec.encode("w", x)
        decoded = codec.decode(whole)
        with monkeypatch.context() as m:
            m.setattr(base, "_TILE_ELEMS", 1 << 10)
            tiled = codec.encode("w", x)
            assert np.array_equal(codec.decode(whole), decoded)
        assert all(
            a.tobytes() == b.tobytes() for a, b in zip(tiled.buffers, whole.buffers, strict=True)
        )
