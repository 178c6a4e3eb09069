"""What codecs accept: property tests over shapes and input dtypes, received buffers (read-only,
misaligned), torch and CUDA tensors, aliasing, and non-float input."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import decode_tensor, encode_chunks, get_codec, join_chunks
from tests.support.codecs import ALL_SPECS, CHUNKABLE, assert_within_bound, sample

pytestmark = pytest.mark.timeout(120)


_ARRAYS = st.sampled_from([np.float16, np.float32, np.float64]).flatmap(
    lambda dt: hnp.arrays(
        dtype=dt,
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24),
        elements={
            "allow_nan": False,
            "allow_infinity": False,
            "min_value": -6e4,
            "max_value": 6e4,
        },
    )
)


@settings(max_examples=40, deadline=None)
@given(x=_ARRAYS, spec=st.sampled_from(ALL_SPECS))
def test_property_round_trip(x: npt.NDArray[Any], spec: str) -> None:
    codec = get_codec(spec)
    enc = codec.encode("p", x)
    assert enc.shape == x.shape
    assert msgpack.unpackb(msgpack.packb(enc.meta), strict_map_key=False) == enc.meta
    assert all(isinstance(b, np.ndarray) and b.flags.c_contiguous for b in enc.buffers)
    if codec.exact_size:
        assert enc.nbytes == codec.encoded_size(x.size)
    else:
        assert enc.nbytes <= codec.encoded_size(x.size)
    assert_within_bound(codec, x, enc)
    # Received frames: read-only bytes, memoryviews, misaligned copies all decode the same.
    want = codec.decode(enc)
    for wrap in (bytes, memoryview, _misaligned):
        moved = EncodedTensor(
            name=enc.name,
            shape=enc.shape,
            codec=enc.codec,
            meta=msgpack.unpackb(msgpack.packb(enc.meta)),
            buffers=tuple(wrap(np.asarray(b)) for b in enc.buffers),
        )
        assert np.array_equal(decode_tensor(moved), want)


def _misaligned(b: npt.NDArray[Any]) -> npt.NDArray[Any]:
    raw = np.zeros(b.nbytes + 1, dtype=np.uint8)
    raw[1:] = b.reshape(-1).view(np.uint8)
    return raw[1:]


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 3000),
    chunks=st.integers(1, 5),
    spec=st.sampled_from(CHUNKABLE),
    seed=st.integers(0, 2**16),
)
def test_property_chunked_equals_whole(n: int, chunks: int, spec: str, seed: int) -> None:
    codec = get_codec(spec)
    x = sample(n, seed)
    chunk = codec.chunk_multiple * chunks
    joined = join_chunks(codec, "w", (n,), encode_chunks(codec, "w", x, chunk))
    whole = codec.encode("w", x)
    assert all(
        a.tobytes() == np.asarray(b).tobytes()
        for a, b in zip(joined.buffers, whole.buffers, strict=True)
    )


def test_torch_input_matches_numpy_input() -> None:
    x = sample(5000, seed=11).reshape(50, 100)
    for spec in ("fp16", "bf16", "int8", "int4", "topk:0.05"):
        codec = get_codec(spec)
        a, b = codec.encode("w", x), codec.encode("w", torch.from_numpy(x))
        assert a.shape == b.shape == (50, 100)
        assert all(p.tobytes() == q.tobytes() for p, q in zip(a.buffers, b.buffers, strict=True))
    bf = torch.from_numpy(x).to(torch.bfloat16)
    got = get_codec("fp32").decode(get_codec("fp32").encode("w", bf))
    assert np.array_equal(got, bf.to(torch.float32).numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_encode_on_their_device() -> None:
    x = sample(100_000, seed=13).reshape(100, 1000)
    for spec in ("fp32", "fp16", "bf16", "int8", "int4:block=32", "topk:0.01", "int8+zstd"):
        codec = get_codec(spec)
        enc = codec.encode("w", torch.from_numpy(x).cuda())
        assert all(isinstance(b, np.ndarray) for b in enc.buffers)
        assert_within_bound(codec, x, enc)


def test_encoding_never_aliases_the_input() -> None:
    x = sample(1000)
    for spec in ("fp32", "fp16", "int8"):
        enc = get_codec(spec).encode("w", x)
        before = get_codec(spec).decode(enc)
        x_mut = x.copy()
        x[:] = 7.0
        assert np.array_equal(get_codec(spec).decode(enc), before)
        x[:] = x_mut


def test_non_float_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="floating"):
        get_codec("int8").encode("w", np.arange(10))
    with pytest.raises(ValueError, match="floating"):
        get_codec("fp16").encode("w", torch.arange(10))
