"""A shard's encoding (rows [a, b) encoded on their own) against the same rows of the whole
tensor's encoding, as docs/compression.md ("Updates from a model held in shards") states it."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.registry import get_codec, join_chunks

pytestmark = pytest.mark.timeout(60)

RNG = np.random.default_rng(11)


def _shards(x: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    edges = [0, *cuts, x.shape[0]]
    return [x[a:b] for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize(
    ("spec", "shape", "cuts"),
    [
        ("fp32", (7, 5), [1, 4]),  # elementwise: any rows
        ("fp16", (7, 5), [3]),
        ("bf16", (7, 5), [2, 6]),
        ("int8", (8, 128), [2, 6]),  # 2 x 128 and 6 x 128 are multiples of 256
        ("int8", (10, 96), [8]),  # 8 x 96 = 3 x 256; the tensor's short last block is the shard's
        ("int8:block=100", (6, 50), [2, 4]),
        ("int4", (6, 32), [2, 4]),
        ("int3", (6, 32), [4]),
        ("int2", (5, 64), [1, 3]),
    ],
)
def test_aligned_shards_encode_to_the_bytes_of_the_whole(
    spec: str, shape: tuple[int, int], cuts: list[int]
) -> None:
    """Block boundaries at every shard boundary: the shards' buffers, concatenated in row
    order, are the whole tensor's, and so are their decoded values."""
    codec = get_codec(spec)
    x = RNG.standard_normal(shape).astype(np.float32)
    whole = codec.encode("w", x)
    pieces = [codec.encode("w", s) for s in _shards(x, cuts)]
    joined = join_chunks(codec, "w", shape, pieces)
    assert joined.meta == whole.meta
    for got, want in zip(joined.buffers, whole.buffers, strict=True):
        assert got.tobytes() == want.tobytes()
    decoded = np.concatenate([codec.decode(p) for p in pieces])
    assert np.array_equal(decoded, codec.decode(whole))


def test_a_shard_off_the_block_grid_has_other_scales_and_one_more() -> None:
    """int8 (blocks of 256) over rows of 100: the shard starting at flat 300 lays its blocks
    from there, so its scales are of other values than the whole's, and the shard before ends
    in a short block of its own: one more fp16 scale. Each decodes within its own blocks'
    bound."""
    codec = get_codec("int8")
    x = RNG.standard_normal((6, 100)).astype(np.float32)
    whole = codec.encode("w", x)
    pieces = [codec.encode("w", s) for s in _shards(x, [3])]
    assert sum(p.buffers[1].size for p in pieces) == whole.buffers[1].size + 1
    assert pieces[1].buffers[1].tobytes() != whole.buffers[1][1:].tobytes()
    decoded = np.concatenate([codec.decode(p) for p in pieces])
    assert not np.array_equal(decoded, codec.decode(whole))
    for p, s in zip(pieces, _shards(x, [3]), strict=True):
        flat = s.reshape(-1)
        scales = np.repeat(p.buffers[1].astype(np.float32), 256)[: flat.size]
        assert np.all(np.abs(codec.decode(p).reshape(-1) - flat) <= scales / 2 + 1e-7)


@pytest.mark.parametrize(
    "spec", ["chunktopk:chunk=64,k=4", "int8:block=64+zstd", "int4:block=32+zstd"]
)
def test_aligned_shards_decode_to_the_values_of_the_whole(spec: str) -> None:
    """chunktopk on the chunk grid, and +zstd over an aligned block codec: the bytes are the
    shard's own (positions and zstd frames are coded per encoded tensor), the decoded values
    are those of the same rows of the whole."""
    codec = get_codec(spec)
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    pieces = [codec.encode("w", s) for s in _shards(x, [2, 5])]
    decoded = np.concatenate([codec.decode(p) for p in pieces])
    assert np.array_equal(decoded, codec.decode(codec.encode("w", x)))


def test_top_k_of_a_shard_is_its_own() -> None:
    """topk keeps round(F n) of each shard, not the whole tensor's largest: here the large
    values all lie in the first shard, and the second still sends its own."""
    codec = get_codec("topk:0.25")
    x = RNG.standard_normal((8, 8)).astype(np.float32)
    x[:4] *= 100
    whole = codec.decode(codec.encode("w", x))
    assert not whole[4:].any()
    second = codec.decode(codec.encode("w", x[4:]))
    assert np.count_nonzero(second) == 8
