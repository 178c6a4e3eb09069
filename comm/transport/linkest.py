"""Link estimation: what one channel has measured about its WAN link (RTT, goodput, BDP).

This module owns :class:`LinkEstimator`, one per channel (per peer): it folds round-trip samples
(heartbeat or acknowledgement round trips) and goodput samples (bytes acknowledged over time, or
whole transfers) into exponentially weighted moving averages, and answers with a frozen
:class:`LinkEstimate` that the scheduler and the transfer window read. Goodput is in bits per
second, as link rates are. It is pure: every method
takes the current time ``now`` in seconds, nothing reads a clock, so the same samples always give
the same estimate.

Two RTTs are kept. ``rtt_s`` is the smoothed RTT, what a message waits for an answer right now,
queueing included. ``min_rtt_s`` is the smallest RTT seen within ``min_rtt_window_s``: the
propagation delay of the path. The bandwidth-delay product uses the minimum: a credit window
sized from the smoothed RTT would measure the queue that the window itself builds and grow
without bound (window W over a link of rate B queues W - B x RTT, the next RTT sample reads about
W / B, and the next window would be a multiple of W).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LinkEstimatorConfig:
    """How samples are weighted and bounded."""

    rtt_alpha: float = 0.125
    """Weight of a new RTT sample in the smoothed RTT (RFC 6298 uses 1/8)."""
    goodput_alpha: float = 0.25
    """Weight of a new goodput sample in the smoothed goodput."""
    initial_rtt_s: float = 0.1
    """RTT assumed before the first sample."""
    initial_goodput_bps: float = 10e6
    """Goodput assumed before the first sample, bits/s: the slowest link crossdc is meant for."""
    min_rtt_s: float = 1e-4
    """Smallest RTT a sample is taken as (a loopback or veth hop answers in microseconds)."""
    max_rtt_s: float = 30.0
    """Largest RTT a sample is taken as; longer answers are stalls, not the link."""
    min_goodput_bps: float = 1e5
    """Smallest goodput a sample is taken as, bits/s."""
    max_goodput_bps: float = 1e12
    """Largest goodput a sample is taken as, bits/s."""
    min_rtt_window_s: float = 300.0
    """How long the minimum RTT is trusted; an older minimum gives way to the next sample
    (the path may have changed)."""
    goodput_interval_s: float = 0.1
    """Shortest interval one goodput sample from :meth:`LinkEstimator.on_bytes_acked` spans;
    shorter ones would measure ack bursts, not the link."""
    goodput_idle_s: float = 2.0
    """A gap longer than this between acknowledged bytes means the sender was idle: the open
    interval is dropped, not averaged over the idle time."""

    def __post_init__(self) -> None:
        for name in ("rtt_alpha", "goodput_alpha"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"linkest.{name} must be in (0, 1], got {value!r}")
        for name in (
            "initial_rtt_s",
            "initial_goodput_bps",
            "min_rtt_s",
            "max_rtt_s",
            "min_goodput_bps",
            "max_goodput_bps",
            "min_rtt_window_s",
            "goodput_interval_s",
            "goodput_idle_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"linkest.{name} must be a finite number > 0, got {value!r}")
        if self.max_rtt_s < self.min_rtt_s:
            raise ValueError("linkest.max_rtt_s must be >= linkest.min_rtt_s")
        if self.max_goodput_bps < self.min_goodput_bps:
            raise ValueError("linkest.max_goodput_bps must be >= linkest.min_goodput_bps")
        if self.goodput_idle_s < self.goodput_interval_s:
            raise ValueError("linkest.goodput_idle_s must be >= linkest.goodput_interval_s")


@dataclass(frozen=True, kw_only=True)
class LinkEstimate:
    """One link as measured at ``updated_at``; the priors of the config before any sample."""

    rtt_s: float
    """Smoothed round-trip time, seconds, queueing included."""
    goodput_bps: float
    """Smoothed payload rate, bits per second."""
    samples: int
    """RTT and goodput samples folded in so far; 0 means the figures are the configured priors."""
    updated_at: float | None
    """``now`` of the latest sample; None before the first."""
    min_rtt_s: float | None = None
    """Smallest recent RTT (the path's propagation delay); None means the same as ``rtt_s``."""

    def bdp_bytes(self) -> int:
        """Bandwidth-delay product in bytes: goodput x minimum RTT."""
        rtt_s = self.rtt_s if self.min_rtt_s is None else self.min_rtt_s
        return int(self.goodput_bps / 8.0 * rtt_s)


def _finite_nonnegative(value: float, what: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")


class LinkEstimator:
    """EWMA estimates of one link's RTT and goodput; pure, time passed in."""

    def __init__(self, config: LinkEstimatorConfig | None = None) -> None:
        self.config = config or LinkEstimatorConfig()
        self._srtt: float | None = None
        self._min_rtt: float | None = None
        self._min_rtt_at = 0.0
        self._goodput: float | None = None
        self._samples = 0
        self._updated_at: float | None = None
        # The open goodput interval: bytes acknowledged since it started (bytes acknowledged at
        # its start are not counted: their transfer began before it).
        self._win_start: float | None = None
        self._win_bytes = 0
        self._last_acked_at = 0.0

    # -- RTT ------------------------------------------------------------------------------

    def on_rtt_sample(self, seconds: float, now: float) -> float:
        """Fold in one round trip of ``seconds``; return the sample as taken (clamped)."""
        _finite_nonnegative(seconds, "rtt sample")
        cfg = self.config
        sample = min(cfg.max_rtt_s, max(cfg.min_rtt_s, seconds))
        if self._srtt is None:
            self._srtt = sample
        else:
            self._srtt += cfg.rtt_alpha * (sample - self._srtt)
        if (
            self._min_rtt is None
            or sample <= self._min_rtt
            or now - self._min_rtt_at > cfg.min_rtt_window_s
        ):
            self._min_rtt, self._min_rtt_at = sample, now
        self._count(now)
        return sample

    # -- goodput --------------------------------------------------------------------------

    def on_bytes_acked(self, nbytes: int, now: float) -> float | None:
        """Count ``nbytes`` acknowledged (or received) at ``now``.

        Returns the goodput sample in bits/s when this closes an interval of at least
        ``goodput_interval_s``, else None. The first bytes after an idle gap open an interval
        and are not counted in it, so idle time never dilutes a sample.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        cfg = self.config
        if self._win_start is None or now - self._last_acked_at > cfg.goodput_idle_s:
            self._win_start, self._win_bytes, self._last_acked_at = now, 0, now
            return None
        self._win_bytes += nbytes
        self._last_acked_at = now
        span = now - self._win_start
        if span < cfg.goodput_interval_s:
            return None
        sample = self._fold_goodput(self._win_bytes * 8.0 / span, now)
        self._win_start, self._win_bytes = now, 0
        return sample

    def on_transfer(self, nbytes: int, seconds: float, now: float) -> float:
        """Fold in one whole transfer of ``nbytes`` that took ``seconds``; return the sample."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        _finite_nonnegative(seconds, "transfer seconds")
        if seconds == 0:
            raise ValueError("transfer seconds must be > 0")
        return self._fold_goodput(nbytes * 8.0 / seconds, now)

    def _fold_goodput(self, bps: float, now: float) -> float:
        cfg = self.config
        sample = min(cfg.max_goodput_bps, max(cfg.min_goodput_bps, bps))
        if self._goodput is None:
            self._goodput = sample
        else:
            self._goodput += cfg.goodput_alpha * (sample - self._goodput)
        self._count(now)
        return sample

    def _count(self, now: float) -> None:
        self._samples += 1
        self._updated_at = now if self._updated_at is None else max(self._updated_at, now)

    # -- answers --------------------------------------------------------------------------

    def snapshot(self) -> LinkEstimate:
        """The current estimate (priors where nothing was measured yet)."""
        cfg = self.config
        rtt_s = cfg.initial_rtt_s if self._srtt is None else self._srtt
        return LinkEstimate(
            rtt_s=rtt_s,
            goodput_bps=cfg.initial_goodput_bps if self._goodput is None else self._goodput,
            samples=self._samples,
            updated_at=self._updated_at,
            min_rtt_s=rtt_s if self._min_rtt is None else self._min_rtt,
        )

    def bdp_bytes(self) -> int:
        """Bandwidth-delay product in bytes: smoothed goodput x minimum RTT."""
        return self.snapshot().bdp_bytes()
