"""Streaming aggregation: each update folded into a running weighted sum the moment it arrives.

The coordinator keeps one :class:`RunningSum` per open round (and one per round whose late
updates wait for their fragment's next sync), never the sites' updates themselves, so its memory
is O(model) whatever the number of sites. Under secure aggregation a :class:`MaskedSum` does the
same for the masked vectors: their pairwise masks cancel in the modular sum, so only the sum is
kept and only the sum is ever unmasked. Sums are accumulated in float64: the mean is the same
as a float32 mean of the kept updates up to float32 rounding, whatever the arrival order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from comm.security.masking import WEIGHT_KEY, SecAggConfig, to_signed

Arrays = dict[str, npt.NDArray[np.float32]]


class RunningSum:
    """Σ w·x per tensor and Σ w, over the updates added so far."""

    def __init__(self) -> None:
        self._sum: dict[str, npt.NDArray[np.float64]] = {}
        self.weight = 0.0
        self.count = 0

    def add(self, weight: float, tensors: Mapping[str, np.ndarray]) -> None:
        """Fold one update in; its tensors may be freed afterwards."""
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a positive number, got {weight}")
        if self._sum and set(tensors) != set(self._sum):
            raise ValueError("an update names other tensors than the ones summed so far")
        for name, value in tensors.items():
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = np.asarray(value, dtype=np.float64) * weight
            else:
                acc += np.asarray(value, dtype=np.float64) * weight
        self.weight += weight
        self.count += 1

    def mean(self) -> Arrays:
        """Σ w·x / Σ w per tensor, as float32."""
        if not self.count:
            raise ValueError("the mean of no updates")
        return {n: (s / self.weight).astype(np.float32) for n, s in self._sum.items()}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._sum.values())


class MaskedSum:
    """The modular sum of one masking attempt's vectors, per tensor, and who sent them.

    Integer addition modulo 2^k is exact and order-free, so the result is the same as summing the
    kept vectors at the end; a site's vectors may be freed as soon as they are added."""

    def __init__(self, config: SecAggConfig) -> None:
        self._config = config
        self._sum: dict[str, npt.NDArray[np.unsignedinteger[Any]]] = {}
        self.senders: set[str] = set()

    def add(
        self, site_id: str, vectors: Mapping[str, npt.NDArray[np.unsignedinteger[Any]]]
    ) -> None:
        if site_id in self.senders:
            raise ValueError(f"secagg: site {site_id!r} already sent its vectors")
        if self._sum and {n: a.shape for n, a in vectors.items()} != {
            n: a.shape for n, a in self._sum.items()
        }:
            raise ValueError(f"secagg: site {site_id!r} sent other tensor names or shapes")
        for name, arr in vectors.items():
            if arr.dtype != self._config.dtype:
                raise ValueError(
                    f"secagg: site {site_id!r} tensor {name!r} is {arr.dtype}, "
                    f"not {self._config.dtype}"
                )
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = np.array(arr, dtype=self._config.dtype, copy=True)
            else:
                np.add(acc, arr, out=acc)
        self.senders.add(site_id)

    def mean(self, participants: Mapping[str, object]) -> tuple[Arrays, float]:
        """The weighted mean and the total weight, once exactly ``participants`` have added
        their vectors (otherwise the masks do not cancel: ValueError)."""
        if self.senders != set(participants):
            raise ValueError(
                f"secagg: vectors from {sorted(self.senders)} do not match the masking set "
                f"{sorted(participants)}"
            )
        if WEIGHT_KEY not in self._sum:
            raise ValueError(f"secagg: vectors lack the weight entry {WEIGHT_KEY!r}")
        frac = -self._config.frac_bits
        sums = {
            n: np.ldexp(to_signed(a, self._config).astype(np.float64), frac)
            for n, a in self._sum.items()
        }
        total = float(sums.pop(WEIGHT_KEY)[0])
        if total <= 0:
            raise ValueError("secagg: the total weight is 0: no site contributed")
        return {n: (v / total).astype(np.float32) for n, v in sums.items()}, total

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._sum.values())
