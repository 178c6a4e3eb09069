"""What a fold reads of a payload without decoding it whole: range decodes and in-place
accumulation by codec spec, and a payload's checks and norm from its encoded values
(``comm.wire.tensors``), refused with the Error codes a whole decode gives."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError
from comm.wire.schema import ErrorCode
from comm.wire.tensors import (
    accumulate,
    check_payload,
    decode_into,
    decode_tensors,
    encode_slice,
    encode_tensors,
)

pytestmark = pytest.mark.timeout(60)

RNG = np.random.default_rng(5)
PARAMS = {
    "w": RNG.standard_normal((10, 4)).astype(np.float32),
    "b": RNG.standard_normal(6).astype(np.float32),
}
SPEC = {n: v.shape for n, v in PARAMS.items()}
INT4 = get_codec("int4:block=4")


def _norm(arrays: dict[str, np.ndarray]) -> float:
    return math.sqrt(
        sum(float(np.dot(a.ravel().astype(np.float64), a.ravel())) for a in arrays.values())
    )


def test_decode_into_and_accumulate_by_the_codec_the_tensor_names() -> None:
    enc = INT4.encode("w", PARAMS["w"])
    whole = INT4.decode(enc).reshape(-1)
    out = np.empty(9, dtype=np.float32)
    decode_into(enc, out, 5)
    assert np.array_equal(out, whole[5:14])
    acc = np.ones(9, dtype=np.float32)
    accumulate(enc, acc, 2.0, 5)
    assert np.array_equal(acc, np.float32(1.0) + np.float32(2.0) * whole[5:14])


def test_range_errors_are_wire_errors_naming_the_tensor() -> None:
    enc = INT4.encode("w", PARAMS["w"])
    with pytest.raises(WireError) as err:
        decode_into(enc, np.empty(5, dtype=np.float32), 38)
    assert err.value.code == ErrorCode.BAD_PAYLOAD
    assert "'w'" in err.value.detail and "[38, 43) lie outside its 40" in err.value.detail
    with pytest.raises(WireError) as err:
        accumulate(enc, np.empty(5, dtype=np.float32), 1.0, codecs={"fp32"})
    assert err.value.code == ErrorCode.BAD_PAYLOAD and "expected ['fp32']" in err.value.detail
    unknown = dataclasses.replace(enc, codec="int9")
    with pytest.raises(WireError) as err:
        decode_into(unknown, np.empty(5, dtype=np.float32))
    assert err.value.code == ErrorCode.UNKNOWN_CODEC


@pytest.mark.parametrize("spec", ["fp32", "fp16", "int8:block=4", "int4:block=4", "int2:block=4"])
def test_check_payload_gives_the_norm_a_decode_gives(spec: str) -> None:
    payload = encode_tensors(PARAMS, get_codec(spec))
    groups, norm = check_payload(payload, SPEC)
    assert sorted(groups) == ["b", "w"]
    assert norm == pytest.approx(_norm(decode_tensors(payload, SPEC)), rel=1e-6)


def test_a_sliced_update_norm_covers_every_slice() -> None:
    w = PARAMS["w"]
    slices = [encode_slice("w", w[a:b], a, INT4) for a, b in [(0, 3), (3, 10)]]
    payload = [*slices, *encode_tensors({"b": PARAMS["b"]}, INT4)]
    groups, norm = check_payload(payload, SPEC, slices=True)
    assert [e.rows for e in groups["w"]] == [(0, 3), (3, 10)]
    assert norm == pytest.approx(_norm(decode_tensors(payload, SPEC, slices=True)), rel=1e-6)
    with pytest.raises(WireError, match="whole tensors expected"):
        check_payload(payload, SPEC)
    with pytest.raises(WireError, match="rows 3:10 missing"):
        check_payload([slices[0], *payload[2:]], SPEC, slices=True)


def test_check_payload_refuses_what_decoding_refuses() -> None:
    good = list(encode_tensors(PARAMS, get_codec("fp32")))
    bad = np.array(good[0].buffers[0], copy=True)
    bad[7] = np.inf
    payload = [dataclasses.replace(good[0], buffers=(bad,)), good[1]]
    with pytest.raises(WireError) as decoded:
        decode_tensors(payload, SPEC)
    with pytest.raises(WireError) as checked:
        check_payload(payload, SPEC)
    assert checked.value.code == decoded.value.code == ErrorCode.NON_FINITE
    assert checked.value.detail == decoded.value.detail and "'w'" in checked.value.detail
    with pytest.raises(WireError) as err:
        check_payload(payload[1:], SPEC)
    assert err.value.code == ErrorCode.BAD_PAYLOAD and "missing ['w']" in err.value.detail
    short = EncodedTensor(name="b", shape=(6,), codec="fp32", buffers=(np.zeros(5, np.float32),))
    with pytest.raises(WireError) as err:
        check_payload([good[0], short], SPEC)
    assert err.value.code == ErrorCode.BAD_PAYLOAD and "expected 24" in err.value.detail
