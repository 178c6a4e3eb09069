"""The sparse broadcast: the sites' sparse updates forwarded, and the step that applies them.

With the SparseLoCo strategy the coordinator's outer step is θ ← θ − lr · Σ w_s D(q_s) / Σ w_s
over the sites' encoded updates q_s. Forwarding the q_s themselves (each a few tenths of a bit
per value) is the broadcast: it is as sparse as the updates, and a site that decodes them and
runs :func:`sparse_step` computes the coordinator's parameters bit for bit, since the decode and
the float32 arithmetic, in the same order, are the same. No downlink residual is needed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import decode_tensor

Arrays = dict[str, npt.NDArray[np.float32]]


def sparse_step(
    params: Mapping[str, np.ndarray],
    updates: Sequence[tuple[float, Mapping[str, np.ndarray]]],
    *,
    lr: float,
    averaged: Collection[str] = (),
) -> Arrays:
    """θ − lr · (Σ w_i u_i / Σ w_i), accumulated in float32 in the given order; tensors in
    ``averaged`` (statistics, not weights) take lr 1."""
    if not updates:
        raise ValueError("sparse_step of no updates")
    total = float(sum(w for w, _ in updates))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    out: Arrays = {}
    for name, p in params.items():
        acc = np.zeros(np.shape(p), dtype=np.float32)
        for weight, tensors in updates:
            acc += np.float32(weight / total) * np.asarray(tensors[name], dtype=np.float32)
        step_lr = np.float32(1.0 if name in averaged else lr)
        out[name] = (np.asarray(p, dtype=np.float32) - step_lr * acc).astype(np.float32)
    return out


def decode_updates(
    parts: Sequence[tuple[float, Mapping[str, EncodedTensor]]],
) -> list[tuple[float, Arrays]]:
    """The broadcast's encoded updates, decoded, in their order."""
    return [
        (w, {name: decode_tensor(enc).reshape(enc.shape) for name, enc in tensors.items()})
        for w, tensors in parts
    ]


def apply_sparse_broadcast(
    params: Mapping[str, np.ndarray],
    parts: Sequence[tuple[float, Mapping[str, EncodedTensor]]],
    *,
    lr: float,
    averaged: Collection[str] = (),
) -> Arrays:
    """What a site holds after the broadcast: :func:`sparse_step` over the decoded updates,
    which ``parts`` lists in the coordinator's site order."""
    return sparse_step(params, decode_updates(parts), lr=lr, averaged=averaged)
