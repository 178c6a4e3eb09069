"""Top-k sparsification: the ``round(F * numel)`` largest magnitudes with uint32 indices."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from comm.codecs import base
from comm.codecs.base import FP16_MAX, EncodedTensor, TensorLike
from comm.codecs.plumbing import (
    Layout,
    _bad_meta,
    _check_decoded,
    _Codec,
    _flat_f32,
    _meta_int,
    _range_checked,
    _sparse_into,
    _sum_squares_f32,
    _to_numpy,
    _Weighted,
)
from comm.codecs.registry import SpecParams, register_codec

if TYPE_CHECKING:
    import torch

    from comm.codecs.base import FloatArray

# --------------------------------------------------------------------------------------------
# Top-k sparsification


MAX_NUMEL = (1 << 32) - 1
"""The most elements a topk tensor may have: its indices are uint32."""
_VALUE_DTYPES: dict[str, np.dtype[Any]] = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
}


@register_codec
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

    @classmethod
    def from_spec(cls, params: SpecParams) -> TopKCodec:
        """``topk:F[,values=V]`` or ``topk:k=F[,values=V]``."""
        if len(params.positional) > 1 or (params.positional and "k" in params.keywords):
            raise ValueError(f"topk: give the fraction once, got {params.text!r}")
        params.allow("k", "values", positional=True)
        raw = params.positional[0] if params.positional else params.keywords.get("k")
        if raw is None:
            raise ValueError("topk: missing the fraction of values to keep, e.g. 'topk:0.01'")
        try:
            fraction = float(raw)
        except ValueError:
            raise ValueError(f"topk: fraction must be a number, got {raw!r}") from None
        return cls(fraction=fraction, values=params.keywords.get("values", "fp32"))

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
            if numel > MAX_NUMEL:
                # Beyond what uint32 indices address (encode refuses it too); a few received
                # bytes must not make the decoder allocate a tensor of any size.
                raise ValueError(f"topk: {numel} elements, indices address at most {MAX_NUMEL}")
        return [(_VALUE_DTYPES[values], k), (np.dtype(np.uint32), k)]

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        import torch

        t, shape = _flat_f32(name, x)
        n = t.numel()
        if n > MAX_NUMEL:
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

    def _sparse(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> tuple[npt.NDArray[np.int64], FloatArray]:
        """The kept (indices, values), checked: indices strictly increasing and below
        ``numel``, values finite."""
        import torch

        vals = arrays[0].astype(np.float32)
        idx = arrays[1].astype(np.int64)
        if idx.size and (int(idx[-1]) >= numel or not bool(np.all(idx[1:] > idx[:-1]))):
            raise ValueError(
                f"tensor {enc.name!r} ({enc.codec}): indices must be strictly increasing and "
                f"below {numel}"
            )
        _check_decoded(enc, torch.from_numpy(vals))
        return idx, vals

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        idx, vals = self._sparse(enc, numel, arrays)
        out = np.zeros(numel, dtype=np.float32)
        out[idx] = vals
        return out

    def _range(
        self,
        enc: EncodedTensor,
        numel: int,
        arrays: list[npt.NDArray[Any]],
        out: FloatArray,
        start: int,
        weight: _Weighted | None,
    ) -> None:
        """The kept values in the range, found by bisection: nothing of size ``numel``."""
        idx, vals = self._sparse(enc, numel, arrays)
        _sparse_into(out, start, idx, vals, weight)

    def _sum_squares(self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]) -> float:
        return _sum_squares_f32(enc.name, self._sparse(enc, numel, arrays)[1])


def _topk_indices(t: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest |t|; ties at the k-th magnitude by lowest index."""
    import torch

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
    import torch

    if t.device.type != "cpu":
        return torch.nonzero(t.abs() >= thr).squeeze(1)
    # numpy's nonzero is several times faster than torch's on CPU; tiles keep the temporaries
    # in cache.
    arr = t.numpy()
    tile = min(arr.size, base._TILE_ELEMS)  # read at call time: tests shrink it
    mag = np.empty(tile, dtype=np.float32)
    mask = np.empty(tile, dtype=bool)
    parts = []
    for start in range(0, arr.size, tile):
        m = mask[: min(tile, arr.size - start)]
        np.greater_equal(np.abs(arr[start : start + tile], out=mag[: m.size]), thr, out=m)
        parts.append(np.flatnonzero(m) + start)
    return torch.from_numpy(np.concatenate(parts))


_TOPK_SAMPLE = 1 << 16
