"""Codecs by spec string and by wire id, and chunked (streaming) encoding of a flat tensor.

Every codec family registers itself here, in its own module (:func:`register_codec`), declaring
its ``name``, its stable wire ``codec_id``, how it reads its spec's parameters
(``from_spec``, given :class:`SpecParams`) and whether the ``+zstd`` stage may follow it
(``no_stage_because``). The modules of ``comm.codecs`` are imported on the first lookup, so a
new family is one new module. A spec reads ``family[:params][+zstd[:level=L]]``.

:func:`get_codec` parses a spec (``"int8:block=64+zstd"``), :func:`codec_from_id` maps a wire
``codec_id`` back to a codec, :func:`decode_tensor` decodes whatever codec an encoded tensor
names; :func:`encode_chunks` and :func:`join_chunks` encode a flat tensor chunk by chunk with
byte-identical results.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import ClassVar, Protocol, TypeVar, cast

import numpy as np

from comm.codecs.base import _ZSTD_FLAG, EncodedTensor, FloatArray, PayloadCodec, TensorLike
from comm.codecs.entropy import ZstdCodec
from comm.codecs.plumbing import _Codec

# --------------------------------------------------------------------------------------------
# Codec families


@dataclass(frozen=True)
class SpecParams:
    """A spec's parameters (``a,b=c`` after the family's ``:``), for a family's ``from_spec``."""

    family: str
    text: str | None = None
    """The parameters as written; None: the spec has no ``:``."""
    positional: tuple[str, ...] = ()
    keywords: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, family: str, text: str | None) -> SpecParams:
        """Split ``a,b=c`` into positional and keyword parameters."""
        if text is None:
            return cls(family)
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
        return cls(family, text, tuple(positional), keywords)

    def allow(self, *keywords: str, positional: bool = False) -> None:
        """Refuse positional parameters (unless ``positional``) and keywords not named."""
        if self.positional and not positional:
            raise ValueError(f"{self.family}: unexpected parameter {self.positional[0]!r}")
        unknown = sorted(set(self.keywords) - set(keywords))
        if unknown:
            known = ", ".join(sorted(keywords)) or "none"
            raise ValueError(f"{self.family}: unknown parameter {unknown[0]!r} (allowed: {known})")

    def integer(self, key: str) -> int:
        """Keyword ``key`` as a decimal integer."""
        value = self.keywords[key]
        try:
            return int(value, 10)
        except ValueError:
            raise ValueError(
                f"{self.family}: parameter {key} must be an integer, got {value!r}"
            ) from None


class CodecFamily(Protocol):
    """What a registered codec class declares."""

    name: ClassVar[str]
    """The spec's family (``int8``) and the codec's name on the wire."""
    codec_id: ClassVar[int]
    """Stable wire id, below ``0x10`` (the ``+zstd`` flag)."""
    no_stage_because: ClassVar[str]
    """Empty: ``+zstd`` may follow; else why it may not (the message refusing it)."""

    def __init__(self) -> None:
        """The family's defaults (what :func:`codec_from_id` decodes with: the parameters
        decoding needs travel in ``meta``)."""

    @classmethod
    def from_spec(cls, params: SpecParams) -> PayloadCodec:
        """The codec the spec's parameters describe."""
        ...


_F = TypeVar("_F", bound=type[CodecFamily])
_families: dict[str, type[CodecFamily]] = {}
_discovered = False


def register_codec(cls: _F) -> _F:
    """Class decorator: make the codec family ``cls`` known by its name and wire id."""
    for other in _families.values():
        if other is not cls and (other.name == cls.name or other.codec_id == cls.codec_id):
            raise ValueError(
                f"codec {cls.name!r} (id {cls.codec_id}) clashes with {other.name!r} "
                f"(id {other.codec_id})"
            )
    if not 0 < cls.codec_id < _ZSTD_FLAG:
        raise ValueError(
            f"codec {cls.name!r}: codec_id must be in [1, {_ZSTD_FLAG}), got {cls.codec_id}"
        )
    _families[cls.name] = cls
    _get_codec.cache_clear()
    return cls


def unregister_codec(name: str) -> None:
    """Forget the family ``name`` (a plug-in unloaded, a test's toy codec)."""
    _families.pop(name, None)
    _get_codec.cache_clear()


def _discover() -> None:
    """Import every module of ``comm.codecs`` once, so each registers its families."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")


def families() -> list[type[CodecFamily]]:
    """The registered codec families, by wire id."""
    _discover()
    return sorted(_families.values(), key=lambda f: f.codec_id)


class _CodecIds(Mapping[str, int]):
    """The registered families' wire ids by name, read from the registry on each use."""

    def __getitem__(self, name: str) -> int:
        _discover()
        return _families[name].codec_id

    def __iter__(self) -> Iterator[str]:
        return iter([f.name for f in families()])

    def __len__(self) -> int:
        return len(families())


CODEC_IDS: Mapping[str, int] = _CodecIds()
"""Stable wire ids of the codec families; ``+zstd`` sets bit 0x10 (``int8+zstd`` is 0x14)."""


# --------------------------------------------------------------------------------------------
# Spec strings and wire ids


def _parse_base(text: str) -> PayloadCodec:
    family, colon, params = text.partition(":")
    _discover()
    cls = _families.get(family)
    if cls is None:
        known = ", ".join(CODEC_IDS)
        raise ValueError(f"unknown codec {family!r} in spec {text!r}; known: {known}")
    return cls.from_spec(SpecParams.parse(family, params if colon else None))


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
    refused = _families[inner.name].no_stage_because
    if refused or not isinstance(inner, _Codec):
        raise ValueError(f"{spec!r}: {refused or inner.name + ' takes no stage'}; drop the stage")
    stage_name, colon, text = stage.partition(":")
    if stage_name != "zstd":
        raise ValueError(f"unknown stage {stage_name!r} in spec {spec!r}; known: zstd")
    params = SpecParams.parse("zstd", text if colon else None)
    params.allow("level")
    if "level" in params.keywords:
        return ZstdCodec(inner, level=params.integer("level"))
    return ZstdCodec(inner)


def _staged(family: type[CodecFamily]) -> bool:
    return not family.no_stage_because


def codec_from_id(codec_id: int) -> PayloadCodec:
    """The codec family named by a wire id, with default parameters.

    Decoding needs nothing more: block size, k and value dtype travel in ``meta``. Raises
    ``ValueError`` for an unknown id.
    """
    by_id = {f.codec_id: f for f in families()}
    if type(codec_id) is int:
        family = by_id.get(codec_id & ~_ZSTD_FLAG)
        if family is not None and (codec_id == family.codec_id or _staged(family)):
            inner = cast(PayloadCodec, family())
            return inner if codec_id == family.codec_id else get_codec(inner.spec + "+zstd")
    known = sorted([*by_id, *(i | _ZSTD_FLAG for i, f in by_id.items() if _staged(f))])
    raise ValueError(f"unknown codec id {codec_id!r}; known ids: {known}")


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
