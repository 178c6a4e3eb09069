"""Error feedback: what lossy compression dropped is kept and added to the next message.

One :class:`ErrorFeedback` per sender (a site's uplink, the coordinator's downlink) holds a float32
residual per tensor name. ``compress`` sends C(x + residual) and keeps the part the codec lost:

    y = x + decay * residual;  enc = C(y);  residual = y - D(enc)

With ``decay == 1`` no mass is lost: after any number of rounds, the sum of everything decoded
plus the final residual equals the sum of the raw inputs, to float rounding. A decay below 1
(SparseLoCo uses 0.95) forgets old error geometrically instead.

A residual lives where its input does: a numpy array's on the host (float32 numpy), a torch
tensor's as a float32 tensor on the tensor's device (a rank of a sharded site keeps the residual
of its rows beside them, ``site_agent.shards``); only the decoded values of an encoding cross to
that device. ``compress``'s ``encode`` replaces ``codec.encode`` (a shard encodes its rows as a
slice of the whole tensor) while the rule stays this one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor, FloatArray, PayloadCodec, TensorLike, check_finite

Residual: TypeAlias = "FloatArray | torch.Tensor"
"""A residual: float32 numpy on the host, or a float32 torch tensor on its input's device."""

Encode: TypeAlias = Callable[[str, TensorLike], EncodedTensor]

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs


