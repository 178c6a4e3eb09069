"""Payload codecs: error bounds, exact sizes, top-k selection, chunked encoding, specs and ids,
NaN/Inf rejection on both sides, tolerance of received buffers, and the benchmark's report."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from comm.codecs import base
from comm.codecs.base import EncodedTensor, NonFiniteError, PayloadCodec, check_finite
from comm.codecs.quantize import Int2Codec, Int4Codec, Int8Codec
from comm.codecs.registry import (
    CODEC_IDS,
    codec_from_id,
    decode_tensor,
    encode_chunks,
    get_codec,
    join_chunks,
)
from comm.codecs.sparse import TopKCodec

pytestmark = pytest.mark.timeout(120)

EXACT_SPECS = [
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int8:block=128",
    "int4",
    "int4:block=32",
    "int3",
    "int2",
    "int2:block=128",
    "topk:0.01",
    "topk:0.25,values=fp16",
]
ALL_SPECS = [
    *EXACT_SPECS,
    "int8+zstd",
    "int4:block=32+zstd:level=9",
    "int3+zstd",
    "int2+zstd",
    "topk:0.01+zstd",
    "fp16+zstd",
]
CHUNKABLE = ["fp32", "fp16", "bf16", "int8", "int8:block=128", "int4", "int4:block=32", "int2"]


def _sample(n: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """Values over many magnitudes, signs mixed, so every bound is exercised."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 3, n)).astype(np.float32)


def _scales(enc: EncodedTensor) -> npt.NDArray[np.float64]:
    return np.frombuffer(enc.buffers[1], dtype=np.float16).astype(np.float64)


def _blocks(x: npt.NDArray[Any], block: int) -> list[npt.NDArray[Any]]:
    flat = x.reshape(-1)
    return [flat[i : i + block] for i in range(0, flat.size, block)]


