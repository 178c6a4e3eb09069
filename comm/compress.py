"""Tensor payload codecs: how a float32 tensor becomes bytes on the wire and back.

This module owns the codec seam. A codec turns one float32 tensor into an :class:`EncodedTensor`
(a small msgpack-able ``meta`` dict plus raw buffers that travel as zero-copy frames) and back.
The wire layer (``comm.wire``) never looks inside ``meta`` or the buffers; it only carries them,
naming the codec by ``codec_id`` and ``spec``.

Codecs, by spec string (see ``docs/compression.md`` for sizes and error bounds):

- ``fp32``: the float32 bytes (lossless).
- ``fp16``: IEEE half precision; values beyond +-65504 saturate.
- ``bf16``: bfloat16 bit patterns as uint16, round to nearest even.
- ``int8[:block=N]`` / ``int4[:block=N]``: blockwise symmetric absmax quantization, one fp16
  scale per block, int4 packed two values per byte.
- ``topk:F[,values=fp16]``: the ``round(F * numel)`` largest magnitudes with uint32 indices.
- any of the above followed by ``+zstd[:level=L]``: a lossless zstandard stage over each buffer.

Invariants every codec keeps: ``encode`` rejects NaN/Inf with :class:`NonFiniteError`; ``decode``
validates the buffers against the sizes the meta implies and rejects a non-finite result; encoded
buffers never alias the input and decoded arrays are fresh, writable and C-contiguous; the
elementwise and blockwise codecs can encode a flat tensor chunk by chunk with byte-identical
results (``chunk_multiple``, :func:`encode_chunks`, :func:`join_chunks`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, NoReturn, Protocol

import numpy as np
import numpy.typing as npt
import torch
import zstandard

FloatArray = npt.NDArray[np.float32]
TensorLike = npt.NDArray[Any] | torch.Tensor
"""What ``encode`` accepts: a float16/float32/float64 numpy array or torch tensor (any device)."""

FP16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)

# Elementwise work on CPU runs in tiles of this many values (4 MiB of float32): the temporaries
# stay in cache, and each tile is one vectorized torch op chain, so the Python loop is per tile
# only. Smaller tiles were no faster here and multiply the thread-pool hand-offs, each of which
# stalls when another process holds a core.
_TILE_ELEMS = 1 << 20
_ZSTD_FLAG = 0x10
_MAX_BLOCK = 1 << 20
_DEFAULT_ZSTD_LEVEL = 3
_CPU = torch.device("cpu")
_F16 = np.dtype(np.float16)
_U8 = np.dtype(np.uint8)


class NonFiniteError(ValueError):
    """A tensor holds NaN or Inf, either before encoding or after decoding."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"tensor {name!r} {detail}")
        self.tensor_name = name


def _raise_non_finite(name: str, t: torch.Tensor, *, stage: str = "") -> NoReturn:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    where = f" {stage}" if stage else ""
    raise NonFiniteError(name, f"has non-finite values{where} ({nan} NaN, {inf} Inf)")


