"""Shaping: the pure token bucket and delay line, and the per-connection pipes they drive.

:class:`TokenBucket` and :class:`DelayLine` are pure (every method takes ``now``), tested with a
fake clock. :class:`_Pipe` is one direction of one connection, :class:`_Conn` a proxied
connection, :class:`_Shaper` one direction's rate cap shared by every connection of the link.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import socket
import struct
from collections import deque
from collections.abc import Sequence

from crossdc.lab.profiles import DIRECTIONS, Direction, LinkProfile

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Pure building blocks


_TOKEN_SLACK = 1e-6  # float rounding in the refill must not cost a whole byte (or a wake-up)


class TokenBucket:
    """A token bucket over bytes; pure: every method takes the current time ``now`` in seconds.

    Starts full. Invariant: the bytes taken over any interval ``[t0, t1]`` never exceed
    ``burst_bytes + rate_bytes_per_s * (t1 - t0)``.
    """

    def __init__(self, *, rate_bytes_per_s: float, burst_bytes: int, now: float) -> None:
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = burst_bytes
        self._tokens = float(burst_bytes)
        self._last = now

    def _refill(self, now: float) -> None:
        if now > self._last:
            self._tokens = min(
                float(self.burst_bytes), self._tokens + (now - self._last) * self.rate_bytes_per_s
            )
            self._last = now

    def tokens(self, now: float) -> float:
        """Bytes that may pass at ``now``."""
        self._refill(now)
        return self._tokens

    def take(self, now: float, max_bytes: int) -> int:
        """Take up to ``max_bytes`` whole tokens; return how many were taken."""
        self._refill(now)
        taken = min(max_bytes, int(self._tokens + _TOKEN_SLACK))
        self._tokens -= taken
        return taken

    def seconds_until(self, now: float, n_bytes: int) -> float:
        """Seconds from ``now`` until ``n_bytes`` (at most ``burst_bytes``) tokens are there."""
        assert n_bytes <= self.burst_bytes, (n_bytes, self.burst_bytes)
        short = n_bytes - self.tokens(now) - _TOKEN_SLACK
        return 0.0 if short <= 0 else short / self.rate_bytes_per_s

    def set_rate(self, now: float, *, rate_bytes_per_s: float, burst_bytes: int) -> None:
        """Change the rate from ``now`` on; tokens earned so far are kept up to the new depth."""
        self._refill(now)
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = burst_bytes
        self._tokens = min(self._tokens, float(burst_bytes))


class DelayLine:
    """Bytes in propagation, in order: each pushed batch is due ``delay_s`` plus a jitter draw
    after it was pushed, and never before the batch pushed before it (no reordering)."""

    def __init__(self, *, delay_s: float, jitter_s: float, rng: random.Random) -> None:
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self._rng = rng
        self._batches: deque[tuple[float, Sequence[memoryview]]] = deque()
        self._last_due = -math.inf
        self.nbytes = 0

    def push(self, now: float, chunks: Sequence[memoryview]) -> float:
        """Append one batch released at ``now``; return the time it becomes due."""
        delay = self.delay_s
        if self.jitter_s > 0:
            delay = max(0.0, delay + self._rng.uniform(-self.jitter_s, self.jitter_s))
        due = max(now + delay, self._last_due)
        self._last_due = due
        self._batches.append((due, chunks))
        self.nbytes += sum(len(c) for c in chunks)
        return due

    def next_due(self) -> float | None:
        return self._batches[0][0] if self._batches else None

    def pop_due(self, now: float) -> list[memoryview]:
        """Remove and return, in order, every chunk due at or before ``now``."""
        out: list[memoryview] = []
        while self._batches and self._batches[0][0] <= now:
            out.extend(self._batches.popleft()[1])
        self.nbytes -= sum(len(c) for c in out)
        return out

    def clear(self) -> None:
        self._batches.clear()
        self.nbytes = 0


# --------------------------------------------------------------------------------------------
# The proxy

_RECV_BYTES = 256 * 1024
# Per socket and loop turn, so that one busy connection cannot starve the others.
_READ_BUDGET_BYTES = 1 << 20
_UNLIMITED_WINDOW_BYTES = 32 << 20
_MIN_QUEUE_BYTES = 256 * 1024
_QUEUE_S = 0.1  # the shaper queues up to ~100 ms of traffic, like a router's buffer
_UNIT_S = 0.001  # the shaper releases in units of at most ~1 ms of traffic
_MIN_UNIT_BYTES = 1500
_COARSE_BURST_S = 0.002  # below this much traffic per bucket, wake-up latency eats into the rate
_LINGER_RESET = struct.pack("ii", 1, 0)


def _release_unit(profile: LinkProfile) -> int:
    rate = profile.rate_bytes_per_s
    if rate is None:
        return _RECV_BYTES
    # A quarter of the bucket, so tokens do not overflow (and rate is not lost) while the loop
    # waits for the next unit: the selector's timeout has only millisecond resolution.
    unit = max(_MIN_UNIT_BYTES, min(profile.burst_bytes // 4, int(rate * _UNIT_S)))
    return min(profile.burst_bytes, unit)


def _window_bytes(profile: LinkProfile) -> int:
    """How many bytes one connection may have inside the emulator in one direction.

    It must hold the bandwidth-delay product, or the delay line would cap throughput below the
    rate; beyond that it is the shaper's queue.
    """
    rate = profile.rate_bytes_per_s
    if rate is None:
        return _UNLIMITED_WINDOW_BYTES
    in_flight = rate * (profile.delay_s + profile.jitter_s)
    queue = max(_MIN_QUEUE_BYTES, profile.burst_bytes, rate * _QUEUE_S)
    return int(in_flight + queue)


def _reset_close(sock: socket.socket) -> None:
    """Close so that the peer sees a connection reset (RST), not an orderly end of stream."""
    with contextlib.suppress(OSError):  # the socket may already be dead
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


class _Pipe:
    """One direction of one proxied connection: src -> shaper queue -> delay line -> out -> dst."""

    __slots__ = (
        "conn",
        "direction",
        "src",
        "dst",
        "queue",
        "queue_bytes",
        "queued",
        "line",
        "out",
        "out_bytes",
        "src_eof",
        "src_reset",
        "dst_shut",
    )

    def __init__(
        self,
        conn: _Conn,
        direction: Direction,
        src: socket.socket,
        dst: socket.socket,
        line: DelayLine,
    ) -> None:
        self.conn = conn
        self.direction: Direction = direction
        self.src = src
        self.dst = dst
        self.queue: deque[memoryview] = deque()
        self.queue_bytes = 0
        self.queued = False  # in its shaper's round-robin
        self.line = line
        self.out: deque[memoryview] = deque()
        self.out_bytes = 0
        self.src_eof = False
        self.src_reset = False  # the source reset: reset the destination once delivered
        self.dst_shut = False

    @property
    def buffered(self) -> int:
        return self.queue_bytes + self.line.nbytes + self.out_bytes

    def take_front(self, n_bytes: int) -> list[memoryview]:
        chunks: list[memoryview] = []
        while n_bytes > 0:
            head = self.queue[0]
            if len(head) <= n_bytes:
                chunks.append(self.queue.popleft())
                n_bytes -= len(head)
            else:
                chunks.append(head[:n_bytes])
                self.queue[0] = head[n_bytes:]
                n_bytes = 0
        taken = sum(len(c) for c in chunks)
        self.queue_bytes -= taken
        return chunks


class _Conn:
    __slots__ = ("conn_id", "client", "upstream", "connected", "closed", "up", "down", "masks")

    def __init__(
        self,
        conn_id: int,
        client: socket.socket,
        upstream: socket.socket,
        profiles: dict[Direction, LinkProfile],
    ) -> None:
        self.conn_id = conn_id
        self.client = client
        self.upstream = upstream
        self.connected = False
        self.closed = False
        lines = {
            d: DelayLine(
                delay_s=profiles[d].delay_s,
                jitter_s=profiles[d].jitter_s,
                rng=random.Random(f"{profiles[d].seed}:{conn_id}:{d}"),
            )
            for d in DIRECTIONS
        }
        self.up = _Pipe(self, "up", client, upstream, lines["up"])
        self.down = _Pipe(self, "down", upstream, client, lines["down"])
        self.masks: dict[int, int] = {client.fileno(): 0, upstream.fileno(): 0}

    def pipe(self, direction: Direction) -> _Pipe:
        return self.up if direction == "up" else self.down


class _Shaper:
    """The rate cap of one direction of the link, shared round-robin by every connection."""

    def __init__(self, profile: LinkProfile, now: float) -> None:
        self.bucket: TokenBucket | None = None
        self.unit = _release_unit(profile)
        self.window = _window_bytes(profile)
        self.pending: deque[_Pipe] = deque()
        self.set_profile(profile, now)

    def set_profile(self, profile: LinkProfile, now: float) -> None:
        rate = profile.rate_bytes_per_s
        if rate is not None and profile.burst_bytes < rate * _COARSE_BURST_S:
            log.warning(
                "burst_bytes=%d is under %.0f ms of traffic at %s: the emulator wakes at most "
                "every ~1 ms, so the achieved rate will fall short; raise burst to >= %d",
                profile.burst_bytes,
                _COARSE_BURST_S * 1000,
                profile.to_spec(),
                int(rate * _COARSE_BURST_S),
            )
        if rate is None:
            self.bucket = None
        elif self.bucket is None:
            self.bucket = TokenBucket(
                rate_bytes_per_s=rate, burst_bytes=profile.burst_bytes, now=now
            )
        else:
            self.bucket.set_rate(now, rate_bytes_per_s=rate, burst_bytes=profile.burst_bytes)
        self.unit = _release_unit(profile)
        self.window = _window_bytes(profile)

    def enqueue(self, pipe: _Pipe) -> None:
        if not pipe.queued and pipe.queue_bytes:
            pipe.queued = True
            self.pending.append(pipe)

    def release(self, now: float, touched: set[_Conn]) -> None:
        """Move what the bucket allows from the pipes' queues into their delay lines."""
        while self.pending:
            pipe = self.pending[0]
            if pipe.conn.closed or not pipe.queue_bytes:
                pipe.queued = False
                self.pending.popleft()
                continue
            if self.bucket is None:
                n_bytes = pipe.queue_bytes
            else:
                n_bytes = min(pipe.queue_bytes, self.unit)
                if self.bucket.seconds_until(now, n_bytes) > 0:
                    break
                n_bytes = self.bucket.take(now, n_bytes)
            pipe.line.push(now, pipe.take_front(n_bytes))
            touched.add(pipe.conn)
            self.pending.popleft()
            if pipe.queue_bytes:
                self.pending.append(pipe)
            else:
                pipe.queued = False

    def wake_at(self, now: float) -> float | None:
        if self.bucket is None or not self.pending:
            return None if not self.pending else now
        head = self.pending[0]
        need = min(max(head.queue_bytes, 1), self.unit)
        return now + self.bucket.seconds_until(now, need)
