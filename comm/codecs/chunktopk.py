"""Chunk-wise top-k with 1- or 2-bit values and entropy-coded positions (SparseLoCo's uplink).

The flat tensor is cut into chunks of ``chunk`` values; each chunk keeps its ``k`` largest
magnitudes (a short last chunk as many as the same density gives, at least one). A kept value is a sign bit and ``bits - 1`` magnitude bits: its magnitude is
quantized uniformly between the smallest and largest kept magnitude of its chunk (stored as a
pair of fp16 scales, the low one rounded down and the high one rounded up, so nothing is
clamped), and decodes to the centre of its cell. The positions (ascending) travel in whichever
of three forms is smallest for this tensor: Rice-coded gaps, a zstd-compressed bitmap, or the
raw bitmap. The raw bitmap bounds the size, so ``encoded_size`` is an upper bound.

Error bound per kept value: half a cell, ``(hi - lo) / 2^bits`` with ``lo``/``hi`` the stored
scales of its chunk; a dropped value's error is itself (error feedback carries it).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import zstandard

from comm.codecs.base import FP16_MAX, EncodedTensor, FloatArray, TensorLike
from comm.codecs.plumbing import (
    _bad_meta,
    _check_buffers,
    _check_decoded,
    _check_family,
    _check_range,
    _check_shape,
    _check_weight,
    _flat_f32,
    _meta_int,
    _out_view,
    _range_checked,
    _read_buffer,
    _sparse_into,
    _sum_squares_f32,
)
from comm.codecs.registry import SpecParams, register_codec

_POSITION_FORMS = ("rice", "zbitmap", "bitmap")
_ZSTD_LEVEL = 9
"""Level 9: 11 bits a position on a 1.56% bitmap against 12.3 at level 3, in 20 ms per MiB of
values; level 19 reaches 9.6 at ten times the time, and Rice-coded gaps take 7.5 anyway."""
_F16 = np.dtype(np.float16)
_U8 = np.dtype(np.uint8)


@register_codec
@dataclass(frozen=True)
class ChunkTopKCodec:
    """Top ``k`` magnitudes of every chunk of ``chunk`` values, ``bits`` bits per kept value."""

    chunk: int = 4096
    k: int = 64
    bits: int = 2
    name: ClassVar[str] = "chunktopk"
    codec_id: ClassVar[int] = 9
    exact_size: ClassVar[bool] = False
    chunk_multiple: ClassVar[int] = 0
    no_stage_because: ClassVar[str] = "chunktopk entropy-codes its own positions"

    @classmethod
    def from_spec(cls, params: SpecParams) -> ChunkTopKCodec:
        """``chunktopk[:chunk=C,k=K,bits=B]``."""
        params.allow("chunk", "k", "bits")
        return cls(**{key: params.integer(key) for key in params.keywords})

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= 1 << 20:
            raise ValueError(f"chunktopk: chunk must be in [1, 2^20], got {self.chunk}")
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"chunktopk: k must be in [1, chunk={self.chunk}], got {self.k}")
        if self.bits not in (1, 2):
            raise ValueError(f"chunktopk: bits must be 1 or 2, got {self.bits}")

    @property
    def spec(self) -> str:
        params = [
            f"{key}={value}"
            for key, value, default in (
                ("chunk", self.chunk, 4096),
                ("k", self.k, 64),
                ("bits", self.bits, 2),
            )
            if value != default
        ]
        return self.name + (":" + ",".join(params) if params else "")

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def picks(self, numel: int, chunk: int | None = None, k: int | None = None) -> int:
        """Values kept for ``numel`` elements: ``k`` per full chunk, and the same density in a
        short last chunk (at least one value)."""
        c, kk = chunk or self.chunk, k or self.k
        full, tail = divmod(numel, c)
        return full * kk + (_tail_picks(kk, c, tail) if tail else 0)

    def encoded_size(self, numel: int) -> int:
        """Upper bound: positions at most the raw bitmap, values and scales exact."""
        return (
            _values_bytes(self.picks(numel), self.bits)
            + 4 * -(-numel // self.chunk)
            + (-(-numel // 8))
        )

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        import torch

        t, shape = _flat_f32(name, x)
        # fp16 scales: a magnitude beyond 65504 cannot be scaled; error feedback keeps the rest.
        t = _range_checked(name, t, FP16_MAX).cpu()
        n = int(t.numel())
        c = self.chunk
        if n == 0:
            return self._encoded(name, shape, "bitmap", 0, [], np.zeros(0, _U8), np.zeros(0, _F16))
        full, tail = divmod(n, c)
        # (first chunk index, chunks as rows, values kept per row): the full chunks, the tail.
        parts = [(0, t[: full * c].view(full, c), self.k)] if full else []
        if tail:
            parts.append((full, t[full * c :].view(1, tail), _tail_picks(self.k, c, tail)))
        pos_parts, val_parts = [], []
        for start_row, row, kk in parts:
            idx = torch.topk(row.abs(), kk, dim=1, sorted=False).indices.sort(dim=1).values
            val_parts.append(torch.gather(row, 1, idx).numpy())
            offs = (torch.arange(row.shape[0]) + start_row).unsqueeze(1) * c
            pos_parts.append((idx + offs).numpy().astype(np.int64).reshape(-1))
        pos = np.concatenate(pos_parts)
        lo = np.concatenate([np.abs(v).min(axis=1) for v in val_parts]).astype(np.float32)
        hi = np.concatenate([np.abs(v).max(axis=1) for v in val_parts]).astype(np.float32)
        vals = np.concatenate([v.reshape(-1) for v in val_parts])
        signs = vals < 0
        mag = np.abs(vals)
        scales = np.stack([_round_f16(lo, down=True), _round_f16(hi, down=False)], axis=1)
        lo32, hi32 = scales[:, 0].astype(np.float32), scales[:, 1].astype(np.float32)
        levels = 1 << (self.bits - 1)
        step = (hi32 - lo32) / np.float32(levels)
        chunk_of = pos // c
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.floor((mag - lo32[chunk_of]) / step[chunk_of])
        level = np.clip(np.nan_to_num(level, nan=0.0, posinf=0.0), 0, levels - 1).astype(np.uint8)
        codes = (signs.astype(np.uint8) << (self.bits - 1)) | level
        values = _pack_codes(codes, self.bits)
        form, r, positions = _encode_positions(pos, n)
        return self._encoded(name, shape, form, r, [positions], values, scales.reshape(-1))

    def _encoded(
        self,
        name: str,
        shape: tuple[int, ...],
        form: str,
        r: int,
        positions: list[npt.NDArray[np.uint8]],
        values: npt.NDArray[np.uint8],
        scales: npt.NDArray[np.float16],
    ) -> EncodedTensor:
        pos_buf = positions[0] if positions else np.zeros(0, _U8)
        return EncodedTensor(
            name=name,
            shape=shape,
            codec=self.spec,
            meta={
                "chunk": self.chunk,
                "k": self.k,
                "bits": self.bits,
                "positions": form,
                "rice": r,
            },
            buffers=(pos_buf, values, np.ascontiguousarray(scales, dtype=_F16)),
        )

    def decode(self, enc: EncodedTensor) -> FloatArray:
        n, pos, vals = self._sparse(enc)
        out = np.zeros(n, dtype=np.float32)
        out[pos] = vals
        return out.reshape(enc.shape)

    def decode_into(self, enc: EncodedTensor, out: FloatArray, start: int = 0) -> None:
        n, pos, vals = self._sparse(enc)
        flat = _out_view(enc, out)
        _sparse_into(flat, _check_range(enc, n, start, flat.size), pos, vals, None)

    def accumulate(
        self,
        enc: EncodedTensor,
        out: FloatArray,
        weight: float,
        start: int = 0,
        *,
        fresh: bool = False,
    ) -> None:
        n, pos, vals = self._sparse(enc)
        flat = _out_view(enc, out)
        w = _check_weight(enc, weight, fresh)
        _sparse_into(flat, _check_range(enc, n, start, flat.size), pos, vals, w)

    def sum_squares(self, enc: EncodedTensor) -> float:
        return _sum_squares_f32(enc.name, self._sparse(enc)[2])

    def _sparse(self, enc: EncodedTensor) -> tuple[int, npt.NDArray[np.int64], FloatArray]:
        """numel, and the kept positions (ascending) and values, checked and finite."""
        _check_family(enc, self.name)
        n = _check_shape(enc)
        meta = enc.meta
        c, kk, bits, r = (_meta_int(meta, key, self.name) for key in ("chunk", "k", "bits", "rice"))
        form = meta.get("positions")
        if (
            set(meta) != {"chunk", "k", "bits", "positions", "rice"}
            or not 1 <= c <= 1 << 20
            or not 1 <= kk <= c
            or bits not in (1, 2)
            or form not in _POSITION_FORMS
            or not 0 <= r <= 24
        ):
            _bad_meta(meta, self.name)
        _check_buffers(enc, 3)
        nchunks = -(-n // c)
        total = self.picks(n, c, kk)
        values = _read_buffer(enc, 1, _U8, _values_bytes(total, bits))
        scales = _read_buffer(enc, 2, _F16, 2 * nchunks).reshape(nchunks, 2).astype(np.float32)
        pos = _decode_positions(enc, str(form), r, n, total)
        counts = np.bincount(pos // c, minlength=nchunks) if total else np.zeros(nchunks, np.int64)
        want = np.full(nchunks, kk, dtype=np.int64)
        if n % c:
            want[-1] = _tail_picks(kk, c, n % c)
        if not np.array_equal(counts, want):
            raise ValueError(
                f"tensor {enc.name!r} ({enc.codec}): positions do not hold k per chunk"
            )
        if np.any(scales[:, 1] < scales[:, 0]) or np.any(scales[:, 0] < 0):
            raise ValueError(f"tensor {enc.name!r} ({enc.codec}): bad scales")
        codes = _unpack_codes(values, bits, total)
        levels = 1 << (bits - 1)
        chunk_of = pos // c
        lo, hi = scales[chunk_of, 0], scales[chunk_of, 1]
        step = (hi - lo) / np.float32(levels)
        level = (codes & (levels - 1)).astype(np.float32)
        mag = lo + (level + np.float32(0.5)) * step
        sign = np.where(codes >> (bits - 1), np.float32(-1.0), np.float32(1.0))
        vals = (sign * mag).astype(np.float32)
        import torch

        _check_decoded(enc, torch.from_numpy(vals))
        return n, pos.astype(np.int64, copy=False), vals


def _tail_picks(k: int, chunk: int, tail: int) -> int:
    """Values kept in a last chunk of ``tail`` < ``chunk`` values: the full chunks' density.
    Small tensors (biases, norms) are one short chunk each, and ``min(k, len)`` would send half
    of a 128-value bias."""
    return min(tail, max(1, round(k * tail / chunk)))


def _values_bytes(picks: int, bits: int) -> int:
    return -(-picks * bits // 8)


def _round_f16(x: npt.NDArray[np.float32], *, down: bool) -> npt.NDArray[np.float16]:
    """``x`` in fp16, rounded toward -inf (``down``) or +inf, so the stored scales enclose it."""
    h = x.astype(np.float16)
    back = h.astype(np.float32)
    fix = back > x if down else back < x
    h[fix] = np.nextafter(h[fix], np.float16(-np.inf if down else np.inf))
    return np.maximum(h, np.float16(0))


def _pack_codes(codes: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint8]:
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint8)
    return np.packbits(((codes[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1))


def _unpack_codes(buf: npt.NDArray[np.uint8], bits: int, count: int) -> npt.NDArray[np.uint8]:
    flat = np.unpackbits(buf)[: count * bits].reshape(count, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint8)
    out: npt.NDArray[np.uint8] = (flat * weights).sum(axis=1).astype(np.uint8)
    return out


# --------------------------------------------------------------------------------------------
# Positions: Rice-coded gaps, a zstd bitmap or the raw bitmap, whichever is smallest


def _rice_bits(gaps: npt.NDArray[np.int64], r: int) -> int:
    return int((gaps >> r).sum()) + gaps.size * (1 + r)


def _rice_encode(gaps: npt.NDArray[np.int64], r: int) -> npt.NDArray[np.uint8]:
    """Each gap g as (g >> r) zeros, a one, then the low r bits of g, most significant first."""
    q = gaps >> r
    lengths = q + 1 + r
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    bits = np.zeros(int(lengths.sum()), dtype=np.uint8)
    stop = starts + q
    bits[stop] = 1
    for j in range(r):
        bits[stop + 1 + j] = (gaps >> (r - 1 - j)) & 1
    return np.packbits(bits)


def _rice_decode(buf: npt.NDArray[np.uint8], r: int, count: int) -> npt.NDArray[np.int64]:
    bits = np.unpackbits(buf).astype(np.int64)
    nbits = bits.size
    # The value of the r bits starting at every index, so the loop reads a remainder in one step.
    tail = np.concatenate([bits, np.zeros(r, dtype=np.int64)])
    rem = np.zeros(nbits + 1, dtype=np.int64)
    for j in range(r):
        rem[:nbits] = (rem[:nbits] << 1) | tail[j : j + nbits]
    ones = np.flatnonzero(bits).tolist()
    rem_list = rem.tolist()
    gaps = []
    start = 0
    for _ in range(count):
        i = bisect_left(ones, start)
        if i == len(ones) or ones[i] + 1 + r > nbits:
            raise ValueError("chunktopk: truncated Rice-coded positions")
        stop = ones[i]
        gaps.append(((stop - start) << r) | rem_list[stop + 1])
        start = stop + 1 + r
    if -(-start // 8) != buf.size:
        raise ValueError("chunktopk: trailing bytes after the Rice-coded positions")
    return np.asarray(gaps, dtype=np.int64)


def _encode_positions(pos: npt.NDArray[np.int64], n: int) -> tuple[str, int, npt.NDArray[np.uint8]]:
    """The smallest of the three forms for ascending ``pos``: (form, Rice parameter, bytes)."""
    bitmap = np.zeros(n, dtype=np.uint8)
    bitmap[pos] = 1
    raw = np.packbits(bitmap)
    best: tuple[str, int, npt.NDArray[np.uint8]] = ("bitmap", 0, raw)
    z = np.frombuffer(zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw.tobytes()), _U8)
    if z.size < best[2].size:
        best = ("zbitmap", 0, z.copy())
    if pos.size:
        gaps = np.diff(pos, prepend=-1) - 1
        r = min(range(0, 21), key=lambda rr: _rice_bits(gaps, rr))
        if -(-_rice_bits(gaps, r) // 8) < best[2].size:
            best = ("rice", r, _rice_encode(gaps, r))
    return best


def _decode_positions(
    enc: EncodedTensor, form: str, r: int, n: int, total: int
) -> npt.NDArray[np.int64]:
    buf: Any = enc.buffers[0]
    raw = (
        np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        if isinstance(buf, np.ndarray)
        else np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    )
    if form == "rice":
        gaps = _rice_decode(raw, r, total)
        pos = np.cumsum(gaps + 1) - 1
    else:
        if form == "zbitmap":
            want = -(-n // 8)
            try:
                size = zstandard.frame_content_size(raw.tobytes())
                if size == want:
                    data = zstandard.ZstdDecompressor().decompress(
                        raw.tobytes(), max_output_size=want
                    )
            except zstandard.ZstdError:
                raise ValueError(f"tensor {enc.name!r}: bad zstd frame for positions") from None
            if size != want:
                raise ValueError(f"tensor {enc.name!r}: position bitmap of the wrong size")
            raw = np.frombuffer(data, _U8)
        if raw.size != -(-n // 8):
            raise ValueError(f"tensor {enc.name!r}: position bitmap of the wrong size")
        pos = np.flatnonzero(np.unpackbits(raw)[:n]).astype(np.int64)
        if np.unpackbits(raw)[n:].any():
            raise ValueError(f"tensor {enc.name!r}: position bitmap has bits past the end")
    if pos.size != total or (pos.size and (pos[0] < 0 or pos[-1] >= n)):
        raise ValueError(f"tensor {enc.name!r}: {pos.size} positions, expected {total} below {n}")
    return pos
