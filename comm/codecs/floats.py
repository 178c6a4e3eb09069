"""Elementwise codecs: ``fp32`` (lossless), ``fp16`` (saturating) and ``bf16``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from comm.codecs.base import BF16_MAX, FP16_MAX, EncodedTensor, TensorLike
from comm.codecs.plumbing import (
    Layout,
    _bad_meta,
    _check_decoded,
    _check_finite_out,
    _Codec,
    _flat_f32,
    _new,
    _range_checked,
    _sum_squares_tiled,
    _tiled,
    _to_numpy,
    _torch_view,
    _Weighted,
)
from comm.codecs.registry import SpecParams, register_codec

if TYPE_CHECKING:
    from comm.codecs.base import FloatArray

# --------------------------------------------------------------------------------------------
# Elementwise codecs


class _ElementwiseCodec(_Codec):
    wire_dtype: ClassVar[np.dtype[Any]]
    limit: ClassVar[float]
    """Largest finite magnitude the wire dtype holds; beyond it values saturate."""
    chunk_multiple: ClassVar[int] = 1

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        """A cast copy into the wire dtype (so the send never aliases the input)."""
        t, shape = _flat_f32(name, x)
        t = _range_checked(name, t, self.limit)
        out = _new(t.numel(), self.wire_dtype, t.device)
        out.copy_(t)
        return EncodedTensor(name=name, shape=shape, codec=self.spec, buffers=(_to_numpy(out),))

    @property
    def spec(self) -> str:
        return self.name

    @classmethod
    def from_spec(cls, params: SpecParams) -> Self:
        params.allow()
        return cls()

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        if meta:
            _bad_meta(meta, self.name)
        return [(self.wire_dtype, numel)]

    def _tile(self, wire: npt.NDArray[Any], at: int, dst: FloatArray) -> FloatArray:
        """Elements ``[at, at + dst.size)`` decoded into ``dst`` (or a view holding them)."""
        np.copyto(dst, wire[at : at + dst.size])  # fp16 -> fp32 is exact: what torch gives
        return dst

    def _range(
        self,
        enc: EncodedTensor,
        numel: int,
        arrays: list[npt.NDArray[Any]],
        out: FloatArray,
        start: int,
        weight: _Weighted | None,
    ) -> None:
        wire = arrays[0]
        _tiled(out, start, weight, lambda at, dst: self._fill(wire, at, dst))
        if weight is None:
            _check_finite_out(enc, out)

    def _fill(self, wire: npt.NDArray[Any], at: int, dst: FloatArray) -> None:
        t = self._tile(wire, at, dst)
        if t is not dst:
            np.copyto(dst, t)

    def _sum_squares(self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]) -> float:
        wire = arrays[0]
        return _sum_squares_tiled(enc.name, numel, lambda at, dst: self._tile(wire, at, dst))


@register_codec
@dataclass(frozen=True)
class Fp32Codec(_ElementwiseCodec):
    """Lossless: the float32 bytes themselves (copied, so the send never aliases the input)."""

    name: ClassVar[str] = "fp32"
    codec_id: ClassVar[int] = 1
    wire_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.float32)
    limit: ClassVar[float] = math.inf

    def _tile(self, wire: npt.NDArray[Any], at: int, dst: FloatArray) -> FloatArray:
        return wire[at : at + dst.size]  # the values themselves, no copy

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        import torch

        out = np.empty(numel, dtype=np.float32)
        np.copyto(out, arrays[0])
        _check_decoded(enc, torch.from_numpy(out))
        return out


@register_codec
@dataclass(frozen=True)
class Fp16Codec(_ElementwiseCodec):
    """IEEE half precision. Finite values beyond +-65504 saturate to +-65504."""

    name: ClassVar[str] = "fp16"
    codec_id: ClassVar[int] = 2
    wire_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.float16)
    limit: ClassVar[float] = FP16_MAX

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        import torch

        out = _new(numel, np.dtype(np.float32), torch.device("cpu"))
        out.copy_(_torch_view(arrays[0]))
        _check_decoded(enc, out)
        return out.numpy()


@register_codec
@dataclass(frozen=True)
class Bf16Codec(_ElementwiseCodec):
    """bfloat16 (fp32's exponent, 8-bit significand) as uint16 bit patterns, round to nearest
    even. Finite values beyond the bf16 maximum saturate instead of rounding to Inf."""

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 3
    wire_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.uint16)
    limit: ClassVar[float] = BF16_MAX

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        import torch

        t, shape = _flat_f32(name, x)
        t = _range_checked(name, t, BF16_MAX)
        bits = _new(t.numel(), np.dtype(np.int16), t.device)
        bits.view(torch.bfloat16).copy_(t)  # torch's float->bf16 cast rounds to nearest even
        out = _to_numpy(bits).view(np.uint16)
        return EncodedTensor(name=name, shape=shape, codec=self.spec, buffers=(out,))

    def _tile(self, wire: npt.NDArray[Any], at: int, dst: FloatArray) -> FloatArray:
        # A bf16 is the high half of the float32 with the same bits: exact, as torch's cast.
        np.left_shift(wire[at : at + dst.size], 16, out=dst.view(np.uint32), dtype=np.uint32)
        return dst

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        import torch

        out = _new(numel, np.dtype(np.float32), torch.device("cpu"))
        out.copy_(_torch_view(arrays[0].view(np.int16)).view(torch.bfloat16))
        _check_decoded(enc, out)
        return out.numpy()
