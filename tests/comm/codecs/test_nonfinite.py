"""NaN/Inf rejection on both sides of a codec, and malformed encodings as value errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from comm.codecs.base import EncodedTensor, NonFiniteError, check_finite
from comm.codecs.registry import get_codec
from tests.support.codecs import ALL_SPECS, sample

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_rejected(spec: str, bad: float) -> None:
    x = sample(700)
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
    enc = codec.encode("w", sample(1000))
    with pytest.raises(NonFiniteError, match="'w'.*after decoding"):
        codec.decode(_tampered(enc, index, pos, raw))


def test_malformed_encodings_are_value_errors() -> None:
    x = sample(1000)
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
    grown = z.encode("w", sample(2000))
    with pytest.raises(ValueError, match="zstd frame in buffer 0"):
        z.decode(
            EncodedTensor(
                name="w", shape=(1000,), codec=zenc.codec, meta=zenc.meta, buffers=grown.buffers
            )
        )
