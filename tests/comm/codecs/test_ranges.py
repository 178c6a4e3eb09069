"""Range decodes and in-place folds (``decode_into``, ``accumulate``) and the norm read from
the encoded values (``sum_squares``), against whole decodes, for every codec."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from comm.codecs import base
from comm.codecs.base import EncodedTensor, NonFiniteError
from comm.codecs.registry import get_codec
from tests.support.codecs import ALL_SPECS, sample

pytestmark = pytest.mark.timeout(120)

SPECS = [
    *ALL_SPECS,
    "int8:block=7",
    "int4:block=6",
    "int2:block=12",
    "chunktopk",
    "chunktopk:chunk=64,k=8,bits=1",
]
SIZES = [1, 5, 64, 1000, 4099]


def _bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(x).view(np.uint32)


def _ranges(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """The whole tensor, empty ranges at both ends, and random cuts (mostly inside blocks)."""
    cuts = [(0, n), (0, 0), (n, n), (n // 2, n // 2)]
    for _ in range(12):
        a = int(rng.integers(0, n + 1))
        cuts.append((a, int(rng.integers(a, n + 1))))
    return cuts


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of a few blocks, so ranges span several tiles and cut them."""
    monkeypatch.setattr(base, "_RANGE_TILE_ELEMS", 96)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.usefixtures("small_tiles")
def test_ranges_are_bit_equal_to_the_whole_decode(spec: str) -> None:
    codec = get_codec(spec)
    rng = np.random.default_rng(1)
    for n in SIZES:
        enc = codec.encode("w", sample(n, seed=n).reshape(-1, 1))
        whole = codec.decode(enc).reshape(-1)
        for a, b in _ranges(n, rng):
            out = np.full(b - a, np.nan, dtype=np.float32)
            codec.decode_into(enc, out, a)
            assert np.array_equal(_bits(out), _bits(whole[a:b])), (n, a, b)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.usefixtures("small_tiles")
def test_accumulate_adds_the_weighted_decode_in_float32(spec: str) -> None:
    codec = get_codec(spec)
    rng = np.random.default_rng(2)
    for n in SIZES:
        enc = codec.encode("w", sample(n, seed=n))
        whole = codec.decode(enc)
        for a, b in _ranges(n, rng):
            base_values = sample(b - a, seed=a)
            out = base_values.copy()
            codec.accumulate(enc, out, 0.3, a)
            want = base_values + np.float32(0.3) * whole[a:b]
            assert np.array_equal(_bits(out), _bits(want)), (n, a, b)


def test_a_range_fills_a_shaped_output() -> None:
    codec = get_codec("int4")
    enc = codec.encode("w", sample(48).reshape(4, 12))
    rows = np.empty((2, 12), dtype=np.float32)
    codec.decode_into(enc, rows, 12)
    assert np.array_equal(rows, codec.decode(enc)[1:3])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.usefixtures("small_tiles")
def test_sum_squares_is_the_decoded_norm(spec: str) -> None:
    codec = get_codec(spec)
    for n in [0, *SIZES]:
        enc = codec.encode("w", sample(n, seed=n))
        whole = codec.decode(enc).astype(np.float64)
        want = float(np.dot(whole, whole))
        # Quantizers: Σ (q s)² exactly against float32-rounded products; a relative 2^-23 each.
        assert codec.sum_squares(enc) == pytest.approx(want, rel=1e-6, abs=1e-30)


def test_sum_squares_of_float32_squares_beyond_its_range() -> None:
    codec = get_codec("fp32")
    enc = codec.encode("w", np.array([3e38, -3e38, 1.0], dtype=np.float32))
    assert codec.sum_squares(enc) == pytest.approx(2 * 3e38**2, rel=1e-6)


@pytest.mark.parametrize("spec", ["fp32", "int4", "topk:0.1", "int8+zstd", "chunktopk"])
@pytest.mark.parametrize(("start", "count"), [(-1, 1), (0, 1001), (1000, 1), (999, 2)])
def test_ranges_outside_the_tensor_are_refused(spec: str, start: int, count: int) -> None:
    codec = get_codec(spec)
    enc = codec.encode("w", sample(1000))
    out = np.zeros(count, dtype=np.float32)
    with pytest.raises(ValueError, match=r"'w': elements \[-?\d+, \d+\) lie outside its 1000"):
        codec.decode_into(enc, out, start)
    with pytest.raises(ValueError, match="lie outside"):
        codec.accumulate(enc, out, 1.0, start)
    assert not out.any()


@pytest.mark.parametrize(
    "out",
    [
        np.zeros(4, dtype=np.float64),
        np.zeros((4, 2), dtype=np.float32)[:, 0],
        np.zeros(4, dtype=np.float32).reshape(2, 2).T,
        [0.0] * 4,
    ],
)
def test_outputs_other_than_writable_contiguous_float32_are_refused(out: object) -> None:
    codec = get_codec("int8")
    enc = codec.encode("w", sample(10))
    with pytest.raises(ValueError, match="writable C-contiguous float32"):
        codec.decode_into(enc, out, 0)  # type: ignore[arg-type]