def check_finite(name: str, x: TensorLike) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` if ``x`` holds a NaN or an Inf."""
    if not isinstance(x, torch.Tensor):
        arr = np.asarray(x)
        # min/max propagate NaN and expose +-Inf, without copying read-only arrays.
        if (
            arr.size
            and arr.dtype.kind == "f"
            and not (np.isfinite(arr.min()) and np.isfinite(arr.max()))
        ):
            _raise_non_finite(name, torch.from_numpy(np.array(arr)))
        return
    t = x.detach()
    if t.numel() == 0 or not t.is_floating_point():
        return
    # One read-only pass: min/max propagate NaN and expose +-Inf.
    lo, hi = torch.aminmax(t.reshape(-1))
    if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
        _raise_non_finite(name, t)


@dataclass(frozen=True, kw_only=True)
class EncodedTensor:
    """One encoded tensor: what ``decode`` needs besides the buffers is in ``meta``.

    ``codec`` is the canonical spec of the codec that produced it. ``meta`` holds only msgpack-able
    values. ``buffers`` are C-contiguous numpy arrays; ``decode`` also accepts any bytes-like
    object in their place (a received frame), reinterpreting the bytes itself.
    """

    name: str
    shape: tuple[int, ...]
    codec: str
    meta: dict[str, Any] = field(default_factory=dict)
    buffers: tuple[npt.NDArray[Any], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class PayloadCodec(Protocol):
    """Encode a float32 tensor to buffers and back."""

    @property
    def name(self) -> str:
        """Codec family, e.g. ``"int8"`` or ``"int8+zstd"`` (a metrics label)."""
        ...

    @property
    def spec(self) -> str:
        """Canonical spec string; ``get_codec(c.spec) == c``."""
        ...

    @property
    def codec_id(self) -> int:
        """Stable small integer naming the family on the wire; see :func:`codec_from_id`."""
        ...

    @property
    def exact_size(self) -> bool:
        """True when ``encoded_size`` is exact; False when it is an upper bound (``+zstd``)."""
        ...

    @property
    def chunk_multiple(self) -> int:
        """Chunk boundaries at multiples of this many elements give byte-identical encodings;
        0 when the codec must see the whole tensor at once."""
        ...

    def encoded_size(self, numel: int) -> int:
        """Number of buffer bytes ``encode`` produces for ``numel`` elements (see ``exact_size``)."""
        ...

    def encode(self, name: str, x: TensorLike) -> EncodedTensor: ...

    def decode(self, enc: EncodedTensor) -> FloatArray: ...


# --------------------------------------------------------------------------------------------
# Array plumbing


def _nbytes(buf: Any) -> int:
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return memoryview(buf).nbytes


def _torch_view(arr: npt.NDArray[Any]) -> torch.Tensor:
    """A torch tensor over ``arr``'s memory, copying only when torch cannot share it."""
    if not (arr.flags.c_contiguous and arr.flags.aligned and arr.flags.writeable):
        # Read-only (e.g. a received frame) or unaligned memory: torch cannot wrap it safely.
        arr = np.array(arr, order="C", copy=True)
    return torch.from_numpy(arr)


def _new(numel: int, dtype: np.dtype[Any], device: torch.device) -> torch.Tensor:
    """A fresh uninitialized 1-D tensor. On CPU it is numpy-allocated, which asks the kernel for
    huge pages on large arrays: page faults otherwise cost more than the codec math."""
    if device.type == "cpu":
        return torch.from_numpy(np.empty(numel, dtype=dtype))
    tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return torch.empty(numel, dtype=tdtype, device=device)


def _to_numpy(t: torch.Tensor) -> npt.NDArray[Any]:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _flat_f32(name: str, x: TensorLike) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` as a flat contiguous float32 torch tensor (no copy when it already is one)."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ValueError(f"tensor {name!r}: expected a floating dtype, got {x.dtype}")
        shape = tuple(int(d) for d in x.shape)
        return x.detach().to(torch.float32).contiguous().reshape(-1), shape
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ValueError(f"tensor {name!r}: expected a floating dtype, got {arr.dtype}")
    shape = tuple(int(d) for d in arr.shape)
    if arr.dtype != np.float32 or not arr.flags.c_contiguous:
        # A float64 beyond float32's range becomes Inf here, which the finite check reports.
        with np.errstate(over="ignore"):
            arr = np.ascontiguousarray(arr, dtype=np.float32)
    return _torch_view(arr.reshape(-1)), shape


def _read_buffer(
    enc: EncodedTensor, index: int, dtype: np.dtype[Any], count: int
) -> npt.NDArray[Any]:
    """Buffer ``index`` of ``enc`` reinterpreted as ``count`` items of ``dtype``."""
    buf: Any = enc.buffers[index]
    if isinstance(buf, np.ndarray):
        raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    want = count * dtype.itemsize
    if raw.nbytes != want:
        raise ValueError(
            f"tensor {enc.name!r} ({enc.codec}): buffer {index} has {raw.nbytes} bytes, "
            f"expected {want}"
        )
    return raw.view(dtype)


def _check_buffers(enc: EncodedTensor, count: int) -> None:
    if len(enc.buffers) != count:
        raise ValueError(
            f"tensor {enc.name!r} ({enc.codec}): {len(enc.buffers)} buffers, expected {count}"
        )