def _true_topk(x: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Reference: sort by magnitude descending, then index ascending; first k, ascending."""
    flat = x.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -np.abs(flat.astype(np.float64))))
    return np.sort(order[:k])


def _bf16_reference(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def assert_within_bound(codec: PayloadCodec, x: npt.NDArray[Any], enc: EncodedTensor) -> None:
    """The documented error bound of ``codec`` holds for every element of ``x``."""
    x32 = np.asarray(x, dtype=np.float32)
    y = codec.decode(enc)
    assert y.shape == x32.shape and y.dtype == np.float32 and np.isfinite(y).all()
    x64, y64 = x32.astype(np.float64).reshape(-1), y.astype(np.float64).reshape(-1)
    err = np.abs(y64 - x64)
    name = codec.name.removesuffix("+zstd")
    if name == "fp32":
        assert np.array_equal(y, x32)
    elif name == "fp16":
        assert np.all(err <= np.maximum(np.abs(x64) * 2.0**-11, 2.0**-25))
    elif name == "bf16":
        assert np.all(err <= np.abs(x64) * 2.0**-8 + 2.0**-134)
    elif name in ("int8", "int4", "int3", "int2"):
        qmax = {"int8": 127.0, "int4": 7.0, "int3": 3.0, "int2": 1.0}[name]
        block = enc.meta["block"]
        raw = codec if codec.exact_size else get_codec(codec.spec.partition("+")[0])
        scales = _scales(raw.encode("x", x32))
        for s, xb, eb in zip(scales, _blocks(x64, block), _blocks(err, block), strict=True):
            absmax = float(np.max(np.abs(xb)))
            # Half a quantization step, the step being the fp16 scale rounded up from absmax/qmax.
            assert absmax / qmax * (1 - 2.0**-23) <= s
            assert s <= absmax / qmax * (1 + 2.0**-10) * (1 + 2.0**-23) + 2.0**-24
            assert np.all(eb <= s * (0.5 + 2e-5))
            assert np.all(eb <= absmax / qmax / 2 * (1 + 2.0**-9) + 2.0**-25)
    elif name == "topk":
        assert isinstance(codec, TopKCodec) or not codec.exact_size
        k = enc.meta["k"]
        kept = _true_topk(x32, k)
        mask = np.zeros(x64.size, dtype=bool)
        mask[kept] = True
        assert np.all(y64[~mask] == 0)
        if enc.meta["values"] == "fp32":
            assert np.array_equal(y64[mask], x64[mask])
        else:
            assert np.all(err[mask] <= np.maximum(np.abs(x64[mask]) * 2.0**-11, 2.0**-25))
    else:
        raise AssertionError(f"no bound for {codec.spec}")


# --------------------------------------------------------------------------------------------
# Error bounds and sizes


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 255, 256, 257, 1000, 4099])
def test_round_trip_bound_and_size(spec: str, n: int) -> None:
    codec = get_codec(spec)
    x = _sample(n, seed=n)
    enc = codec.encode("w", x)
    assert enc.codec == codec.spec and enc.shape == (n,)
    assert enc.nbytes == sum(np.asarray(b).nbytes for b in enc.buffers)
    if codec.exact_size:
        assert enc.nbytes == codec.encoded_size(n)
    else:
        assert enc.nbytes <= codec.encoded_size(n)
    assert_within_bound(codec, x, enc)


@pytest.mark.parametrize("spec", ["int8", "int4:block=32+zstd", "topk:0.01+zstd", "fp16+zstd"])
def test_zstd_bound_holds_for_incompressible_data(spec: str) -> None:
    codec = get_codec(spec)
    x = np.random.default_rng(1).uniform(-1, 1, 20_000).astype(np.float32)
    enc = codec.encode("w", x)
    assert enc.nbytes <= codec.encoded_size(x.size)


def test_zstd_stage_shuffles_multibyte_items() -> None:
    # Sorted uint32 indices compress well only once their bytes are grouped by significance.
    x = _sample(1 << 20, seed=12)
    enc = get_codec("topk:0.01+zstd").encode("w", x)
    raw_index_bytes = 4 * enc.meta["k"]
    assert enc.buffers[1].nbytes * 1.5 < raw_index_bytes


def test_encoded_size_formulas() -> None:
    n = 1_000_003
    assert get_codec("fp32").encoded_size(n) == 4 * n
    assert get_codec("fp16").encoded_size(n) == 2 * n
    assert get_codec("bf16").encoded_size(n) == 2 * n
    assert get_codec("int8").encoded_size(n) == n + 2 * math.ceil(n / 256)
    assert get_codec("int4").encoded_size(n) == math.ceil(n / 2) + 2 * math.ceil(n / 64)
    assert get_codec("int2").encoded_size(n) == math.ceil(n / 4) + 2 * math.ceil(n / 64)
    assert get_codec("topk:0.01").encoded_size(n) == 10_000 * 8
    assert get_codec("topk:0.01,values=fp16").encoded_size(n) == 10_000 * 6
    # The ratios the docs promise for large tensors.
    assert 4 * n / get_codec("int8").encoded_size(n) >= 3.9
    assert 4 * n / get_codec("int4").encoded_size(n) >= 7.5
    assert 4 * n / get_codec("int2").encoded_size(n) >= 14.2


def test_int8_golden_bytes() -> None:
    x = np.array([1.0, -0.5, 0.25, 0.0], dtype=np.float32)
    enc = Int8Codec(block=4).encode("w", x)
    q = np.frombuffer(enc.buffers[0], dtype=np.int8)
    s = _scales(enc)
    assert s[0] >= 1 / 127 and np.array_equal(q, np.round(x / s[0]).astype(np.int8))
    assert q.tolist() == [127, -63, 32, 0] or q.tolist() == [127, -64, 32, 0]


def test_int4_golden_nibbles() -> None:
    # q = [7, -7, 0, 3]: low nibble first, stored as q + 8.
    x = np.array([1.0, -1.0, 0.0, 3 / 7], dtype=np.float32)
    enc = Int4Codec(block=4).encode("w", x)
    assert np.frombuffer(enc.buffers[0], dtype=np.uint8).tolist() == [0x1F, 0xB8]
    odd = Int4Codec(block=4).encode("w", x[:3])
    assert np.frombuffer(odd.buffers[0], dtype=np.uint8).tolist() == [0x1F, 0x88]


def test_int2_golden_crumbs() -> None:
    # q = [1, -1, 0, 1 | 0, -1, ...]: element 4i + k in bits 2k of byte i, stored as q + 1.
    x = np.array([1.0, -1.0, 0.2, 0.8, 0.1, -1.0], dtype=np.float32)
    enc = Int2Codec(block=4).encode("w", x)
    # byte 0: 2 + 0*4 + 1*16 + 2*64 = 146; byte 1: 1 + 0*4 + pad 1*16 + 1*64 = 81.
    assert np.frombuffer(enc.buffers[0], dtype=np.uint8).tolist() == [146, 81]
    assert _scales(enc).tolist() == [1.0, 1.0]
    assert Int2Codec(block=4).decode(enc).tolist() == [1.0, -1.0, 0.0, 1.0, 0.0, -1.0]


def test_int2_zstd_codes_ternary_values_near_their_entropy() -> None:
    # Gaussian values per 64-block: about 3/4 of them round to 0, so the 2-bit crumbs carry about
    # one bit of information each, and zstd's entropy stage gets close to that.
    x = np.random.default_rng(5).standard_normal(1 << 20).astype(np.float32)
    plain, packed = get_codec("int2").encode("w", x), get_codec("int2+zstd").encode("w", x)
    assert plain.nbytes == get_codec("int2").encoded_size(x.size)
    assert packed.nbytes * 8 / x.size < 1.5 < plain.nbytes * 8 / x.size
    assert np.array_equal(get_codec("int2+zstd").decode(packed), get_codec("int2").decode(plain))


def test_zero_blocks_have_zero_scale_and_decode_exactly() -> None:
    x = np.zeros(600, dtype=np.float32)
    x[300:310] = np.linspace(-2, 2, 10)
    for spec in ("int8", "int4", "int2"):
        codec = get_codec(spec)
        enc = codec.encode("w", x)
        y = codec.decode(enc)
        assert np.all(y[x == 0][:256] == 0) and np.all(y[:256] == 0)
        assert _scales(enc)[0] == 0


def test_tiny_blocks_keep_a_nonzero_scale() -> None:
    # absmax / 127 is below the smallest fp16 subnormal: the scale rounds up, never to 0.
    x = np.array([3e-9, -1e-9, 2e-9, 0.0], dtype=np.float32)
    for spec in ("int8:block=4", "int4:block=4", "int2:block=4"):
        codec = get_codec(spec)
        enc = codec.encode("w", x)
        assert _scales(enc)[0] == 2.0**-24
        assert_within_bound(codec, x, enc)


def test_subnormal_blocks_keep_a_nonzero_scale() -> None:
    # absmax / qmax underflows float32 itself: the scale still rounds up to the fp16 subnormal.
    x = np.array([1e-45, 0.0, 0.0, 0.0], dtype=np.float32)
    for spec in ("int8:block=4", "int4:block=4", "int2:block=4"):
        enc = get_codec(spec).encode("w", x)
        assert _scales(enc)[0] == 2.0**-24


def test_quantized_values_stay_in_range() -> None:
    x = _sample(10_000, seed=3)
    q8 = np.frombuffer(get_codec("int8").encode("w", x).buffers[0], dtype=np.int8)
    assert q8.min() >= -127 and q8.max() <= 127
    packed = np.frombuffer(get_codec("int4").encode("w", x).buffers[0], dtype=np.uint8)
    nibbles = np.concatenate([packed & 15, packed >> 4])
    assert nibbles.min() >= 1 and nibbles.max() <= 15
    packed3 = np.frombuffer(get_codec("int3").encode("w", x).buffers[0], dtype=np.uint8)
    nibbles3 = np.concatenate([packed3 & 15, packed3 >> 4])
    assert nibbles3.min() >= 5 and nibbles3.max() <= 11
    packed2 = np.frombuffer(get_codec("int2").encode("w", x).buffers[0], dtype=np.uint8)
    crumbs = np.concatenate([(packed2 >> k) & 3 for k in (0, 2, 4, 6)])
    assert crumbs.max() <= 2 and set(np.unique(crumbs)) == {0, 1, 2}


def test_int_scale_overflow_is_a_value_error() -> None:
    x = np.array([1e6, 1.0], dtype=np.float32)
    get_codec("int8").encode("w", x)  # 1e6 / 127 fits fp16, 1e6 / 7 does not
    with pytest.raises(ValueError, match="'w'.*exceeds the int4 range"):
        get_codec("int4").encode("w", x)


def test_bf16_rounds_to_nearest_even_like_the_bit_reference() -> None:
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32)
    # Exact ties (low half 0x8000) with both parities of the kept bit.
    bits[:1000] = (bits[:1000] & 0xFFFF0000) | 0x8000
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < 3.3e38)]
    enc = get_codec("bf16").encode("w", x)
    assert np.array_equal(np.frombuffer(enc.buffers[0], dtype=np.uint16), _bf16_reference(x))
    assert_within_bound(get_codec("bf16"), x, enc)


def test_fp16_and_bf16_saturate_instead_of_overflowing() -> None:
    x = np.array([1e5, -7e4, 1.0], dtype=np.float32)
    assert get_codec("fp16").decode(get_codec("fp16").encode("w", x)).tolist() == [
        65504.0,
        -65504.0,
        1.0,
    ]
    big = np.array([3.4e38, -3.4e38], dtype=np.float32)
    assert np.isfinite(get_codec("bf16").decode(get_codec("bf16").encode("w", big))).all()
    top = get_codec("topk:0.5,values=fp16")
    assert top.decode(top.encode("w", x)).tolist() == [65504.0, -65504.0, 0.0]


# --------------------------------------------------------------------------------------------
# Top-k


@pytest.mark.parametrize("n", [1, 10, 999, 70_000, 300_000])
def test_topk_picks_the_true_largest_magnitudes(n: int) -> None:
    codec = TopKCodec(fraction=0.01)
    x = _sample(n, seed=n)
    enc = codec.encode("w", x)
    k = codec.k_for(n)
    idx = np.frombuffer(enc.buffers[1], dtype=np.uint32)
    assert idx.size == k == max(1, round(0.01 * n))
    assert np.array_equal(idx, _true_topk(x, k))
    assert np.array_equal(np.frombuffer(enc.buffers[0], dtype=np.float32), x[idx])


def test_topk_ties_go_to_the_lowest_indices() -> None:
    x = np.ones(300_000, dtype=np.float32)
    x[::2] = -1.0
    x[[7, 100, 250_000]] = 3.0
    enc = TopKCodec(fraction=0.001).encode("w", x)
    idx = np.frombuffer(enc.buffers[1], dtype=np.uint32)
    assert np.array_equal(idx, _true_topk(x, 300))
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
    assert np.array_equal(np.frombuffer(enc.buffers[1], dtype=np.uint32), _true_topk(x, 800))


def test_topk_falls_back_when_the_sample_overestimates() -> None:
    # Only the sampled positions hold large values, so the sampled threshold admits fewer than
    # k elements and the exact selection must run over everything.
    n = 400_000
    stride = n // 65536
    x = np.full(n, 1e-6, dtype=np.float32)
    x[::stride] = np.linspace(1.0, 2.0, x[::stride].size, dtype=np.float32)
    k = 800
    enc = TopKCodec(fraction=k / n).encode("w", x)
    assert np.array_equal(np.frombuffer(enc.buffers[1], dtype=np.uint32), _true_topk(x, k))


def test_topk_is_deterministic_and_whole_tensor() -> None:
    x = _sample(50_000, seed=9)
    a, b = get_codec("topk:0.02").encode("w", x), get_codec("topk:0.02").encode("w", x)
    assert all(np.array_equal(p, q) for p, q in zip(a.buffers, b.buffers, strict=True))
    assert get_codec("topk:0.02").chunk_multiple == 0


# --------------------------------------------------------------------------------------------
# Chunked (streaming) encoding


@pytest.mark.parametrize("spec", CHUNKABLE)
@pytest.mark.parametrize("n", [1, 255, 4096, 10_001])
def test_chunked_encoding_equals_whole(spec: str, n: int) -> None:
    codec = get_codec(spec)
    x = _sample(n, seed=n).reshape(-1)
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
    x = _sample(1000)
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
    x = _sample(40_000 + 17, seed=5)
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


# --------------------------------------------------------------------------------------------
# Property tests over shapes and input dtypes


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
    x = _sample(n, seed)
    chunk = codec.chunk_multiple * chunks
    joined = join_chunks(codec, "w", (n,), encode_chunks(codec, "w", x, chunk))
    whole = codec.encode("w", x)
    assert all(
        a.tobytes() == np.asarray(b).tobytes()
        for a, b in zip(joined.buffers, whole.buffers, strict=True)
    )


def test_torch_input_matches_numpy_input() -> None:
    x = _sample(5000, seed=11).reshape(50, 100)
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
    x = _sample(100_000, seed=13).reshape(100, 1000)
    for spec in ("fp32", "fp16", "bf16", "int8", "int4:block=32", "topk:0.01", "int8+zstd"):
        codec = get_codec(spec)
        enc = codec.encode("w", torch.from_numpy(x).cuda())
        assert all(isinstance(b, np.ndarray) for b in enc.buffers)
        assert_within_bound(codec, x, enc)


def test_encoding_never_aliases_the_input() -> None:
    x = _sample(1000)
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


# --------------------------------------------------------------------------------------------
# Specs and ids


def test_specs_are_canonical_and_round_trip() -> None:
    cases = {
        "fp32": "fp32",
        " fp16 ": "fp16",
        "int8:block=256": "int8",
        "int8:block=128": "int8:block=128",
        "int4:block=64": "int4",
        "int4:block=32": "int4:block=32",
        "topk:0.01": "topk:0.01",
        "topk:1e-2": "topk:0.01",
        "topk:k=0.01,values=fp16": "topk:0.01,values=fp16",
        "topk:0.01,values=fp32": "topk:0.01",
        "int8+zstd": "int8+zstd",
        "int8:block=128+zstd:level=3": "int8:block=128+zstd",
        "topk:0.01+zstd:level=9": "topk:0.01+zstd:level=9",
    }
    for spec, canonical in cases.items():
        codec = get_codec(spec)
        assert codec.spec == canonical
        assert get_codec(codec.spec) == codec


def test_codec_ids_are_stable() -> None:
    assert CODEC_IDS == {
        "fp32": 1,
        "fp16": 2,
        "bf16": 3,
        "int8": 4,
        "int4": 5,
        "topk": 6,
        "int2": 7,
        "int3": 8,
    }
    assert get_codec("int8+zstd").codec_id == 0x14
    assert get_codec("int4:block=32").codec_id == 5
    for spec in ALL_SPECS:
        codec = get_codec(spec)
        assert codec_from_id(codec.codec_id).name == codec.name


def test_codec_from_id_decodes_any_parameters() -> None:
    x = _sample(3000, seed=2)
    for spec in ("int4:block=32", "int8:block=128+zstd", "topk:0.3,values=fp16+zstd"):
        codec = get_codec(spec)
        enc = codec.encode("w", x)
        assert np.array_equal(codec_from_id(codec.codec_id).decode(enc), codec.decode(enc))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("int9", "unknown codec 'int9'"),
        ("", "unknown codec ''"),
        ("int8:block=abc", "block must be an integer"),
        ("int8:block=0", r"block must be in \[1"),
        ("int8:block=2000000", r"block must be in \[1"),
        ("int4:block=33", "block must be even"),
        ("int2:block=6", "block must be a multiple of 4"),
        ("int3:block=7", "int3: block must be even"),
        ("int8:size=4", "unknown parameter 'size'"),
        ("int8:block=4,block=8", "given twice"),
        ("int8:128", "unexpected parameter '128'"),
        ("fp16:block=4", "unknown parameter 'block'"),
        ("topk", "missing the fraction"),
        ("topk:0", r"fraction must be in \(0, 1\]"),
        ("topk:1.5", r"fraction must be in \(0, 1\]"),
        ("topk:nan", r"fraction must be in \(0, 1\]"),
        ("topk:abc", "fraction must be a number"),
        ("topk:0.1,values=int8", "values must be one of"),
        ("topk:0.1,0.2", "fraction once"),
        ("int8+lz4", "unknown stage 'lz4'"),
        ("int8+zstd:level=99", r"level must be in \[1, 22\]"),
        ("int8+zstd+zstd", "unknown stage"),
        ("int8:block=", "malformed parameter"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


@pytest.mark.parametrize("codec_id", [0, 9, 0x10, 0x19, 99, -1, True])
def test_unknown_codec_id(codec_id: int) -> None:
    with pytest.raises(ValueError, match="unknown codec id"):
        codec_from_id(codec_id)


def test_non_string_spec() -> None:
    with pytest.raises(ValueError, match="string"):
        get_codec(["int8"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# NaN / Inf


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_rejected(spec: str, bad: float) -> None:
    x = _sample(700)
    x[513] = bad
    with pytest.raises(NonFiniteError, match="'layers.3.w'") as info:
        get_codec(spec).encode("layers.3.w", x)
    assert isinstance(info.value, ValueError) and info.value.tensor_name == "layers.3.w"


def test_non_finite_after_float64_cast_is_rejected() -> None:
    with pytest.raises(NonFiniteError):
        get_codec("int8").encode("w", np.array([1e300, 1.0]))


def test_check_finite() -> None:
    check_finite("ok", np.zeros((2, 3), dtype=np.float16))
    check_finite("empty", np.zeros(0, dtype=np.float32))
    check_finite("ints", np.arange(4))
    check_finite("scalar", np.float32(1.0))
    check_finite("big", np.array([-3e38, -3e38], dtype=np.float32))
    check_finite("big16", np.array([6e4, 6e4], dtype=np.float16))
    with pytest.raises(NonFiniteError, match=r"'t'.*1 NaN, 0 Inf"):
        check_finite("t", np.array([1.0, math.nan]))
    with pytest.raises(NonFiniteError, match="'t'"):
        check_finite("t", torch.tensor([math.inf]))


def _tampered(enc: EncodedTensor, index: int, pos: int, raw: bytes) -> EncodedTensor:
    buf = bytearray(np.asarray(enc.buffers[index]).tobytes())
    buf[pos : pos + len(raw)] = raw
    buffers = list(enc.buffers)
    buffers[index] = np.frombuffer(bytes(buf), dtype=np.uint8)
    return EncodedTensor(
        name=enc.name, shape=enc.shape, codec=enc.codec, meta=enc.meta, buffers=tuple(buffers)
    )


FP16_INF = np.array([np.inf], dtype=np.float16).tobytes()
FP16_NAN = np.array([np.nan], dtype=np.float16).tobytes()


@pytest.mark.parametrize(
    ("spec", "index", "pos", "raw"),
    [
        ("fp32", 0, 8, np.array([np.inf], dtype=np.float32).tobytes()),
        ("fp16", 0, 2, FP16_NAN),
        ("bf16", 0, 4, np.array([0x7F80], dtype=np.uint16).tobytes()),
        ("int8", 1, 0, FP16_INF),
        ("int4", 1, 2, FP16_NAN),
        ("topk:0.1", 0, 0, np.array([np.nan], dtype=np.float32).tobytes()),
        ("topk:0.1,values=fp16", 0, 0, FP16_INF),
    ],
)
def test_tampered_buffers_fail_decode_as_non_finite(
    spec: str, index: int, pos: int, raw: bytes
) -> None:
    codec = get_codec(spec)
    enc = codec.encode("w", _sample(1000))
    with pytest.raises(NonFiniteError, match="'w'.*after decoding"):
        codec.decode(_tampered(enc, index, pos, raw))


def test_malformed_encodings_are_value_errors() -> None:
    x = _sample(1000)
    int8 = get_codec("int8")
    enc = int8.encode("w", x)
    short = EncodedTensor(
        name="w",
        shape=(1000,),
        codec="int8",
        meta=enc.meta,
        buffers=(enc.buffers[0][:-1], enc.buffers[1]),
    )
    with pytest.raises(ValueError, match="buffer 0 has 999 bytes, expected 1000"):
        int8.decode(short)
    with pytest.raises(ValueError, match="4 buffers, expected 2"):
        int8.decode(
            EncodedTensor(
                name="w", shape=(1000,), codec="int8", meta=enc.meta, buffers=enc.buffers * 2
            )
        )
    with pytest.raises(ValueError, match="bad meta"):
        int8.decode(
            EncodedTensor(
                name="w", shape=(1000,), codec="int8", meta={"block": "x"}, buffers=enc.buffers
            )
        )
    with pytest.raises(ValueError, match="not 'int4'"):
        get_codec("int4").decode(enc)
    top = get_codec("topk:0.1")
    tenc = top.encode("w", x)
    idx = np.frombuffer(tenc.buffers[1], dtype=np.uint32).copy()
    idx[[0, 1]] = idx[[1, 0]]
    swapped = EncodedTensor(
        name="w", shape=(1000,), codec=tenc.codec, meta=tenc.meta, buffers=(tenc.buffers[0], idx)
    )
    with pytest.raises(ValueError, match="strictly increasing"):
        top.decode(swapped)
    idx = np.frombuffer(tenc.buffers[1], dtype=np.uint32).copy()
    idx[-1] = 5000
    with pytest.raises(ValueError, match="below 1000"):
        top.decode(
            EncodedTensor(
                name="w",
                shape=(1000,),
                codec=tenc.codec,
                meta=tenc.meta,
                buffers=(tenc.buffers[0], idx),
            )
        )
    z = get_codec("int8+zstd")
    zenc = z.encode("w", x)
    with pytest.raises(ValueError, match="bad zstd frame"):
        z.decode(_tampered(zenc, 0, 0, b"\x00\x00\x00\x00"))
    grown = z.encode("w", _sample(2000))
    with pytest.raises(ValueError, match="zstd frame in buffer 0"):
        z.decode(
            EncodedTensor(
                name="w", shape=(1000,), codec=zenc.codec, meta=zenc.meta, buffers=grown.buffers
            )
        )


# --------------------------------------------------------------------------------------------
# Benchmark report shape (figures are not asserted: wall-clock time varies)


def test_benchmark_report_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.bench.codecs import main, run

    report = run(size_mib=1, repeats=1)
    assert report["memcpy_gbps"] > 0
    names = [c["name"] for c in report["codecs"]]
    assert names == ["fp32", "fp16", "bf16", "int8", "int4", "topk:0.01", "int8+zstd"]
    for c in report["codecs"]:
        assert set(c) == {"name", "ratio", "encode_gbps", "decode_gbps", "max_abs_err"}
    ratios = {c["name"]: c["ratio"] for c in report["codecs"]}
    assert ratios["int8"] >= 3.9 and ratios["int4"] >= 7.5 and ratios["fp32"] == 1.0
    assert main(["--json", "--size-mib", "1", "--repeats", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["codecs"][0]["name"] == "fp32"
    assert main(["--size-mib", "1", "--repeats", "1"]) == 0
    assert "int8+zstd" in capsys.readouterr().out
