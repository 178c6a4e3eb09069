"""Payload codec test helpers: the specs under test, sample data, and each codec's documented
error bound as an assertion."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor, PayloadCodec
from comm.codecs.registry import get_codec
from comm.codecs.sparse import TopKCodec

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


def sample(n: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """Values over many magnitudes, signs mixed, so every bound is exercised."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 3, n)).astype(np.float32)


def block_scales(enc: EncodedTensor) -> npt.NDArray[np.float64]:
    return np.frombuffer(enc.buffers[1], dtype=np.float16).astype(np.float64)


def _blocks(x: npt.NDArray[Any], block: int) -> list[npt.NDArray[Any]]:
    flat = x.reshape(-1)
    return [flat[i : i + block] for i in range(0, flat.size, block)]


def true_topk(x: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Reference: sort by magnitude descending, then index ascending; first k, ascending."""
    flat = x.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -np.abs(flat.astype(np.float64))))
    return np.sort(order[:k])


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
        scales = block_scales(raw.encode("x", x32))
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
        kept = true_topk(x32, k)
        mask = np.zeros(x64.size, dtype=bool)
        mask[kept] = True
        assert np.all(y64[~mask] == 0)
        if enc.meta["values"] == "fp32":
            assert np.array_equal(y64[mask], x64[mask])
        else:
            assert np.all(err[mask] <= np.maximum(np.abs(x64[mask]) * 2.0**-11, 2.0**-25))
    else:
        raise AssertionError(f"no bound for {codec.spec}")