def _check_shape(enc: EncodedTensor) -> int:
    """Validate what every decode trusts first: shape and meta types. Returns numel."""
    if not all(isinstance(d, int) and d >= 0 for d in enc.shape):
        raise ValueError(f"tensor {enc.name!r}: bad shape {enc.shape!r}")
    if not isinstance(enc.meta, dict):
        raise ValueError(f"tensor {enc.name!r}: meta must be a dict, got {type(enc.meta).__name__}")
    return enc.numel


def _family(spec: str) -> str:
    base, _, rest = spec.partition("+")
    fam = base.partition(":")[0]
    return fam + ("+" + rest.partition(":")[0] if rest else "")


def _check_family(enc: EncodedTensor, name: str) -> None:
    if _family(enc.codec) != name:
        raise ValueError(f"tensor {enc.name!r} was encoded with {enc.codec!r}, not {name!r}")


def _check_decoded(enc: EncodedTensor, out: torch.Tensor) -> None:
    if out.numel():
        lo, hi = torch.aminmax(out)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            _raise_non_finite(enc.name, out, stage="after decoding")


def _range_checked(name: str, t: torch.Tensor, limit: float) -> torch.Tensor:
    """Reject NaN/Inf; saturate finite values beyond +-``limit`` (a copy only when needed)."""
    if t.numel() == 0:
        return t
    lo, hi = torch.aminmax(t)
    lo_f, hi_f = float(lo), float(hi)
    if not (math.isfinite(lo_f) and math.isfinite(hi_f)):
        _raise_non_finite(name, t, stage="before encoding")
    if lo_f < -limit or hi_f > limit:
        return t.clamp(-limit, limit)
    return t


# --------------------------------------------------------------------------------------------
# Codec skeleton

Layout = list[tuple[np.dtype[Any], int]]
"""Per buffer: (dtype, item count)."""


class _Codec:
    """What every codec shares: size from the layout, and decode's validation order (family,
    shape, meta, buffer count and sizes) before any array is allocated."""

    name: ClassVar[str]
    exact_size: ClassVar[bool] = True

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        """Buffer layout for ``numel`` elements: from this codec's parameters when ``meta`` is
        None, else from a received ``meta`` (validated, ``ValueError`` when malformed)."""
        raise NotImplementedError

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        """Flat float32 result from buffers already checked against ``_layout``."""
        raise NotImplementedError

    def encoded_size(self, numel: int) -> int:
        return sum(d.itemsize * c for d, c in self._layout(numel, None))

    def decode(self, enc: EncodedTensor) -> FloatArray:
        _check_family(enc, self.name)
        n = _check_shape(enc)
        layout = self._layout(n, enc.meta)
        _check_buffers(enc, len(layout))
        arrays = [_read_buffer(enc, i, d, c) for i, (d, c) in enumerate(layout)]
        return self._decode_arrays(enc, n, arrays).reshape(enc.shape)


def _bad_meta(meta: dict[str, Any], family: str) -> NoReturn:
    raise ValueError(f"{family}: bad meta {meta!r}")


def _meta_int(meta: dict[str, Any], key: str, family: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        _bad_meta(meta, family)
    return value


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

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        if meta:
            _bad_meta(meta, self.name)
        return [(self.wire_dtype, numel)]


@dataclass(frozen=True)
class Fp32Codec(_ElementwiseCodec):
    """Lossless: the float32 bytes themselves (copied, so the send never aliases the input)."""

    name: ClassVar[str] = "fp32"
    codec_id: ClassVar[int] = 1
    wire_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.float32)
    limit: ClassVar[float] = math.inf

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        out = np.empty(numel, dtype=np.float32)
        np.copyto(out, arrays[0])
        _check_decoded(enc, torch.from_numpy(out))
        return out


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
        out = _new(numel, np.dtype(np.float32), _CPU)
        out.copy_(_torch_view(arrays[0]))
        _check_decoded(enc, out)
        return out.numpy()