def test_bad_starts_and_weights_are_refused() -> None:
    codec = get_codec("int8")
    enc = codec.encode("w", sample(10))
    out = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError, match="start must be an integer"):
        codec.decode_into(enc, out, 1.5)  # type: ignore[arg-type]
    for weight in (math.nan, math.inf, 1e39):
        with pytest.raises(ValueError, match="weight must be a finite float32"):
            codec.accumulate(enc, out, weight)


def _with_buffer(enc: EncodedTensor, index: int, pos: int, raw: bytes) -> EncodedTensor:
    buffers = list(enc.buffers)
    buf = bytearray(np.asarray(buffers[index]).tobytes())
    buf[pos : pos + len(raw)] = raw
    buffers[index] = np.frombuffer(bytes(buf), dtype=np.uint8)
    return EncodedTensor(
        name=enc.name, shape=enc.shape, codec=enc.codec, meta=enc.meta, buffers=tuple(buffers)
    )


_F16_NAN = np.array([np.nan], dtype=np.float16).tobytes()


@pytest.mark.parametrize(
    ("spec", "index", "pos", "raw", "counts"),
    [
        ("fp32", 0, 8, np.array([np.inf], dtype=np.float32).tobytes(), "0 NaN, 1 Inf"),
        ("fp16", 0, 2, _F16_NAN, "1 NaN, 0 Inf"),
        ("bf16", 0, 4, np.array([0x7F80], dtype=np.uint16).tobytes(), "0 NaN, 1 Inf"),
        ("int8", 1, 0, np.array([np.inf], dtype=np.float16).tobytes(), "0 NaN, 1 Inf"),
        ("int4", 1, 2, _F16_NAN, "1 NaN, 0 Inf"),
        ("topk:0.1", 0, 0, np.array([np.nan], dtype=np.float32).tobytes(), "1 NaN, 0 Inf"),
    ],
)
@pytest.mark.usefixtures("small_tiles")
def test_non_finite_values_are_refused_as_decode_refuses_them(
    spec: str, index: int, pos: int, raw: bytes, counts: str
) -> None:
    codec = get_codec(spec)
    enc = _with_buffer(codec.encode("w", sample(1000)), index, pos, raw)
    with pytest.raises(NonFiniteError, match="'w'.*after decoding") as decoded:
        codec.decode(enc)
    with pytest.raises(NonFiniteError) as summed:
        codec.sum_squares(enc)
    assert str(summed.value) == str(decoded.value) and counts in str(summed.value)
    with pytest.raises(NonFiniteError, match="'w'.*after decoding"):
        codec.decode_into(enc, np.empty(1000, dtype=np.float32))


def test_a_range_reads_only_its_blocks_scales() -> None:
    """A bad scale outside the range does not stop decoding the range."""
    codec = get_codec("int8:block=100")
    enc = _with_buffer(codec.encode("w", sample(1000)), 1, 18, _F16_NAN)  # block 9
    whole = codec.decode(codec.encode("w", sample(1000)))
    out = np.empty(900, dtype=np.float32)
    codec.decode_into(enc, out, 0)
    assert np.array_equal(out, whole[:900])
    with pytest.raises(NonFiniteError):
        codec.decode_into(enc, np.empty(2, dtype=np.float32), 899)


def test_malformed_encodings_are_refused_before_anything_is_added() -> None:
    codec = get_codec("int4")
    enc = codec.encode("w", sample(1000))
    short = EncodedTensor(
        name="w", shape=enc.shape, codec=enc.codec, meta=enc.meta, buffers=(enc.buffers[0][:-1],)
    )
    out = np.zeros(1000, dtype=np.float32)
    for call in (
        lambda: codec.accumulate(short, out, 1.0),
        lambda: codec.sum_squares(short),
        lambda: codec.decode_into(short, out),
    ):
        with pytest.raises(ValueError, match="1 buffers, expected 2"):
            call()
    assert not out.any()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.usefixtures("small_tiles")
def test_a_fresh_output_is_written_as_adding_into_zeros(spec: str) -> None:
    """``fresh``: whatever ``out`` held (NaN here) is never read, and the result is bit for bit
    what adding into zeros gives (a -0 product lands as +0)."""
    codec = get_codec(spec)
    rng = np.random.default_rng(3)
    x = sample(1000, seed=4)
    x[::7] = -0.0
    enc = codec.encode("w", x)
    for a, b in _ranges(1000, rng):
        zeros = np.zeros(b - a, dtype=np.float32)
        codec.accumulate(enc, zeros, -0.75, a)
        fresh = np.full(b - a, np.nan, dtype=np.float32)
        codec.accumulate(enc, fresh, -0.75, a, fresh=True)
        assert np.array_equal(_bits(fresh), _bits(zeros)), (a, b)
