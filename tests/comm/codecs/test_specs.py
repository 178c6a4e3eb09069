"""Codec specs and wire ids: canonical specs, stable ids, and errors that name the problem."""

from __future__ import annotations

import numpy as np
import pytest

from comm.codecs.registry import CODEC_IDS, codec_from_id, get_codec
from tests.support.codecs import ALL_SPECS, sample

pytestmark = pytest.mark.timeout(120)


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
        "chunktopk": 9,
    }
    assert get_codec("int8+zstd").codec_id == 0x14
    assert get_codec("int4:block=32").codec_id == 5
    for spec in ALL_SPECS:
        codec = get_codec(spec)
        assert codec_from_id(codec.codec_id).name == codec.name


def test_codec_from_id_decodes_any_parameters() -> None:
    x = sample(3000, seed=2)
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


@pytest.mark.parametrize("codec_id", [0, 10, 0x10, 0x19, 99, -1, True])
def test_unknown_codec_id(codec_id: int) -> None:
    with pytest.raises(ValueError, match="unknown codec id"):
        codec_from_id(codec_id)


def test_non_string_spec() -> None:
    with pytest.raises(ValueError, match="string"):
        get_codec(["int8"])  # type: ignore[arg-type]
