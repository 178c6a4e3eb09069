"""Tensor payload codecs: how a float32 tensor becomes bytes on the wire and back.

This module owns the codec seam. A codec turns one float32 array into an
:class:`EncodedTensor` (a small msgpack-able ``meta`` dict plus raw buffers that travel as
zero-copy frames) and back. The wire layer (``comm.wire``) never looks inside ``meta`` or the
buffers; it only carries them. ``get_codec`` parses a codec spec string such as ``"fp32"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, kw_only=True)
class EncodedTensor:
    """One encoded tensor: what ``decode`` needs besides the buffers is in ``meta``."""

    name: str
    shape: tuple[int, ...]
    codec: str
    meta: dict[str, Any] = field(default_factory=dict)
    buffers: tuple[np.ndarray, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers)


class PayloadCodec(Protocol):
    """Encode a float32 array to buffers and back."""

    @property
    def name(self) -> str: ...

    def encoded_size(self, numel: int) -> int:
        """Exact number of buffer bytes ``encode`` produces for ``numel`` elements."""
        ...

    def encode(self, name: str, x: FloatArray) -> EncodedTensor: ...

    def decode(self, enc: EncodedTensor) -> FloatArray: ...


class Fp32Codec:
    """Lossless: the float32 bytes themselves."""

    name = "fp32"

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, name: str, x: FloatArray) -> EncodedTensor:
        arr = np.ascontiguousarray(x, dtype=np.float32)
        return EncodedTensor(
            name=name, shape=tuple(arr.shape), codec=self.name, buffers=(arr.reshape(-1),)
        )

    def decode(self, enc: EncodedTensor) -> FloatArray:
        (buf,) = enc.buffers
        flat = np.frombuffer(buf, dtype=np.float32)
        if flat.size != int(np.prod(enc.shape)):
            raise ValueError(f"{enc.name!r}: {flat.size} values for shape {enc.shape}")
        return flat.reshape(enc.shape)


def get_codec(spec: str) -> PayloadCodec:
    """Return the codec named by ``spec``; raise ``ValueError`` naming an unknown codec."""
    if spec == "fp32":
        return Fp32Codec()
    raise ValueError(f"unknown codec {spec!r}; known: fp32")
