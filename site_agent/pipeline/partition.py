"""Bottleneck-optimal split of a chain of layers (a model's units) into pipeline stages.

Solved exactly by dynamic programming, O(p n^2) (Archer et al., ICML 2024). Pure Python: the
costs come from ``profile.profile_units``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TransferModel:
    """Time to send one activation between adjacent stages: ``latency_s + bytes / bandwidth``
    (by default free: no latency, infinite bandwidth)."""

    latency_s: float = 0.0
    """Fixed cost of one send, in seconds; >= 0."""
    bandwidth_bytes_per_s: float = math.inf
    """Link bandwidth in bytes per second; > 0, ``math.inf`` for free transfers."""

    def __post_init__(self) -> None:
        if not 0 <= self.latency_s < math.inf:
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s!r}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}"
            )

    def seconds(self, num_bytes: int) -> float:
        """Time to send ``num_bytes`` from one stage to the next."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class PartitionPlan:
    """A contiguous split of layers ``0 .. n-1`` into stages, with the times it implies."""

    boundaries: tuple[int, ...]
    """Index of the first layer of each stage; starts with 0, strictly increasing."""
    stages: tuple[tuple[int, ...], ...]
    """Layer indices of each stage, in chain order."""
    stage_times: tuple[float, ...]
    """Per stage: compute seconds plus the send of its last activation (none for the last stage)."""
    bottleneck: float
    """The slowest stage's time: ``max(stage_times)``; the pipeline's steady-state period."""
    lower_bound: float
    """``max(largest layer cost, total cost / num_stages)``: no partition does better."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def partition_layers(
    layer_costs_s: Sequence[float],
    activation_bytes: Sequence[int],
    num_stages: int,
    transfer: TransferModel | None = None,
) -> PartitionPlan:
    """Split the chain into ``num_stages`` contiguous, non-empty stages minimizing the slowest
    stage's time: the sum of its layers' costs plus the send of its last layer's activation to
    the next stage (the last stage sends nothing).

    ``layer_costs_s[i]`` is layer i's forward+backward time; ``activation_bytes[i]`` the size of its
    output, sent when a cut follows layer i; ``transfer`` defaults to free transfers.

    Ties are broken deterministically, preferring earlier cuts: the last cut is the earliest one
    that keeps the bottleneck optimal, and the layers before it are split by the same rule. So each
    prefix of the plan is itself an optimal plan for its layers and number of stages.
    """
    costs, sizes, link = _check_inputs(layer_costs_s, activation_bytes, num_stages, transfer)
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    send_s = [link.seconds(b) for b in sizes]

    def stage_time(start: int, end: int) -> float:
        # Layers [start, end); a stage that ends the chain sends nothing.
        compute = prefix[end] - prefix[start]
        return compute if end == n else compute + send_s[end - 1]

    # best[k][j]: smallest bottleneck splitting layers [0, j) into k stages; cut[k][j] the start of
    # the k-th stage in that split. Only j >= k is reachable (stages are non-empty).
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        # The first k stages must leave at least one layer for each of the remaining ones.
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], stage_time(i, j))
                if value < best[k][j]:  # strict: the earliest cut wins a tie
                    best[k][j] = value
                    cut[k][j] = i
    boundaries = [0] * num_stages
    end = n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        assert start >= 0, "every reachable state has a cut"
        boundaries[k - 1] = start
        end = start
    return _plan(costs, send_s, boundaries)


def partition_at(
    layer_costs_s: Sequence[float],
    activation_bytes: Sequence[int],
    boundaries: Sequence[int],
    transfer: TransferModel | None = None,
) -> PartitionPlan:
    """The plan of a given cut: stage k starts at layer ``boundaries[k]`` (``boundaries[0]`` is
    0, the starts increase); its times as :func:`partition_layers` counts them."""
    starts = [int(b) for b in boundaries]
    costs, sizes, link = _check_inputs(layer_costs_s, activation_bytes, len(starts), transfer)
    if starts[0] != 0 or any(b >= a for a, b in zip(starts[1:], starts, strict=False)):
        raise ValueError(f"boundaries must start at 0 and increase, got {starts}")
    if starts[-1] >= len(costs):
        raise ValueError(f"boundaries {starts} leave the last stage no layer of {len(costs)}")
    return _plan(costs, [link.seconds(b) for b in sizes], starts)


def _check_inputs(
    layer_costs_s: Sequence[float],
    activation_bytes: Sequence[int],
    num_stages: int,
    transfer: TransferModel | None,
) -> tuple[list[float], list[int], TransferModel]:
    costs = [float(c) for c in layer_costs_s]
    sizes = [int(b) for b in activation_bytes]
    if not costs:
        raise ValueError("layer_costs_s is empty: a pipeline needs at least one layer")
    if len(sizes) != len(costs):
        raise ValueError(
            f"activation_bytes has {len(sizes)} entries but layer_costs_s has {len(costs)}"
        )
    for i, (c, b) in enumerate(zip(costs, sizes, strict=True)):
        if not 0 <= c < math.inf:
            raise ValueError(f"layer_costs_s[{i}] must be finite and >= 0, got {c!r}")
        if b < 0:
            raise ValueError(f"activation_bytes[{i}] must be >= 0, got {b}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > len(costs):
        raise ValueError(
            f"num_stages={num_stages} exceeds the number of layers ({len(costs)}): "
            "every stage needs at least one layer"
        )
    return costs, sizes, transfer if transfer is not None else TransferModel()


def _plan(costs: list[float], send_s: list[float], boundaries: Sequence[int]) -> PartitionPlan:
    """Build the plan for given stage starts; times are summed exactly (``math.fsum``)."""
    n = len(costs)
    ends = [*boundaries[1:], n]
    stages = tuple(tuple(range(start, end)) for start, end in zip(boundaries, ends, strict=True))
    stage_times = tuple(
        math.fsum(costs[start:end]) + (send_s[end - 1] if end < n else 0.0)
        for start, end in zip(boundaries, ends, strict=True)
    )
    return PartitionPlan(
        boundaries=tuple(boundaries),
        stages=stages,
        stage_times=stage_times,
        bottleneck=max(stage_times),
        lower_bound=max(max(costs), math.fsum(costs) / len(boundaries)),
    )
