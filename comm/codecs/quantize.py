"""Blockwise symmetric absmax quantization: ``int8``, ``int4``, ``int3`` and ternary ``int2``,
one fp16 scale per block.

int4 and int3 pack two values per byte, int2 four. Encoding and ``decode`` on CPU run in tiles of
``base._TILE_ELEMS`` values (torch); range decodes, in-place folds and the sums of squares read
from the codes run in tiles of ``base._RANGE_TILE_ELEMS`` (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from comm.codecs import base
from comm.codecs.base import (
    _F16,
    _MAX_BLOCK,
    FP16_MAX,
    EncodedTensor,
    TensorLike,
    _raise_non_finite,
)
from comm.codecs.plumbing import (
    _F32,
    Layout,
    _bad_meta,
    _Codec,
    _dot,
    _flat_f32,
    _meta_int,
    _new,
    _to_numpy,
    _torch_view,
    _Weighted,
)
from comm.codecs.registry import SpecParams, register_codec

if TYPE_CHECKING:
    import torch

    from comm.codecs.base import FloatArray

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
    import torch

    # Reducing over the transposed view lets torch vectorize across blocks: much faster than a
    # row reduction for short blocks.
    cols = x2d.t()
    absmax = torch.maximum(torch.amax(cols, dim=0), torch.amin(cols, dim=0).neg_())
    if not bool(torch.isfinite(absmax).all()):
        _raise_non_finite(name, x2d, stage="before encoding")
    nonzero = absmax > 0
    scale = absmax.div_(qmax)
    s16 = scale.to(torch.float16)
    # For non-negative halves the next representable value is the next bit pattern. A nonzero
    # block whose absmax / qmax underflows float32 (an fp32 subnormal absmax) rounds up too.
    up = (s16.to(torch.float32) < scale).logical_or_(nonzero.logical_and_(s16 == 0))
    s16.view(torch.int16).add_(up.to(torch.int16))
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
    import torch

    tmp = scratch[: x2d.numel()].view(x2d.shape)
    torch.mul(x2d, inv[:, None], out=tmp)
    return tmp.round_()


def _tile_rows(block: int, nrows: int, device: torch.device) -> int:
    """Rows per tile: cache-sized on CPU, everything at once on an accelerator."""
    if device.type != "cpu":
        return max(nrows, 1)
    return max(1, base._TILE_ELEMS // block)  # read at call time: tests shrink it


def _validate_block(family: str, block: int) -> None:
    if not (1 <= block <= _MAX_BLOCK):
        raise ValueError(f"{family}: block must be in [1, {_MAX_BLOCK}], got {block}")
    if family in ("int4", "int3") and block % 2:
        raise ValueError(f"{family}: block must be even (two values per byte), got {block}")
    if family == "int2" and block % 4:
        raise ValueError(f"int2: block must be a multiple of 4 (four values per byte), got {block}")


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

    @classmethod
    def from_spec(cls, params: SpecParams) -> Self:
        params.allow("block")
        if "block" in params.keywords:
            return cls(block=params.integer("block"))  # type: ignore[call-arg]
        return cls()

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
        import torch

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
        import torch

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
        import torch

        block = _meta_int(enc.meta, "block", self.name)
        values = _torch_view(arrays[0])
        s32 = torch.from_numpy(arrays[1].astype(np.float32))
        # |q| <= qmax and |scale| <= 65504, so the output is finite iff every scale is.
        if not bool(torch.isfinite(s32).all()):
            _raise_non_finite(enc.name, s32, stage="after decoding (in the block scales)")
        out = _new(numel, np.dtype(np.float32), torch.device("cpu"))
        full = numel - numel % block
        per_row = self._value_count(block)
        if full:
            out2d = out[:full].view(-1, block)
            nrows = out2d.shape[0]
            rows = _tile_rows(block, nrows, torch.device("cpu"))
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

    # ---- ranges and norms from the codes, in numpy (one vectorised pass per tile) ----------

    square_lut: ClassVar[npt.NDArray[Any]]
    """Per value byte, the sum of the squares of the codes it holds."""

    def _codes(
        self, values: npt.NDArray[Any], e0: int, e1: int, scratch: npt.NDArray[np.int8]
    ) -> npt.NDArray[np.int8]:
        """The signed codes of elements ``[e0, e1)`` (``e0`` at a block boundary), in
        ``scratch`` (room for whole blocks and a byte's worth more) or a view of their own."""
        raise NotImplementedError

    def _scales(self, enc: EncodedTensor, s16: npt.NDArray[Any]) -> FloatArray:
        """The blocks' fp16 scales as float32; NonFiniteError (as decode raises it) when one is
        NaN or Inf, since |q| <= 128 and |scale| <= 65504 make every other value finite."""
        s32 = s16.astype(np.float32)
        if s32.size and not np.isfinite(s32).all():
            import torch

            _raise_non_finite(enc.name, torch.from_numpy(s32), stage=_SCALES_STAGE)
        return s32

    def _range(
        self,
        enc: EncodedTensor,
        numel: int,
        arrays: list[npt.NDArray[Any]],
        out: FloatArray,
        start: int,
        weight: _Weighted | None,
    ) -> None:
        """Only the blocks covering ``[start, stop)``, a tile of whole blocks at a time: the
        codes unpacked (int8) and multiplied by their block's scale (exactly decode's float32
        product), then copied into ``out`` or scaled by ``weight`` and landed in it."""
        block = _meta_int(enc.meta, "block", self.name)
        stop = start + out.size
        if start == stop:
            return
        b0, b1 = start // block, -(-stop // block)
        values = arrays[0]
        s32 = self._scales(enc, arrays[1][b0:b1])
        rows = max(1, base._RANGE_TILE_ELEMS // block)  # read at call time: tests shrink it
        span = min(rows, b1 - b0) * block
        codes = np.empty(span + 8, dtype=np.int8)
        tile = np.empty(span, dtype=_F32)
        for r0 in range(b0, b1, rows):
            r1 = min(b1, r0 + rows)
            e0, e1 = r0 * block, min(numel, r1 * block)
            q = self._codes(values, e0, e1, codes)
            lo, hi = max(e0, start), min(e1, stop)
            direct = weight is None and lo == e0 and hi == e1
            t = out[e0 - start : e1 - start] if direct else tile[: e1 - e0]
            full = (e1 - e0) // block * block
            s = s32[r0 - b0 : r1 - b0]
            # The codes cast to float32 (exact), then scaled in place: faster than numpy's mixed
            # int8 x float32 multiply, which casts through a buffer of its own.
            np.copyto(t, q)
            if full:
                rows2d = t[:full].reshape(-1, block)
                rows2d *= s[: full // block, None]
            if full < e1 - e0:
                t[full:] *= s[full // block]
            if direct:
                continue
            seg = t[lo - e0 : hi - e0]
            if weight is None:
                out[lo - start : hi - start] = seg
            else:
                weight.land(out[lo - start : hi - start], seg)

    def _sum_squares(self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]) -> float:
        """Σ_b scale_b² · Σ_{i in b} q_i², the per-block sums of squared codes read byte by byte
        from a table (no value decoded). A block's unused trailing codes hold 0."""
        block = _meta_int(enc.meta, "block", self.name)
        values, s32 = arrays[0], self._scales(enc, arrays[1])
        if not numel:
            return 0.0
        per_block = self._value_count(block)
        rows = max(1, base._RANGE_TILE_ELEMS // block)
        lut = self.square_lut
        # A block's sum of squares fits an int32 unless blocks are long (int8's up to 2^20).
        wide = per_block * int(lut.max()) >= 1 << 31
        squares = np.empty(min(rows, s32.size) * per_block, dtype=lut.dtype)
        starts = np.arange(0, squares.size, per_block)
        qsq = np.empty(s32.size, dtype=np.int64 if wide else np.int32)
        for r0 in range(0, s32.size, rows):
            r1 = min(s32.size, r0 + rows)
            chunk = values[r0 * per_block : r1 * per_block].view(np.uint8)
            sq = np.take(lut, chunk, out=squares[: chunk.size])
            np.add.reduceat(sq, starts[: r1 - r0], dtype=qsq.dtype, out=qsq[r0:r1])
        s64 = s32.astype(np.float64)
        return float(_dot(s64 * s64, qsq.astype(np.float64)))


_SCALES_STAGE = "after decoding (in the block scales)"
_BYTES = np.arange(256)


@register_codec
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

    square_lut: ClassVar[npt.NDArray[Any]] = (
        _BYTES.astype(np.uint8).view(np.int8).astype(np.int32) ** 2
    ).astype(np.uint16)

    def _codes(
        self, values: npt.NDArray[Any], e0: int, e1: int, scratch: npt.NDArray[np.int8]
    ) -> npt.NDArray[np.int8]:
        return values[e0:e1]

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


@register_codec
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

    square_lut: ClassVar[npt.NDArray[Any]] = (
        ((_BYTES & 15) - _NIBBLE_BIAS) ** 2 + ((_BYTES >> 4) - _NIBBLE_BIAS) ** 2
    ).astype(np.uint8)

    def _value_count(self, numel: int) -> int:
        return (numel + 1) // 2

    def _codes(
        self, values: npt.NDArray[Any], e0: int, e1: int, scratch: npt.NDArray[np.int8]
    ) -> npt.NDArray[np.int8]:
        packed = values[e0 // 2 : (e1 + 1) // 2]
        pairs = scratch[: 2 * packed.size].view(np.uint8).reshape(-1, 2)
        np.bitwise_and(packed, 15, out=pairs[:, 0])
        np.right_shift(packed, 4, out=pairs[:, 1])
        q = scratch[: e1 - e0]
        q -= _NIBBLE_BIAS
        return q

    def _pack_tile(self, q2d: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
        import torch

        pairs = q2d.view(-1, 2)
        # (lo + 8) + 16 * (hi + 8) is exact in float32, then one cast to uint8.
        sums = work[: pairs.shape[0]]
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=sums)
        sums.add_(_NIBBLE_BIAS * 17)
        out.copy_(sums)

    def _unpack_tile(
        self, values: torch.Tensor, s32: torch.Tensor, out2d: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        import torch

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


@register_codec
@dataclass(frozen=True)
class Int3Codec(Int4Codec):
    """Symmetric 3-bit codes per block of ``block`` values: q = round(x / s) in [-3, 3],
    s = absmax / 3 stored as fp16, in int4's nibble layout. Alone it is as large as int4; its
    seven levels are what a ``+zstd`` stage entropy-codes to about 2.5 bits a value."""

    name: ClassVar[str] = "int3"
    codec_id: ClassVar[int] = 8
    qmax: ClassVar[float] = 3.0


# Crumb layout: element 4i + k in bits 2k..2k+1 of byte i, stored as q + 1 (0, 1 or 2; 1 is
# zero). A tail's unused crumbs hold 1.
_CRUMB_WEIGHTS = (1.0, 4.0, 16.0, 64.0)


@register_codec
@dataclass(frozen=True)
class Int2Codec(_BlockCodec):
    """Ternary per block of ``block`` values: q = round(x / s) in {-1, 0, 1}, s = absmax
    stored as fp16, packed four values per byte. Values below half the block's absmax become 0
    (error feedback carries them to a later sync), so most crumbs are 1 and a ``+zstd`` stage
    entropy-codes them to about one bit per value."""

    block: int = 64
    name: ClassVar[str] = "int2"
    codec_id: ClassVar[int] = 7
    qmax: ClassVar[float] = 1.0
    default_block: ClassVar[int] = 64
    value_dtype: ClassVar[np.dtype[Any]] = np.dtype(np.uint8)

    square_lut: ClassVar[npt.NDArray[Any]] = np.sum(
        [(((_BYTES >> (2 * k)) & 3) - 1) ** 2 for k in range(4)], axis=0
    ).astype(np.uint8)

    def _value_count(self, numel: int) -> int:
        return (numel + 3) // 4

    def _codes(
        self, values: npt.NDArray[Any], e0: int, e1: int, scratch: npt.NDArray[np.int8]
    ) -> npt.NDArray[np.int8]:
        packed = values[e0 // 4 : (e1 + 3) // 4]
        quads = scratch[: 4 * packed.size].view(np.uint8).reshape(-1, 4)
        np.bitwise_and(packed, 3, out=quads[:, 0])
        for k in (1, 2, 3):
            np.right_shift(packed, 2 * k, out=quads[:, k])
            if k < 3:
                quads[:, k] &= 3
        q = scratch[: e1 - e0]
        q -= 1
        return q

    def _pack_tile(self, q2d: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
        import torch

        quads = q2d.view(-1, 4)
        # Σ (q_k + 1) 4^k is at most 170: exact in float32, then one cast to uint8.
        sums = work[: quads.shape[0]]
        torch.add(quads[:, 0], quads[:, 1], alpha=_CRUMB_WEIGHTS[1], out=sums)
        sums.add_(quads[:, 2], alpha=_CRUMB_WEIGHTS[2]).add_(quads[:, 3], alpha=_CRUMB_WEIGHTS[3])
        sums.add_(sum(_CRUMB_WEIGHTS))
        out.copy_(sums)

    def _unpack_tile(
        self, values: torch.Tensor, s32: torch.Tensor, out2d: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        import torch

        wide = scratch[: values.numel()]
        wide.copy_(values)
        crumbs = torch.stack(
            [wide & 3, (wide >> 2) & 3, (wide >> 4) & 3, wide >> 6], dim=1
        )  # byte i's four values, in element order
        out2d.copy_(crumbs.view(out2d.shape))
        out2d.sub_(1).mul_(s32[:, None])
