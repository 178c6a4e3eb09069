"""Codecs by spec string and by wire id, and chunked (streaming) encoding of a flat tensor.

:func:`get_codec` parses a spec (``"int8:block=64+zstd"``), :func:`codec_from_id` maps a wire
``codec_id`` back to a codec, :func:`decode_tensor` decodes whatever codec an encoded tensor
names; :func:`encode_chunks` and :func:`join_chunks` encode a flat tensor chunk by chunk with
byte-identical results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache

import numpy as np

from comm.codecs.base import _ZSTD_FLAG, EncodedTensor, FloatArray, PayloadCodec, TensorLike
from comm.codecs.chunktopk import ChunkTopKCodec
from comm.codecs.entropy import ZstdCodec, _InnerCodec
from comm.codecs.floats import Bf16Codec, Fp16Codec, Fp32Codec
from comm.codecs.quantize import Int2Codec, Int3Codec, Int4Codec, Int8Codec
from comm.codecs.sparse import TopKCodec

# --------------------------------------------------------------------------------------------
# Registry and spec strings

CODEC_IDS: dict[str, int] = {
    c.name: c.codec_id
    for c in (
        Fp32Codec,
        Fp16Codec,
        Bf16Codec,
        Int8Codec,
        Int4Codec,
        TopKCodec,
        Int2Codec,
        Int3Codec,
        ChunkTopKCodec,
    )
}
"""Stable wire ids of the codec families; ``+zstd`` sets bit 0x10 (``int8+zstd`` is 0x14)."""


def _parse_params(family: str, text: str | None) -> tuple[list[str], dict[str, str]]:
    """Split ``a,b=c`` into positional and keyword parameters."""
    if text is None:
        return [], {}
    positional: list[str] = []
    keywords: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not part or (eq and (not key or not value)):
            raise ValueError(f"{family}: malformed parameter {part!r} in {text!r}")
        if not eq:
            positional.append(part)
        elif key in keywords:
            raise ValueError(f"{family}: parameter {key!r} given twice")
        else:
            keywords[key] = value
    return positional, keywords


def _int_param(family: str, key: str, value: str) -> int:
    try:
        return int(value, 10)
    except ValueError:
        raise ValueError(f"{family}: parameter {key} must be an integer, got {value!r}") from None


def _reject_extra(
    family: str, positional: list[str], keywords: dict[str, str], allowed: set[str]
) -> None:
    if positional:
        raise ValueError(f"{family}: unexpected parameter {positional[0]!r}")
    unknown = sorted(set(keywords) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed)) or "none"
        raise ValueError(f"{family}: unknown parameter {unknown[0]!r} (allowed: {known})")


def _parse_base(text: str) -> _InnerCodec | ChunkTopKCodec:
    family, colon, params = text.partition(":")
    positional, keywords = _parse_params(family, params if colon else None)
    if family in ("fp32", "fp16", "bf16"):
        _reject_extra(family, positional, keywords, set())
        return Fp32Codec() if family == "fp32" else Fp16Codec() if family == "fp16" else Bf16Codec()
    if family in ("int8", "int4", "int3", "int2"):
        _reject_extra(family, positional, keywords, {"block"})
        block = {"block": _int_param(family, "block", keywords["block"])} if keywords else {}
        if family == "int8":
            return Int8Codec(**block)
        if family == "int3":
            return Int3Codec(**block)
        return Int4Codec(**block) if family == "int4" else Int2Codec(**block)
    if family == "topk":
        if len(positional) > 1 or (positional and "k" in keywords):
            raise ValueError(f"topk: give the fraction once, got {params!r}")
        _reject_extra(family, [], keywords, {"k", "values"})
        raw = positional[0] if positional else keywords.get("k")
        if raw is None:
            raise ValueError("topk: missing the fraction of values to keep, e.g. 'topk:0.01'")
        try:
            fraction = float(raw)
        except ValueError:
            raise ValueError(f"topk: fraction must be a number, got {raw!r}") from None
        return TopKCodec(fraction=fraction, values=keywords.get("values", "fp32"))
    if family == "chunktopk":
        _reject_extra(family, positional, keywords, {"chunk", "k", "bits"})
        return ChunkTopKCodec(**{key: _int_param(family, key, v) for key, v in keywords.items()})
    known = ", ".join(CODEC_IDS)
    raise ValueError(f"unknown codec {family!r} in spec {text!r}; known: {known}")


def get_codec(spec: str) -> PayloadCodec:
    """Return the codec named by ``spec`` (e.g. ``"int8:block=128+zstd"``).

    Raises ``ValueError`` naming the unknown codec or the bad parameter.
    """
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a string, got {type(spec).__name__}")
    return _get_codec(spec.strip())


@lru_cache(maxsize=64)
def _get_codec(spec: str) -> PayloadCodec:
    # Codecs are immutable, so one instance per spec can be shared.
    base, plus, stage = spec.partition("+")
    inner = _parse_base(base)
    if not plus:
        return inner
    if isinstance(inner, ChunkTopKCodec):
        raise ValueError(f"{spec!r}: chunktopk entropy-codes its own positions; drop the stage")
    stage_name, colon, params = stage.partition(":")
    if stage_name != "zstd":
        raise ValueError(f"unknown stage {stage_name!r} in spec {spec!r}; known: zstd")
    positional, keywords = _parse_params("zstd", params if colon else None)
    _reject_extra("zstd", positional, keywords, {"level"})
    if "level" in keywords:
        return ZstdCodec(inner, level=_int_param("zstd", "level", keywords["level"]))
    return ZstdCodec(inner)


_DEFAULT_SPECS: dict[int, str] = {
    **{fid: "topk:0.01" if fam == "topk" else fam for fam, fid in CODEC_IDS.items()},
    **{
        fid | _ZSTD_FLAG: ("topk:0.01" if fam == "topk" else fam) + "+zstd"
        for fam, fid in CODEC_IDS.items()
        if fam != ChunkTopKCodec.name
    },
}


def codec_from_id(codec_id: int) -> PayloadCodec:
    """The codec family named by a wire id, with default parameters.

    Decoding needs nothing more: block size, k and value dtype travel in ``meta``. Raises
    ``ValueError`` for an unknown id.
    """
    spec = _DEFAULT_SPECS.get(codec_id) if type(codec_id) is int else None
    if spec is None:
        raise ValueError(f"unknown codec id {codec_id!r}; known ids: {sorted(_DEFAULT_SPECS)}")
    return get_codec(spec)


def decode_tensor(enc: EncodedTensor) -> FloatArray:
    """Decode with the codec ``enc.codec`` names."""
    return get_codec(enc.codec).decode(enc)


# --------------------------------------------------------------------------------------------
# Chunked (streaming) encoding


def encode_chunks(
    codec: PayloadCodec, name: str, x: TensorLike, chunk_numel: int
) -> Iterator[EncodedTensor]:
    """Encode the flattened ``x`` in slices of ``chunk_numel`` elements, one ``EncodedTensor``
    (shape ``(len,)``) per slice, so encoding can overlap sending.

    For a codec with ``chunk_multiple`` m > 0 and ``chunk_numel`` a multiple of m, the chunks'
    buffers concatenated are byte-identical to encoding ``x`` at once (:func:`join_chunks`).
    """
    m = codec.chunk_multiple
    if m == 0:
        raise ValueError(f"codec {codec.spec!r} needs the whole tensor; it cannot encode in chunks")
    if chunk_numel <= 0 or chunk_numel % m:
        raise ValueError(f"chunk_numel must be a positive multiple of {m}, got {chunk_numel}")
    flat = x.reshape(-1)
    n = int(flat.shape[0])
    for start in range(0, n, chunk_numel):
        yield codec.encode(name, flat[start : start + chunk_numel])


def join_chunks(
    codec: PayloadCodec, name: str, shape: Sequence[int], parts: Iterable[EncodedTensor]
) -> EncodedTensor:
    """Reassemble chunk encodings, in order, into the encoding of the whole tensor."""
    chunks = list(parts)
    m = codec.chunk_multiple
    if m == 0:
        raise ValueError(f"codec {codec.spec!r} does not encode in chunks")
    shape_t = tuple(int(d) for d in shape)
    if not chunks:
        if math.prod(shape_t):
            raise ValueError(f"no chunks for {name!r} of shape {shape_t}")
        return codec.encode(name, np.zeros(shape_t, dtype=np.float32))
    for i, part in enumerate(chunks):
        if part.codec != codec.spec or part.meta != chunks[0].meta:
            raise ValueError(f"chunk {i} of {name!r} was encoded as {part.codec!r} {part.meta!r}")
        if i < len(chunks) - 1 and part.numel % m:
            raise ValueError(
                f"chunk {i} of {name!r} has {part.numel} elements, not a multiple of {m}"
            )
    total = sum(p.numel for p in chunks)
    if total != math.prod(shape_t):
        raise ValueError(
            f"chunks of {name!r} hold {total} elements, shape {shape_t} holds {math.prod(shape_t)}"
        )
    buffers = tuple(
        np.concatenate([np.ascontiguousarray(p.buffers[j]).reshape(-1) for p in chunks])
        for j in range(len(chunks[0].buffers))
    )
    return EncodedTensor(
        name=name, shape=shape_t, codec=codec.spec, meta=dict(chunks[0].meta), buffers=buffers
    )