class ErrorFeedback:
    """Per-tensor residuals of one lossy sender. Not thread-safe: one caller per instance."""

    def __init__(self, *, decay: float = 1.0) -> None:
        if not (math.isfinite(decay) and 0.0 <= decay <= 1.0):
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        self.decay = decay
        self._residuals: dict[str, Residual] = {}

    def compress(
        self, name: str, x: TensorLike, codec: PayloadCodec, *, encode: Encode | None = None
    ) -> EncodedTensor:
        """Encode ``x`` plus the residual carried for ``name``; keep what the codec lost.
        ``encode`` (default ``codec.encode``) makes the encoding that ``codec`` decodes."""
        if _is_tensor(x):
            return self._compress_tensor(name, x, codec, encode)
        y = _as_f32(name, x)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != y.shape:
                raise ValueError(
                    f"tensor {name!r}: shape {y.shape} differs from its residual's "
                    f"{residual.shape}; reset() it first"
                )
            residual = _host_residual(residual)
            if self.decay == 1.0:
                y += residual
            elif self.decay:
                y += np.float32(self.decay) * residual
        enc = codec.encode(name, y) if encode is None else encode(name, y)
        decoded = codec.decode(enc)
        # y is ours (a fresh copy) and the encoding never aliases it, so reuse it in place.
        np.subtract(y, decoded.reshape(y.shape), out=y)
        self._residuals[name] = y
        return enc

    def _compress_tensor(
        self, name: str, x: torch.Tensor, codec: PayloadCodec, encode: Encode | None
    ) -> EncodedTensor:
        """The rule on ``x``'s device: y and the residual stay there, the decoded values go
        there."""
        import torch

        if not x.is_floating_point():
            raise ValueError(f"tensor {name!r}: expected a floating dtype, got {x.dtype}")
        y = x.detach().to(dtype=torch.float32, copy=True)
        residual = self._residuals.get(name)
        if residual is not None:
            if tuple(residual.shape) != tuple(y.shape):
                raise ValueError(
                    f"tensor {name!r}: shape {tuple(y.shape)} differs from its residual's "
                    f"{tuple(residual.shape)}; reset() it first"
                )
            r = _tensor_residual(residual, y.device)
            if self.decay == 1.0:
                y += r
            elif self.decay:
                y += r * self.decay
        enc = codec.encode(name, y) if encode is None else encode(name, y)
        decoded = torch.from_numpy(np.asarray(codec.decode(enc), dtype=np.float32))
        y -= decoded.reshape(y.shape).to(y.device)
        self._residuals[name] = y
        return enc

    def encode_owed(
        self, name: str, x: TensorLike, codec: PayloadCodec, *, encode: Encode | None = None
    ) -> EncodedTensor:
        """What :meth:`compress` sends for ``x`` (``x`` plus the residual carried for ``name``),
        keeping the residual as it is; :meth:`settle` then keeps what the encoding lost. A
        sender whose tensors go out all together or not at all encodes every one first and
        settles them once all are encoded: a tensor that cannot be encoded leaves every
        residual as it was, with no copy of them kept."""
        if not _is_tensor(x):
            return self._encode_host(name, x, codec, encode)
        import torch

        if not x.is_floating_point():
            raise ValueError(f"tensor {name!r}: expected a floating dtype, got {x.dtype}")
        y = x.detach().to(dtype=torch.float32, copy=True)
        residual = self._residuals.get(name)
        if residual is not None:
            self._check_shape(name, tuple(y.shape), tuple(residual.shape))
            r = _tensor_residual(residual, y.device)
            if self.decay == 1.0:
                y += r
            elif self.decay:
                y += r * self.decay
        return codec.encode(name, y) if encode is None else encode(name, y)

    def _encode_host(
        self, name: str, x: TensorLike, codec: PayloadCodec, encode: Encode | None
    ) -> EncodedTensor:
        y = _as_f32(name, x)
        residual = self._residuals.get(name)
        if residual is not None:
            self._check_shape(name, y.shape, tuple(residual.shape))
            residual = _host_residual(residual)
            if self.decay == 1.0:
                y += residual
            elif self.decay:
                y += np.float32(self.decay) * residual
        return codec.encode(name, y) if encode is None else encode(name, y)

    def settle(self, name: str, x: TensorLike, enc: EncodedTensor, codec: PayloadCodec) -> None:
        """Keep what encoding ``enc`` (:meth:`encode_owed` of the same ``x``) lost: the residual
        for ``name`` ← x + decay · residual − decoded, written into the residual's own memory
        (a first one is made from ``x``), the decoded values a tile at a time: bit for bit the
        residual :meth:`compress` keeps, without a second residual or a decoded copy of the
        tensor. A :meth:`snapshot` taken before does not hold across it."""
        residual = self._residuals.get(name)
        if _is_tensor(x):
            import torch

            xt = x.detach()
            if residual is None:
                r = xt.to(dtype=torch.float32, copy=True).contiguous()
            else:
                self._check_shape(name, tuple(xt.shape), tuple(residual.shape))
                r = _tensor_residual(residual, xt.device)
                if not r.is_contiguous():
                    r = r.contiguous()
                self._decay_add(r, xt)
            self._residuals[name] = r
            flat_t = r.view(-1)
            for lo, part in _decoded_tiles(enc, codec, flat_t.numel()):
                flat_t[lo : lo + part.size].sub_(torch.from_numpy(part).to(r.device))
            return
        values = np.asarray(x, dtype=np.float32)
        if residual is None:
            r_host = _as_f32(name, values)
        else:
            self._check_shape(name, values.shape, tuple(residual.shape))
            r_host = residual if isinstance(residual, np.ndarray) else _as_f32(name, residual)
            self._decay_add_host(r_host, values)
        self._residuals[name] = r_host
        flat = r_host.reshape(-1)
        for lo, part in _decoded_tiles(enc, codec, flat.size):
            flat[lo : lo + part.size] -= part

    def _decay_add(self, r: torch.Tensor, x: torch.Tensor) -> None:
        """r ← x + decay · r in place, with :meth:`compress`'s roundings (x + r is r + x)."""
        if self.decay == 1.0:
            r.add_(x)
        elif self.decay:
            r.mul_(self.decay).add_(x)
        else:
            r.copy_(x)

    def _decay_add_host(self, r: FloatArray, x: FloatArray) -> None:
        if self.decay == 1.0:
            r += x
        elif self.decay:
            r *= np.float32(self.decay)
            r += x
        else:
            r[...] = x

    @staticmethod
    def _check_shape(name: str, shape: tuple[int, ...], residual: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(residual):
            raise ValueError(
                f"tensor {name!r}: shape {tuple(shape)} differs from its residual's "
                f"{tuple(residual)}; reset() it first"
            )

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
            y += np.float32(self.decay) * _host_residual(residual)
        self._residuals[name] = y

    def accumulated_norm(self, name: str, x: TensorLike) -> float:
        """L2 norm of what ``compress(name, x, ...)`` would encode (x + decay · residual)."""
        y = _as_f32(name, x)
        residual = self._residuals.get(name)
        if residual is not None and residual.shape == y.shape:
            y += np.float32(self.decay) * _host_residual(residual)
        flat = y.reshape(-1).astype(np.float64)
        return math.sqrt(float(flat @ flat))

    def residual(self, name: str) -> Any:
        """A copy of the residual carried for ``name`` (numpy, or a torch tensor where its
        input was one), or None."""
        r = self._residuals.get(name)
        if r is None:
            return None
        return r.clone() if _is_tensor(r) else r.copy()

    def residual_held(self, name: str) -> Any:
        """The residual carried for ``name`` itself, not a copy (to read, e.g. to checkpoint it
        without a second copy of every residual: do not change it), or None."""
        return self._residuals.get(name)

    def residual_norm(self, name: str | None = None) -> float:
        """L2 norm of one residual, or of all of them together (a metric: the error still owed)."""
        return math.sqrt(self.residual_sq_norm(name))

    def residual_sq_norm(self, name: str | None = None) -> float:
        """The squared L2 norm of one residual or of all (float64 sums; a sharded site adds its
        ranks' to get the whole model's)."""
        arrays = self._residuals.values() if name is None else [self._residuals.get(name)]
        total = 0.0
        for r in arrays:
            if _is_tensor(r):
                flat_t = r.reshape(-1).double()
                total += float(flat_t @ flat_t)
            elif r is not None:
                flat = r.reshape(-1).astype(np.float64)
                total += float(flat @ flat)
        return total

    def reset(self, name: str | None = None) -> None:
        """Drop one residual, or all (e.g. after a full download replaced the model)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def names(self) -> Iterator[str]:
        return iter(sorted(self._residuals))

    def state_dict(self) -> dict[str, FloatArray]:
        """Copies of every residual on the host, for a site checkpoint."""
        return {name: _host_residual(r).copy() for name, r in self._residuals.items()}

    def snapshot(self) -> dict[str, Residual]:
        """The residuals as they are now, without copying them (:meth:`compress` replaces a
        residual, never changes it in place; :meth:`settle` does): :meth:`restore` puts them
        back, e.g. when one tensor of an update cannot be encoded and none of it goes out."""
        return dict(self._residuals)

    def restore(self, snapshot: Mapping[str, Residual]) -> None:
        """The residuals as :meth:`snapshot` took them."""
        self._residuals = dict(snapshot)

    def load_state_dict(self, state: Mapping[str, npt.ArrayLike | torch.Tensor]) -> None:
        """Replace all residuals with ``state`` (validated before anything changes); a torch
        tensor's stays on its device."""
        loaded: dict[str, Residual] = {}
        for name, value in state.items():
            if not isinstance(name, str):
                raise ValueError(f"residual names must be strings, got {name!r}")
            if _is_tensor(value):
                if not value.is_floating_point():
                    raise ValueError(f"residual {name!r}: expected floats, got {value.dtype}")
                t = value.detach().float().clone().contiguous()
                check_finite(name, t)
                loaded[name] = t
                continue
            arr = np.asarray(value)
            if arr.dtype.kind != "f":
                raise ValueError(f"residual {name!r}: expected floats, got {arr.dtype}")
            loaded[name] = np.array(arr, dtype=np.float32, order="C", copy=True)
            check_finite(name, loaded[name])
        self._residuals = loaded


def _is_tensor(x: object) -> TypeIs[torch.Tensor]:
    """Whether ``x`` is a torch tensor (torch not imported: it cannot be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _host_residual(r: Residual) -> FloatArray:
    """A residual on the host as float32 numpy (itself when it is numpy)."""
    if isinstance(r, np.ndarray):
        return r
    return np.asarray(r.detach().cpu().float().numpy())


def _tensor_residual(r: Residual, device: torch.device) -> torch.Tensor:
    """A residual as a float32 tensor on ``device``."""
    import torch

    t = torch.from_numpy(r) if isinstance(r, np.ndarray) else r
    return t.to(device=device, dtype=torch.float32)


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


_SETTLE_TILE = 1 << 20
"""Values decoded at a time when a residual is settled (4 MiB of float32)."""


def _decoded_tiles(
    enc: EncodedTensor, codec: PayloadCodec, numel: int
) -> Iterator[tuple[int, FloatArray]]:
    """``enc`` decoded a tile at a time: (flat start, values), the buffer reused."""
    if not numel:
        return
    buf = np.empty(min(_SETTLE_TILE, numel), dtype=np.float32)
    for lo in range(0, numel, buf.size):
        part = buf[: min(buf.size, numel - lo)]
        codec.decode_into(enc, part, lo)
        yield lo, part
