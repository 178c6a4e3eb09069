"""Array plumbing and the codec skeleton shared by every codec family.

Fresh and zero-copy arrays, buffer reads checked against the sizes a ``meta`` implies, the
validation order of ``decode`` (family, shape, meta, buffer count and sizes) before any array is
allocated, and :class:`_Codec`, the base of the concrete codecs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import numpy as np
import numpy.typing as npt

from comm.codecs import base
from comm.codecs.base import (
    EncodedTensor,
    FloatArray,
    NonFiniteError,
    TensorLike,
    _raise_non_finite,
)

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------------------------
# Array plumbing


def _torch_view(arr: npt.NDArray[Any]) -> torch.Tensor:
    """A torch tensor over ``arr``'s memory, copying only when torch cannot share it."""
    import torch

    if not (arr.flags.c_contiguous and arr.flags.aligned and arr.flags.writeable):
        # Read-only (e.g. a received frame) or unaligned memory: torch cannot wrap it safely.
        arr = np.array(arr, order="C", copy=True)
    return torch.from_numpy(arr)


def _new(numel: int, dtype: np.dtype[Any], device: torch.device) -> torch.Tensor:
    """A fresh uninitialized 1-D tensor. On CPU it is numpy-allocated, which asks the kernel for
    huge pages on large arrays: page faults otherwise cost more than the codec math."""
    import torch

    if device.type == "cpu":
        return torch.from_numpy(np.empty(numel, dtype=dtype))
    tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return torch.empty(numel, dtype=tdtype, device=device)


