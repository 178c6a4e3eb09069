"""Dense payload codecs (fp32, fp16, bf16, int8/4/3/2) and the zstd stage: error bounds, exact
sizes, golden bytes, scales, rounding and saturation."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from comm.codecs.quantize import Int2Codec, Int4Codec, Int8Codec
from comm.codecs.registry import get_codec
from tests.support.codecs import ALL_SPECS, assert_within_bound, block_scales, sample

pytestmark = pytest.mark.timeout(120)


def _bf16_reference(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 255, 256, 257, 1000, 4099])
def test_round_trip_bound_and_size(spec: str, n: int) -> None:
    codec = get_codec(spec)
    x = sample(n, seed=n)
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
    x = sample(1 << 20, seed=12)
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
    s = block_scales(enc)
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
    assert block_scales(enc).tolist() == [1.0, 1.0]
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
        assert block_scales(enc)[0] == 0


def test_tiny_blocks_keep_a_nonzero_scale() -> None:
    # absmax / 127 is below the smallest fp16 subnormal: the scale rounds up, never to 0.
    x = np.array([3e-9, -1e-9, 2e-9, 0.0], dtype=np.float32)
    for spec in ("int8:block=4", "int4:block=4", "int2:block=4"):
        codec = get_codec(spec)
        enc = codec.encode("w", x)
        assert block_scales(enc)[0] == 2.0**-24
        assert_within_bound(codec, x, enc)


def test_subnormal_blocks_keep_a_nonzero_scale() -> None:
    # absmax / qmax underflows float32 itself: the scale still rounds up to the fp16 subnormal.
    x = np.array([1e-45, 0.0, 0.0, 0.0], dtype=np.float32)
    for spec in ("int8:block=4", "int4:block=4", "int2:block=4"):
        enc = get_codec(spec).encode("w", x)
        assert block_scales(enc)[0] == 2.0**-24


def test_quantized_values_stay_in_range() -> None:
    x = sample(10_000, seed=3)
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