@dataclass(frozen=True)
class Bf16Codec(_ElementwiseCodec):
    """bfloat16 (fp32's exponent, 8-bit significand) as uint16 bit patterns, round to nearest
    even. Finite values beyond the bf16 maximum saturate instead of rounding to Inf."""

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 3
    wire_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.uint16)
    limit: ClassVar[float] = BF16_MAX

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        t, shape = _flat_f32(name, x)
        t = _range_checked(name, t, BF16_MAX)
        bits = _new(t.numel(), np.dtype(np.int16), t.device)
        bits.view(torch.bfloat16).copy_(t)  # torch's float->bf16 cast rounds to nearest even
        out = _to_numpy(bits).view(np.uint16)
        return EncodedTensor(name=name, shape=shape, codec=self.spec, buffers=(out,))

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        out = _new(numel, np.dtype(np.float32), _CPU)
        out.copy_(_torch_view(arrays[0].view(np.int16)).view(torch.bfloat16))
        _check_decoded(enc, out)
        return out.numpy()


# --------------------------------------------------------------------------------------------
# Blockwise absmax quantization


def _block_scales(
    name: str, x2d: torch.Tensor, qmax: float, family: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scales (absmax / qmax, rounded *up* to the next fp16) and their fp32 reciprocals.

    Rounding up keeps |x| / scale <= qmax, so quantized values never need clamping, and a scale
    too small for fp16 becomes the smallest subnormal instead of 0. A zero block gets scale 0
    and reciprocal 0. NaN/Inf in ``x2d`` surfaces here: max and min propagate them.
    """
    # Reducing over the transposed view lets torch vectorize across blocks: much faster than a
    # row reduction for short blocks.
    cols = x2d.t()
    absmax = torch.maximum(torch.amax(cols, dim=0), torch.amin(cols, dim=0).neg_())
    if not bool(torch.isfinite(absmax).all()):
        _raise_non_finite(name, x2d, stage="before encoding")
    scale = absmax.div_(qmax)
    s16 = scale.to(torch.float16)
    # For non-negative halves the next representable value is the next bit pattern.
    s16.view(torch.int16).add_((s16.to(torch.float32) < scale).to(torch.int16))
    s32 = s16.to(torch.float32)
    if not bool(torch.isfinite(s32).all()):
        raise ValueError(
            f"tensor {name!r}: block absmax {float(scale.max()) * qmax:.6g} exceeds the {family} "
            f"range (fp16 scales, so |x| <= {FP16_MAX * qmax:g})"
        )
    inv = torch.where(s32 > 0, s32.reciprocal(), torch.zeros_like(s32))
    return s16, inv


def _quantize_rows(x2d: torch.Tensor, inv: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """round(x * inv) per row into ``scratch`` (float32, round half to even)."""
    tmp = scratch[: x2d.numel()].view(x2d.shape)
    torch.mul(x2d, inv[:, None], out=tmp)
    return tmp.round_()


def _tile_rows(block: int, nrows: int, device: torch.device) -> int:
    """Rows per tile: cache-sized on CPU, everything at once on an accelerator."""
    if device.type != "cpu":
        return max(nrows, 1)
    return max(1, _TILE_ELEMS // block)


def _validate_block(family: str, block: int) -> None:
    if not (1 <= block <= _MAX_BLOCK):
        raise ValueError(f"{family}: block must be in [1, {_MAX_BLOCK}], got {block}")
    if family == "int4" and block % 2:
        raise ValueError(f"int4: block must be even (two values per byte), got {block}")


class _BlockCodec(_Codec):
    """Shared spec, layout and driver of the blockwise quantizers. Subclasses supply the value
    buffer's dtype and size, and the per-tile pack and unpack."""

    block: int
    qmax: ClassVar[float]
    default_block: ClassVar[int]
    value_dtype: ClassVar[np.dtype[Any]]

    def __post_init__(self) -> None:
        _validate_block(self.name, self.block)

    @property
    def spec(self) -> str:
        return self.name if self.block == self.default_block else f"{self.name}:block={self.block}"

    @property
    def chunk_multiple(self) -> int:
        return self.block

    def _value_count(self, numel: int) -> int:
        raise NotImplementedError

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        if meta is None:
            block = self.block
        else:
            if set(meta) != {"block"}:
                _bad_meta(meta, self.name)
            block = _meta_int(meta, "block", self.name)
            _validate_block(self.name, block)
        return [(self.value_dtype, self._value_count(numel)), (_F16, -(-numel // block))]

    def _pack_tile(self, q2d: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
        """Store rounded values ``q2d`` (float32) as the value buffer slice ``out``; ``work`` is
        float32 scratch of half a tile."""
        raise NotImplementedError

    def _unpack_tile(
        self, values: torch.Tensor, s32: torch.Tensor, out2d: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        """out2d[r, j] = value[r, j] * s32[r] for one tile of whole blocks."""
        raise NotImplementedError

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        t, shape = _flat_f32(name, x)
        n, b = t.numel(), self.block
        full = n - n % b
        values = _new(self._value_count(n), self.value_dtype, t.device)
        s16 = _new(-(-n // b), _F16, t.device)
        if full:
            split = self._value_count(full)
            self._encode_blocks(name, t[:full].view(-1, b), values[:split], s16[: full // b])
        if full < n:
            # The partial last block is quantized as a zero-padded whole block.
            pad = torch.zeros(b, dtype=torch.float32, device=t.device)
            pad[: n - full] = t[full:]
            vpad = torch.empty(self._value_count(b), dtype=values.dtype, device=t.device)
            self._encode_blocks(name, pad.view(1, b), vpad, s16[-1:])
            values[self._value_count(full) :] = vpad[: values.numel() - self._value_count(full)]
        return EncodedTensor(
            name=name,
            shape=shape,
            codec=self.spec,
            meta={"block": b},
            buffers=(_to_numpy(values), _to_numpy(s16)),
        )

    def _encode_blocks(
        self, name: str, x2d: torch.Tensor, values: torch.Tensor, s_out: torch.Tensor
    ) -> None:
        s16, inv = _block_scales(name, x2d, self.qmax, self.name)
        s_out.copy_(s16)
        nrows = x2d.shape[0]
        rows = _tile_rows(self.block, nrows, x2d.device)
        tile = min(rows, nrows) * self.block
        scratch = torch.empty(tile + tile // 2, device=x2d.device)
        work = scratch[tile:]
        per_row = self._value_count(self.block)
        for r0 in range(0, nrows, rows):
            q2d = _quantize_rows(x2d[r0 : r0 + rows], inv[r0 : r0 + rows], scratch[:tile])
            start, stop = r0 * per_row, (r0 + q2d.shape[0]) * per_row
            self._pack_tile(q2d, values[start:stop], work)

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        block = _meta_int(enc.meta, "block", self.name)
        values = _torch_view(arrays[0])
        s32 = torch.from_numpy(arrays[1].astype(np.float32))
        # |q| <= qmax and |scale| <= 65504, so the output is finite iff every scale is.
        if not bool(torch.isfinite(s32).all()):
            _raise_non_finite(enc.name, s32, stage="after decoding (in the block scales)")
        out = _new(numel, np.dtype(np.float32), _CPU)
        full = numel - numel % block
        per_row = self._value_count(block)
        if full:
            out2d = out[:full].view(-1, block)
            nrows = out2d.shape[0]
            rows = _tile_rows(block, nrows, _CPU)
            scratch = torch.empty(min(rows, nrows) * block, dtype=torch.int16)
            for r0 in range(0, nrows, rows):
                o = out2d[r0 : r0 + rows]
                v = values[r0 * per_row : r0 * per_row + o.shape[0] * per_row]
                self._unpack_tile(v, s32[r0 : r0 + o.shape[0]], o, scratch)
        if full < numel:
            start = self._value_count(full)
            vpad = torch.zeros(per_row, dtype=values.dtype)
            vpad[: values.numel() - start] = values[start:]
            opad = torch.empty(1, block)
            self._unpack_tile(vpad, s32[-1:], opad, torch.empty(block, dtype=torch.int16))
            out[full:] = opad.view(-1)[: numel - full]
        return out.numpy()


@dataclass(frozen=True)
class Int8Codec(_BlockCodec):
    """Symmetric int8 per block of ``block`` values: q = round(x / s) in [-127, 127],
    s = absmax / 127 stored as fp16."""

    block: int = 256
    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 4
    qmax: ClassVar[float] = 127.0
    default_block: ClassVar[int] = 256
    value_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.int8)

    def _value_count(self, numel: int) -> int:
        return numel

    def _pack_tile(self, q2d: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
        out.view(q2d.shape).copy_(q2d)

    def _unpack_tile(
        self, values: torch.Tensor, s32: torch.Tensor, out2d: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        out2d.copy_(values.view(out2d.shape))
        out2d.mul_(s32[:, None])


# Nibble layout: element 2i in the low nibble of byte i, element 2i+1 in the high nibble, each
# stored as q + 8 (so 1..15, and 8 is zero). An odd tail's unused high nibble holds 8.
_NIBBLE_BIAS = 8


@dataclass(frozen=True)
class Int4Codec(_BlockCodec):
    """Symmetric int4 per block of ``block`` values: q = round(x / s) in [-7, 7],
    s = absmax / 7 stored as fp16, packed two values per byte."""

    block: int = 64
    name: ClassVar[str] = "int4"
    codec_id: ClassVar[int] = 5
    qmax: ClassVar[float] = 7.0
    default_block: ClassVar[int] = 64
    value_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.uint8)

    def _value_count(self, numel: int) -> int:
        return (numel + 1) // 2

    def _pack_tile(self, q2d: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
        pairs = q2d.view(-1, 2)
        # (lo + 8) + 16 * (hi + 8) is exact in float32, then one cast to uint8.
        sums = work[: pairs.shape[0]]
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=sums)
        sums.add_(_NIBBLE_BIAS * 17)
        out.copy_(sums)

    def _unpack_tile(
        self, values: torch.Tensor, s32: torch.Tensor, out2d: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        wide = scratch[: values.numel()]
        shifted = scratch[values.numel() : 2 * values.numel()]
        # Spread each byte's two nibbles over the two bytes of an int16: (w | w << 4) & 0x0F0F
        # leaves the low nibble in the low byte and the high nibble in the high byte, so on a
        # little-endian host the int16s viewed as bytes are the nibbles in element order.
        wide.copy_(values)
        torch.bitwise_left_shift(wide, 4, out=shifted)
        wide.bitwise_or_(shifted).bitwise_and_(0x0F0F)
        # Remove the bias per byte (0..15 -> -8..7, no borrow between bytes), then scale.
        q = wide.view(torch.int8).sub_(_NIBBLE_BIAS)
        out2d.copy_(q.view(out2d.shape))
        out2d.mul_(s32[:, None])


# --------------------------------------------------------------------------------------------
# Top-k sparsification


_VALUE_DTYPES: dict[str, np.dtype[Any]] = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
}


@dataclass(frozen=True)
class TopKCodec(_Codec):
    """The k = max(1, round(fraction * numel)) largest magnitudes, as (values, uint32 indices)
    with indices ascending. Ties at the k-th magnitude go to the lowest indices. With fp16
    values, finite values beyond +-65504 saturate."""

    fraction: float = 0.01
    values: str = "fp32"
    name: ClassVar[str] = "topk"
    codec_id: ClassVar[int] = 6
    chunk_multiple: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0.0 < self.fraction <= 1.0):
            raise ValueError(f"topk: fraction must be in (0, 1], got {self.fraction!r}")
        if self.values not in _VALUE_DTYPES:
            raise ValueError(
                f"topk: values must be one of {sorted(_VALUE_DTYPES)}, got {self.values!r}"
            )

    @property
    def spec(self) -> str:
        extra = "" if self.values == "fp32" else f",values={self.values}"
        return f"topk:{self.fraction!r}{extra}"

    def k_for(self, numel: int) -> int:
        """Number of values kept for a tensor of ``numel`` elements."""
        if numel == 0:
            return 0
        return min(numel, max(1, round(self.fraction * numel)))

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        if meta is None:
            k, values = self.k_for(numel), self.values
        else:
            k, values = _meta_int(meta, "k", self.name), str(meta.get("values"))
            if set(meta) != {"k", "values"} or not 0 <= k <= numel or values not in _VALUE_DTYPES:
                _bad_meta(meta, self.name)
        return [(_VALUE_DTYPES[values], k), (np.dtype(np.uint32), k)]

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        t, shape = _flat_f32(name, x)
        n = t.numel()
        if n >= 1 << 32:
            raise ValueError(f"tensor {name!r}: topk indices are uint32, numel {n} is too large")
        t = _range_checked(name, t, FP16_MAX if self.values == "fp16" else math.inf)
        idx = _topk_indices(t, self.k_for(n))
        vals = t[idx].to(torch.float16 if self.values == "fp16" else torch.float32)
        return EncodedTensor(
            name=name,
            shape=shape,
            codec=self.spec,
            meta={"k": int(idx.numel()), "values": self.values},
            buffers=(_to_numpy(vals), _to_numpy(idx.to(torch.int32)).view(np.uint32)),
        )

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        vals = arrays[0].astype(np.float32)
        idx = arrays[1].astype(np.int64)
        if idx.size and (int(idx[-1]) >= numel or not bool(np.all(idx[1:] > idx[:-1]))):
            raise ValueError(
                f"tensor {enc.name!r} ({enc.codec}): indices must be strictly increasing and "
                f"below {numel}"
            )
        _check_decoded(enc, torch.from_numpy(vals))
        out = np.zeros(numel, dtype=np.float32)
        out[idx] = vals
        return out


def _topk_indices(t: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest |t|; ties at the k-th magnitude by lowest index."""
    n = t.numel()
    if k == n:
        return torch.arange(n, device=t.device)
    # Exact pre-filter: a threshold read off a strided sample is valid iff at least k elements
    # reach it (it is then <= the true k-th largest magnitude), and the exact selection runs on
    # those candidates only. When the sample misleads, fall back to every element.
    cand: torch.Tensor | None = None
    stride = n // _TOPK_SAMPLE
    if stride >= 4:
        sample = t[::stride].abs()
        want = min(sample.numel(), int(1.5 * k / stride) + 32)
        thr = float(torch.topk(sample, want, sorted=False).values.min())
        if thr > 0:
            cand = _at_least(t, thr)
            if cand.numel() < k:
                cand = None
    if cand is None:
        cand = torch.arange(n, device=t.device)
    cmag = t[cand].abs()
    kth = torch.topk(cmag, k, sorted=False).values.min()
    above = cmag > kth
    ties = cmag == kth
    # Candidates are in index order, so a running count ranks the ties by index.
    keep = above | (ties & (torch.cumsum(ties, 0) <= k - int(above.sum())))
    return cand[keep]


def _at_least(t: torch.Tensor, thr: float) -> torch.Tensor:
    """Ascending int64 indices where |t| >= thr."""
    if t.device.type != "cpu":
        return torch.nonzero(t.abs() >= thr).squeeze(1)
    # numpy's nonzero is several times faster than torch's on CPU; tiles keep the temporaries
    # in cache.
    arr = t.numpy()
    tile = min(arr.size, _TILE_ELEMS)
    mag = np.empty(tile, dtype=np.float32)
    mask = np.empty(tile, dtype=bool)
    parts = []
    for start in range(0, arr.size, tile):
        m = mask[: min(tile, arr.size - start)]
        np.greater_equal(np.abs(arr[start : start + tile], out=mag[: m.size]), thr, out=m)
        parts.append(np.flatnonzero(m) + start)
    return torch.from_numpy(np.concatenate(parts))


_TOPK_SAMPLE = 1 << 16


# --------------------------------------------------------------------------------------------
# Lossless zstandard stage


def _zstd_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND: the most bytes one zstd frame of ``size`` input bytes can take."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small


_InnerCodec = Fp32Codec | Fp16Codec | Bf16Codec | Int8Codec | Int4Codec | TopKCodec


@dataclass(frozen=True)
class ZstdCodec:
    """Any other codec followed by one zstandard frame per buffer. Lossless over the inner
    codec; the size is data-dependent, so ``encoded_size`` is an upper bound.

    Buffers of multi-byte items are byte-shuffled before compression (all first bytes, then all
    second bytes, ...): exponent and high index bytes then form long similar runs, which zstd
    compresses far better (top-k indices ~1.2x -> ~1.9x, fp16 ~1.09x -> ~1.18x).
    """

    inner: _InnerCodec
    level: int = _DEFAULT_ZSTD_LEVEL
    exact_size: ClassVar[bool] = False
    chunk_multiple: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if not (1 <= self.level <= 22):
            raise ValueError(f"zstd: level must be in [1, 22], got {self.level}")

    @property
    def name(self) -> str:
        return f"{self.inner.name}+zstd"

    @property
    def codec_id(self) -> int:
        return self.inner.codec_id | _ZSTD_FLAG

    @property
    def spec(self) -> str:
        level = "" if self.level == _DEFAULT_ZSTD_LEVEL else f":level={self.level}"
        return f"{self.inner.spec}+zstd{level}"

    def encoded_size(self, numel: int) -> int:
        """Upper bound: the worst-case zstd frame size for each inner buffer."""
        return sum(_zstd_bound(d.itemsize * c) for d, c in self.inner._layout(numel, None))

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        inner = self.inner.encode(name, x)
        cctx = zstandard.ZstdCompressor(level=self.level, write_checksum=False)
        frames = tuple(
            np.frombuffer(cctx.compress(_shuffle(np.asarray(b)).data), dtype=np.uint8)
            for b in inner.buffers
        )
        return EncodedTensor(
            name=name, shape=inner.shape, codec=self.spec, meta=inner.meta, buffers=frames
        )

    def decode(self, enc: EncodedTensor) -> FloatArray:
        _check_family(enc, self.name)
        n = _check_shape(enc)
        layout = self.inner._layout(n, enc.meta)
        _check_buffers(enc, len(layout))
        dctx = zstandard.ZstdDecompressor()
        arrays: list[npt.NDArray[Any]] = []
        for i, (dtype, count) in enumerate(layout):
            want = dtype.itemsize * count
            frame = _read_buffer(enc, i, _U8, _nbytes(enc.buffers[i]))
            try:
                # Refuse a frame that announces a size other than the layout's before zstd
                # allocates it.
                declared = zstandard.frame_content_size(frame.data)
                if declared not in (-1, want):
                    raise ValueError(f"frame declares {declared} bytes, expected {want}")
                data = dctx.decompress(frame.data, max_output_size=want)
            except (zstandard.ZstdError, ValueError) as e:
                raise ValueError(
                    f"tensor {enc.name!r} ({enc.codec}): bad zstd frame in buffer {i}: {e}"
                ) from e
            if len(data) != want:
                raise ValueError(
                    f"tensor {enc.name!r} ({enc.codec}): buffer {i} decompressed to "
                    f"{len(data)} bytes, expected {want}"
                )
            arrays.append(_unshuffle(np.frombuffer(data, dtype=_U8), dtype))
        return self.inner._decode_arrays(enc, n, arrays).reshape(enc.shape)


def _shuffle(arr: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """Bytes of ``arr`` grouped by position within the item (the identity for 1-byte items)."""
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if arr.itemsize == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, arr.itemsize).T).reshape(-1)


def _unshuffle(raw: npt.NDArray[np.uint8], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    if dtype.itemsize == 1:
        return raw.view(dtype)
    return np.ascontiguousarray(raw.reshape(dtype.itemsize, -1).T).reshape(-1).view(dtype)


# --------------------------------------------------------------------------------------------
# Registry and spec strings

CODEC_IDS: dict[str, int] = {
    c.name: c.codec_id for c in (Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, Int4Codec, TopKCodec)
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


def _parse_base(text: str) -> _InnerCodec:
    family, colon, params = text.partition(":")
    positional, keywords = _parse_params(family, params if colon else None)
    if family in ("fp32", "fp16", "bf16"):
        _reject_extra(family, positional, keywords, set())
        return Fp32Codec() if family == "fp32" else Fp16Codec() if family == "fp16" else Bf16Codec()
    if family in ("int8", "int4"):
        _reject_extra(family, positional, keywords, {"block"})
        cls = Int8Codec if family == "int8" else Int4Codec
        if "block" in keywords:
            return cls(block=_int_param(family, "block", keywords["block"]))
        return cls()
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
