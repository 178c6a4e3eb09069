"""Streaming aggregation: each update folded into a running weighted sum the moment it arrives.

The coordinator keeps one :class:`RunningSum` per open round (and one per round whose late
updates wait for their fragment's next sync), never the sites' updates themselves, so its memory
is O(model) whatever the number of sites. Sums are accumulated in float64: the mean is the same
as a float32 mean of the kept updates up to float32 rounding, whatever the arrival order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

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
