"""Array plumbing and the codec skeleton shared by every codec family.

Fresh and zero-copy arrays, buffer reads checked against the sizes a ``meta`` implies, the
validation order of ``decode`` (family, shape, meta, buffer count and sizes) before any array is
allocated, and :class:`_Codec`, the base of the concrete codecs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor, FloatArray, TensorLike, _raise_non_finite

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
