"""The top-k codec: it keeps the true largest magnitudes, ties go to the lowest indices, and its
sampled prefilter never changes the result."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.registry import get_codec
from comm.codecs.sparse import TopKCodec
from tests.support.codecs import sample, true_topk

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [1, 10, 999, 70_000, 300_000])
def test_topk_picks_the_true_largest_magnitudes(n: int) -> None:
    codec = TopKCodec(fraction=0.01)
    x = sample(n, seed=n)
    enc = codec.encode("w", x)
    k = codec.k_for(n)
    idx = np.frombuffer(enc.buffers[1], dtype=np.uint32)
    assert idx.size == k == max(1, round(0.01 * n))
    assert np.array_equal(idx, true_topk(x, k))
    assert np.array_equal(np.frombuffer(enc.buffers[0], dtype=np.float32), x[idx])


def test_topk_ties_go_to_the_lowest_indices() -> None:
    x = np.ones(300_000, dtype=np.float32)
    x[::2] = -1.0
    x[[7, 100, 250_000]] = 3.0
    enc = TopKCodec(fraction=0.001).encode("w", x)
    idx = np.frombuffer(enc.buffers[1], dtype=np.uint32)
    assert np.array_equal(idx, true_topk(x, 300))
    assert idx.tolist()[:5] == [0, 1, 2, 3, 4] and 250_000 in idx.tolist()


def test_topk_sample_prefilter_cannot_drop_true_winners() -> None:
    # The sampled threshold sees none of the spikes between sample points; the result must
    # still be exact.
    n = 400_000
    x = np.full(n, 1e-3, dtype=np.float32)
    stride = n // 65536
    spikes = np.arange(1, n, stride)[:500]
    x[spikes] = 5.0
    enc = TopKCodec(fraction=0.002).encode("w", x)
    assert np.array_equal(np.frombuffer(enc.buffers[1], dtype=np.uint32), true_topk(x, 800))


def test_topk_falls_back_when_the_sample_overestimates() -> None:
    # Only the sampled positions hold large values, so the sampled threshold admits fewer than
    # k elements and the exact selection must run over everything.
    n = 400_000
    stride = n // 65536
    x = np.full(n, 1e-6, dtype=np.float32)
    x[::stride] = np.linspace(1.0, 2.0, x[::stride].size, dtype=np.float32)
    k = 800
    enc = TopKCodec(fraction=k / n).encode("w", x)
    assert np.array_equal(np.frombuffer(enc.buffers[1], dtype=np.uint32), true_topk(x, k))


def test_topk_is_deterministic_and_whole_tensor() -> None:
    x = sample(50_000, seed=9)
    a, b = get_codec("topk:0.02").encode("w", x), get_codec("topk:0.02").encode("w", x)
    assert all(np.array_equal(p, q) for p, q in zip(a.buffers, b.buffers, strict=True))
    assert get_codec("topk:0.02").chunk_multiple == 0
