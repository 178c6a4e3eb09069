"""What the site's compute did: inner steps and tokens, seconds computing and stalled on sync,
updates sent, and the compute utilization they give.

The utilization compares the site's inner-step rate over its training period (the first round's
start to its last send) with its rate while none of its syncs was in flight, measured in the same
run: 1.0 means the WAN cost the site no compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from site_agent.metrics import SiteMetrics
from site_agent.trainer import TrainStats


class SlotTally:
    """The inner steps of one slot (a round's share of training), added up call by call."""

    def __init__(self) -> None:
        self.steps = self.tokens = self.loss_steps = 0
        self.loss_sum = self.seconds = 0.0
        self.loss_last = math.nan

    def add(self, s: TrainStats) -> None:
        self.steps += s.steps
        self.tokens += s.tokens
        self.seconds += s.compute_seconds
        if s.loss_reported:  # the mean is of the steps whose loss was reported
            self.loss_sum += s.loss_mean * s.steps
            self.loss_steps += s.steps
            self.loss_last = s.loss_last

    def stats(self) -> TrainStats:
        reported = self.loss_steps > 0  # loss_last stays NaN until a loss is reported
        mean = self.loss_sum / self.loss_steps if reported else math.nan
        return TrainStats(self.steps, self.tokens, mean, self.loss_last, self.seconds, reported)


class Throughput:
    """Counts the site's inner steps, compute and stall seconds and updates sent."""

    def __init__(self, *, metrics: SiteMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self.steps_done = 0  # inner steps taken so far
        self.updates_sent = 0
        self.compute_s = 0.0
        self.stall_s = 0.0
        self._first_round_at: float | None = None
        self._last_send_at: float | None = None
        self._steps_at_last_send = 0
        # Inner steps trained while none of this site's syncs was in flight, and their wall
        # seconds: the site's rate with no sync running.
        self._free_steps = 0
        self._free_s = 0.0

    def round_started(self) -> None:
        """A round's slot starts training (the first one starts the training period)."""
        if self._first_round_at is None:
            self._first_round_at = self._clock()

    def stepped(self, s: TrainStats, *, wall_s: float, sync_free: bool) -> None:
        """The trainer took ``s.steps`` steps in ``wall_s`` seconds; ``sync_free``: with none of
        this site's syncs in flight (and not the run's first call, which is warm-up)."""
        self.steps_done += s.steps
        if sync_free:
            self._free_steps += s.steps
            self._free_s += wall_s

    def slot_trained(self, stats: TrainStats) -> None:
        self.compute_s += stats.compute_seconds
        self._metrics.inner(stats.steps, stats.tokens, stats.compute_seconds, stats.loss_mean)

    def stalled(self, seconds: float) -> None:
        """Seconds blocked on the link (counted once rounds run)."""
        if self._first_round_at is not None:
            self.stall_s += seconds
            self._metrics.stalled(seconds)

    def update_sent(self) -> None:
        self.updates_sent += 1
        self._metrics.round_sent()
        self._last_send_at = self._clock()
        self._steps_at_last_send = self.steps_done
        utilization = self.utilization()
        if utilization is not None:
            self._metrics.utilization(utilization)

    def _rates(self) -> tuple[float, float | None, float | None]:
        """The training period's wall seconds, its step rate and the sync-free step rate."""
        end = self._last_send_at if self._last_send_at is not None else self._clock()
        start = self._first_round_at
        wall = end - start if start is not None else 0.0
        steps = self._steps_at_last_send if self._last_send_at is not None else self.steps_done
        rate = steps / wall if wall > 0 else None
        free_rate = self._free_steps / self._free_s if self._free_s > 0 else None
        return wall, rate, free_rate

    def utilization(self) -> float | None:
        """Inner steps per second over the training period against the same site's rate while
        no sync of its was in flight; None until both are measured."""
        _wall, rate, free_rate = self._rates()
        return rate / free_rate if rate and free_rate else None

    def status(self) -> dict[str, Any]:
        wall, rate, free_rate = self._rates()
        return {
            "rounds_sent": self.updates_sent,
            "inner_steps": self.steps_done,
            "compute_seconds": self.compute_s,
            "stall_seconds": self.stall_s,
            "wall_seconds": wall,
            "compute_fraction": self.compute_s / wall if wall else 0.0,
            "steps_per_second": rate,
            "sync_free_steps_per_second": free_rate,
            "compute_utilization": rate / free_rate if rate and free_rate else None,
        }
