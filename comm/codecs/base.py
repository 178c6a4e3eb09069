"""The codec seam: the encoded form of a tensor, the codec protocol, finiteness checks.

A codec turns one float32 tensor into an :class:`EncodedTensor` (a small msgpack-able ``meta``
dict plus raw buffers that travel as zero-copy frames) and back; :class:`PayloadCodec` is what
every codec implements. The constants here are shared by the codec families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

FloatArray = npt.NDArray[np.float32]
TensorLike: TypeAlias = "npt.NDArray[Any] | torch.Tensor"
"""What ``encode`` accepts: a float16/float32/float64 numpy array or torch tensor (any device)."""

FP16_MAX = 65504.0
BF16_MAX = (2 - 2**-7) * 2.0**127
"""The largest finite bfloat16 (fp32's exponent, an 8-bit significand): 3.3895e38."""

# Elementwise work on CPU runs in tiles of this many values (4 MiB of float32): the temporaries
# stay in cache, and each tile is one vectorized torch op chain, so the Python loop is per tile
# only. Smaller tiles were no faster here and multiply the thread-pool hand-offs, each of which
# stalls when another process holds a core.
_TILE_ELEMS = 1 << 20
# Range decodes, in-place folds and sums of squares run in numpy on one thread, in tiles of this
# many values (256 KiB of float32): their temporaries stay in L2, which measured faster here
# than 4 MiB tiles (a fold's passes then read the tile from cache, not from memory).
_RANGE_TILE_ELEMS = 1 << 16
_ZSTD_FLAG = 0x10
_MAX_BLOCK = 1 << 20
_DEFAULT_ZSTD_LEVEL = 3
_F16 = np.dtype(np.float16)
_U8 = np.dtype(np.uint8)


def load_encoders() -> None:
    """Import the library the encoders run on (torch) now, not at a first encode: a service
    calls this as it starts, so that a broken install fails there, before any site joins, and
    the library's memory is the process's from the start, not a first close's."""
    import torch  # noqa: F401


class NonFiniteError(ValueError):
    """A tensor holds NaN or Inf, either before encoding or after decoding."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"tensor {name!r} {detail}")
        self.tensor_name = name


def _raise_non_finite(name: str, t: torch.Tensor, *, stage: str = "") -> NoReturn:
    import torch

    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    where = f" {stage}" if stage else ""
    raise NonFiniteError(name, f"has non-finite values{where} ({nan} NaN, {inf} Inf)")


def check_finite(name: str, x: TensorLike) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` if ``x`` holds a NaN or an Inf."""
    import torch

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


def _nbytes(buf: Any) -> int:
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return memoryview(buf).nbytes


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
    rows: tuple[int, int] | None = None
    """None: the whole tensor ``name``. Otherwise a slice of it, rows ``[start, stop)`` of its
    dim 0 (a shard of a model held by several ranks), and ``shape`` is the slice's:
    ``(stop - start, *the tensor's shape[1:])``. Codecs neither read nor set it."""

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

    def decode_into(self, enc: EncodedTensor, out: FloatArray, start: int = 0) -> None:
        """Decode the flat elements ``[start, start + out.size)`` of ``enc`` into ``out`` (a
        writable C-contiguous float32 array), bit for bit what ``decode`` gives there, reading
        only the blocks that cover the range. ValueError for a range outside the tensor or a
        malformed encoding, :class:`NonFiniteError` for a non-finite value in the range."""
        ...

    def accumulate(
        self,
        enc: EncodedTensor,
        out: FloatArray,
        weight: float,
        start: int = 0,
        *,
        fresh: bool = False,
    ) -> None:
        """``out += float32(weight) * decoded[start:start + out.size]`` in float32, in place,
        tile by tile (the product rounded to float32, then the sum). ``fresh``: ``out`` holds
        nothing yet (``np.empty``) and is written, not read: bit for bit what adding into zeros
        gives, without the page faults of reading fresh zero pages and writing them again.
        Checks the encoding's structure but not that its values are finite:
        :meth:`sum_squares` first refuses what ``decode`` refuses, so a fold never adds half an
        update."""
        ...

    def sum_squares(self, enc: EncodedTensor) -> float:
        """Σ x² over the decoded tensor (in float64), computed from the encoded values without
        decoding the tensor; raises what ``decode`` raises for the same encoding
        (:class:`NonFiniteError` for a non-finite value, ValueError when malformed). For the
        blockwise quantizers it is Σ_b scale_b² · Σ q², exact where decode rounds each value
        to float32."""
        ...