def _to_numpy(t: torch.Tensor) -> npt.NDArray[Any]:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _flat_f32(name: str, x: TensorLike) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` as a flat contiguous float32 torch tensor (no copy when it already is one)."""
    import torch

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
    import torch

    if out.numel():
        lo, hi = torch.aminmax(out)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            _raise_non_finite(enc.name, out, stage="after decoding")


def _range_checked(name: str, t: torch.Tensor, limit: float) -> torch.Tensor:
    """Reject NaN/Inf; saturate finite values beyond +-``limit`` (a copy only when needed)."""
    import torch

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
# Ranges, in place: decode elements [start, stop) into a given array, or add them weighted

_F32 = np.dtype(np.float32)


def _out_view(enc: EncodedTensor, out: Any) -> FloatArray:
    """``out`` as a flat view: a writable C-contiguous float32 array, or ValueError."""
    if not (
        isinstance(out, np.ndarray)
        and out.dtype == _F32
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        what = f"{out.dtype} array" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(
            f"tensor {enc.name!r}: the output must be a writable C-contiguous float32 array, "
            f"got a {what}"
        )
    return out.reshape(-1)


def _check_range(enc: EncodedTensor, numel: int, start: Any, count: int) -> int:
    """``start`` as an int, when ``[start, start + count)`` lies within ``numel`` elements."""
    if isinstance(start, bool) or not isinstance(start, int | np.integer):
        raise ValueError(f"tensor {enc.name!r}: start must be an integer, got {start!r}")
    at = int(start)
    if at < 0 or at + count > numel:
        raise ValueError(
            f"tensor {enc.name!r}: elements [{at}, {at + count}) lie outside its {numel} elements"
        )
    return at


_ZERO = np.float32(0.0)


@dataclass(frozen=True)
class _Weighted:
    """How weighted values land in ``out``: added (``out += weight * x``), or, where ``out``
    holds nothing yet (``fresh``), written as ``0 + weight * x`` without reading ``out``: bit for
    bit what adding into zeros gives (a -0 product becomes +0 there too)."""

    weight: np.float32
    fresh: bool = False

    def land(self, dst: FloatArray, tile: FloatArray) -> None:
        """``dst`` (=|+=) weight * ``tile``, in float32; ``tile`` is scratch, scaled in place."""
        tile *= self.weight
        if self.fresh:
            np.add(tile, _ZERO, out=dst)
        else:
            dst += tile


def _check_weight(enc: EncodedTensor, weight: Any, fresh: bool) -> _Weighted:
    w = float(weight)
    if not math.isfinite(w) or abs(w) > float(np.finfo(np.float32).max):
        raise ValueError(f"tensor {enc.name!r}: weight must be a finite float32, got {weight!r}")
    return _Weighted(np.float32(w), bool(fresh))


def _put(out: FloatArray, values: FloatArray, weight: _Weighted | None) -> None:
    """``out = values``, or ``weight`` times them landed in it (tile by tile)."""
    if weight is None:
        np.copyto(out, values)
        return
    step = base._RANGE_TILE_ELEMS
    tile = np.empty(min(step, out.size), dtype=_F32)
    for a in range(0, out.size, step):
        t = tile[: min(step, out.size - a)]
        np.copyto(t, values[a : a + t.size])
        weight.land(out[a : a + t.size], t)


def _tiled(
    out: FloatArray,
    start: int,
    weight: _Weighted | None,
    convert: Callable[[int, FloatArray], None],
) -> None:
    """Elementwise range work: ``convert(at, dst)`` writes decoded elements ``[at, at +
    dst.size)`` into ``dst``; they land in ``out`` (its element 0 is element ``start``), or
    ``weight`` times them does, one bounded tile at a time."""
    step = base._RANGE_TILE_ELEMS  # read at call time: tests shrink it
    if weight is None:
        for a in range(0, out.size, step):
            convert(start + a, out[a : a + step])
        return
    tile = np.empty(min(step, out.size), dtype=_F32)
    for a in range(0, out.size, step):
        t = tile[: min(step, out.size - a)]
        convert(start + a, t)
        weight.land(out[a : a + t.size], t)


def _sparse_into(
    out: FloatArray,
    start: int,
    idx: npt.NDArray[np.int64],
    vals: FloatArray,
    weight: _Weighted | None,
) -> None:
    """A sparse tensor's (ascending unique ``idx``, ``vals``) elements ``[start, start +
    out.size)`` into ``out``, or ``weight`` times them landed in it."""
    lo, hi = np.searchsorted(idx, [start, start + out.size])
    at, v = idx[lo:hi] - start, vals[lo:hi]
    if weight is None or weight.fresh:
        out.fill(0.0)
    if weight is None:
        out[at] = v
    else:
        out[at] += v * weight.weight


def _dot(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> Any:
    """Σ a·b in one vectorised pass, without BLAS: ``np.dot`` may hand a large vector to a
    thread pool, whose threads spin on a busy host and charge CPU time for nothing."""
    return np.einsum("i,i->", a, b)


def _sum_squares_tiled(
    name: str,
    numel: int,
    tile_of: Callable[[int, FloatArray], FloatArray],
    stage: str = "after decoding",
) -> float:
    """Σ x² in float64 over ``numel`` decoded values that ``tile_of(at, scratch)`` hands out a
    tile at a time (values ``[at, at + scratch.size)``, in ``scratch`` or a view of its own);
    NonFiniteError, counting the NaN and Inf of every tile, when one is not finite."""
    step = base._RANGE_TILE_ELEMS  # read at call time: tests shrink it
    scratch = np.empty(min(step, numel), dtype=_F32)
    total = 0.0
    for a in range(0, numel, step):
        t = tile_of(a, scratch[: min(step, numel - a)])
        with np.errstate(over="ignore"):
            part = float(_dot(t, t))
        if not math.isfinite(part):
            if not np.isfinite(t).all():
                nan = inf = 0
                for b in range(0, numel, step):
                    u = tile_of(b, scratch[: min(step, numel - b)])
                    nan += int(np.isnan(u).sum())
                    inf += int(np.isinf(u).sum())
                raise NonFiniteError(name, f"has non-finite values {stage} ({nan} NaN, {inf} Inf)")
            wide = t.astype(np.float64)  # squares beyond float32's range
            part = float(_dot(wide, wide))
        total += part
    return total


def _sum_squares_f32(name: str, values: FloatArray) -> float:
    """Σ x² of float32 values in float64 (NonFiniteError when one is NaN or Inf)."""
    flat = values.reshape(-1)
    return _sum_squares_tiled(name, flat.size, lambda at, t: flat[at : at + t.size])


def _check_finite_out(enc: EncodedTensor, out: FloatArray) -> None:
    """NonFiniteError naming ``enc`` when the decoded values in ``out`` are not all finite."""
    if out.size and not (math.isfinite(float(out.min())) and math.isfinite(float(out.max()))):
        _raise_non_finite_np(enc.name, out, "after decoding")


def _raise_non_finite_np(name: str, values: npt.NDArray[Any], stage: str) -> NoReturn:
    """NonFiniteError naming ``name`` and counting the NaN and Inf of ``values``."""
    flat = values.reshape(-1)
    nan = inf = 0
    step = base._RANGE_TILE_ELEMS
    for a in range(0, flat.size, step):
        t = flat[a : a + step]
        nan += int(np.isnan(t).sum())
        inf += int(np.isinf(t).sum())
    raise NonFiniteError(name, f"has non-finite values {stage} ({nan} NaN, {inf} Inf)")


# --------------------------------------------------------------------------------------------
# Codec skeleton

Layout = list[tuple[np.dtype[Any], int]]
"""Per buffer: (dtype, item count)."""


class _Codec:
    """What every codec shares: size from the layout, and decode's validation order (family,
    shape, meta, buffer count and sizes) before any array is allocated."""

    name: ClassVar[str]
    exact_size: ClassVar[bool] = True
    codec_id: ClassVar[int]
    no_stage_because: ClassVar[str] = ""
    """Empty: the ``+zstd`` stage may follow this codec (``comm.codecs.registry``)."""

    @property
    def spec(self) -> str:
        raise NotImplementedError

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        raise NotImplementedError

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        """Buffer layout for ``numel`` elements: from this codec's parameters when ``meta`` is
        None, else from a received ``meta`` (validated, ``ValueError`` when malformed)."""
        raise NotImplementedError

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        """Flat float32 result from buffers already checked against ``_layout``."""
        raise NotImplementedError

    def _range(
        self,
        enc: EncodedTensor,
        numel: int,
        arrays: list[npt.NDArray[Any]],
        out: FloatArray,
        start: int,
        weight: _Weighted | None,
    ) -> None:
        """Decoded elements ``[start, start + out.size)`` into the flat ``out`` (range already
        checked), or ``weight`` times them landed in it. This fallback decodes the whole tensor;
        the dense codecs decode only the blocks covering the range, tile by tile."""
        _put(out, self._decode_arrays(enc, numel, arrays)[start : start + out.size], weight)

    def _sum_squares(self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]) -> float:
        """Σ x² over the decoded tensor, NonFiniteError when it is not finite. This fallback
        decodes the whole tensor; the dense codecs read the encoded values instead."""
        return _sum_squares_f32(enc.name, self._decode_arrays(enc, numel, arrays))

    def _arrays(self, enc: EncodedTensor) -> tuple[int, list[npt.NDArray[Any]]]:
        """numel and the buffers as the layout's arrays, checked (no value is decoded)."""
        _check_family(enc, self.name)
        n = _check_shape(enc)
        layout = self._layout(n, enc.meta)
        _check_buffers(enc, len(layout))
        return n, [_read_buffer(enc, i, d, c) for i, (d, c) in enumerate(layout)]

    def encoded_size(self, numel: int) -> int:
        return sum(d.itemsize * c for d, c in self._layout(numel, None))

    def decode(self, enc: EncodedTensor) -> FloatArray:
        n, arrays = self._arrays(enc)
        return self._decode_arrays(enc, n, arrays).reshape(enc.shape)

    def decode_into(self, enc: EncodedTensor, out: FloatArray, start: int = 0) -> None:
        n, arrays = self._arrays(enc)
        flat = _out_view(enc, out)
        self._range(enc, n, arrays, flat, _check_range(enc, n, start, flat.size), None)

    def accumulate(
        self,
        enc: EncodedTensor,
        out: FloatArray,
        weight: float,
        start: int = 0,
        *,
        fresh: bool = False,
    ) -> None:
        n, arrays = self._arrays(enc)
        flat = _out_view(enc, out)
        w = _check_weight(enc, weight, fresh)
        self._range(enc, n, arrays, flat, _check_range(enc, n, start, flat.size), w)

    def sum_squares(self, enc: EncodedTensor) -> float:
        n, arrays = self._arrays(enc)
        return self._sum_squares(enc, n, arrays)


def _bad_meta(meta: dict[str, Any], family: str) -> NoReturn:
    raise ValueError(f"{family}: bad meta {meta!r}")


def _meta_int(meta: dict[str, Any], key: str, family: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        _bad_meta(meta, family)
    return value
