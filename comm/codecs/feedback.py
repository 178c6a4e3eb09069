"""Error feedback: what lossy compression dropped is kept and added to the next message.

One :class:`ErrorFeedback` per sender (a site's uplink, the coordinator's downlink) holds a float32
residual per tensor name. ``compress`` sends C(x + residual) and keeps the part the codec lost:

    y = x + decay * residual;  enc = C(y);  residual = y - D(enc)

With ``decay == 1`` no mass is lost: after any number of rounds, the sum of everything decoded
plus the final residual equals the sum of the raw inputs, to float rounding. A decay below 1
(SparseLoCo uses 0.95) forgets old error geometrically instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor, FloatArray, PayloadCodec, TensorLike, check_finite

if TYPE_CHECKING:
    pass


class ErrorFeedback:
    """Per-tensor residuals of one lossy sender. Not thread-safe: one caller per instance."""

    def __init__(self, *, decay: float = 1.0) -> None:
        if not (math.isfinite(decay) and 0.0 <= decay <= 1.0):
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = decay
        self._residuals: dict[str, FloatArray] = {}

    def compress(self, name: str, x: TensorLike, codec: PayloadCodec) -> EncodedTensor:
        """Encode ``x`` plus the residual carried for ``name``; keep what the codec lost."""
        y = _as_f32(name, x)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != y.shape:
                raise ValueError(
                    f"tensor {name!r}: shape {y.shape} differs from its residual's "
                    f"{residual.shape}; reset() it first"
                )
            if self.decay == 1.0:
                y += residual
            elif self.decay:
                y += np.float32(self.decay) * residual
        enc = codec.encode(name, y)
        decoded = codec.decode(enc)
        # y is ours (a fresh copy) and the encoding never aliases it, so reuse it in place.
        np.subtract(y, decoded.reshape(y.shape), out=y)
        self._residuals[name] = y
        return enc

    def hold(self, name: str, x: TensorLike) -> None:
        """Fold ``x`` into the residual without sending anything (residual = x + decay ·
        residual): a sync skipped as insignificant keeps its update for a later one."""
        y = _as_f32(name, x)
        check_finite(name, y)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != y.shape:
                raise ValueError(
                    f"tensor {name!r}: shape {y.shape} differs from its residual's "
                    f"{residual.shape}; reset() it first"
                )
            y += np.float32(self.decay) * residual
        self._residuals[name] = y

    def accumulated_norm(self, name: str, x: TensorLike) -> float:
        """L2 norm of what ``compress(name, x, ...)`` would encode (x + decay · residual)."""
        y = _as_f32(name, x)
        residual = self._residuals.get(name)
        if residual is not None and residual.shape == y.shape:
            y += np.float32(self.decay) * residual
        flat = y.reshape(-1).astype(np.float64)
        return math.sqrt(float(flat @ flat))

    def residual(self, name: str) -> FloatArray | None:
        """A copy of the residual carried for ``name``, or None."""
        r = self._residuals.get(name)
        return None if r is None else r.copy()

    def residual_norm(self, name: str | None = None) -> float:
        """L2 norm of one residual, or of all of them together (a metric: the error still owed)."""
        arrays = self._residuals.values() if name is None else [self._residuals.get(name)]
        total = 0.0
        for r in arrays:
            if r is not None:
                flat = r.reshape(-1).astype(np.float64)
                total += float(flat @ flat)
        return math.sqrt(total)

    def reset(self, name: str | None = None) -> None:
        """Drop one residual, or all (e.g. after a full download replaced the model)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def names(self) -> Iterator[str]:
        return iter(sorted(self._residuals))

    def state_dict(self) -> dict[str, FloatArray]:
        """Copies of every residual, for a site checkpoint."""
        return {name: r.copy() for name, r in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, npt.ArrayLike]) -> None:
        """Replace all residuals with ``state`` (validated before anything changes)."""
        loaded: dict[str, FloatArray] = {}
        for name, value in state.items():
            if not isinstance(name, str):
                raise ValueError(f"residual names must be strings, got {name!r}")
            arr = np.asarray(value)
            if arr.dtype.kind != "f":
                raise ValueError(f"residual {name!r}: expected floats, got {arr.dtype}")
            loaded[name] = np.array(arr, dtype=np.float32, order="C", copy=True)
            check_finite(name, loaded[name])
        self._residuals = loaded


def _as_f32(name: str, x: TensorLike) -> FloatArray:
    """A fresh float32 copy of ``x`` on the host."""
    import torch

    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ValueError(f"tensor {name!r}: expected a floating dtype, got {x.dtype}")
        x = x.detach().to(device="cpu", dtype=torch.float32).numpy()
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ValueError(f"tensor {name!r}: expected a floating dtype, got {arr.dtype}")
    return np.array(arr, dtype=np.float32, order="C", copy=True)
