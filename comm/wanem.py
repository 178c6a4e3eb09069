"""WAN link emulator: a userspace TCP proxy that makes a loopback hop behave like one WAN link.

This module owns link emulation for the demo, the tests and the benchmarks: a site connects to a
:class:`LinkEmulator` on 127.0.0.1 instead of to the coordinator, and every byte it sends ("up")
or receives ("down") passes a rate cap (a token bucket shared by all connections of the link),
then a one-way delay with seeded jitter, before it is forwarded. Bytes of one connection are never
reordered. Faults are injected deterministically from the test's own thread: :meth:`cut` resets
every connection now, :meth:`set_down` keeps the link down, :meth:`cut_after_bytes` resets every
connection after exactly ``n`` more forwarded bytes, :meth:`set_profile` changes the link live.

:class:`LinkProfile` is one direction's configuration; :func:`parse_profile` reads the
``"200mbit,20ms"`` form and :data:`PRESETS` names a few typical links. :class:`TokenBucket` and
:class:`DelayLine` are the pure building blocks (every method takes ``now``), tested with a fake
clock; the proxy loop only receives, ticks and sends.

The kernel-level alternative (network namespaces, veth, ``tc`` HTB) lives in ``comm.netns``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import random
import re
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)

Direction = Literal["up", "down"]
"""``"up"``: from the connecting side (a site) to the upstream (the coordinator); ``"down"``: back."""

DIRECTIONS: tuple[Direction, Direction] = ("up", "down")

DEFAULT_BURST_BYTES = 64 * 1024
"""Token bucket depth used when a profile does not set ``burst_bytes``."""

_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# Profiles


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """One direction of an emulated WAN link."""

    rate_bps: float | None
    """Rate cap in bits per second: the fill rate of a token bucket shared by every connection
    of the link in this direction. ``None`` means unlimited."""

    delay_ms: float = 0.0
    """One-way propagation delay in milliseconds added to every byte after the rate cap."""

    jitter_ms: float = 0.0
    """Each released chunk's delay is ``delay_ms`` plus a uniform draw from
    ``[-jitter_ms, +jitter_ms]`` (clipped at 0); a chunk never overtakes an earlier one."""

    burst_bytes: int = DEFAULT_BURST_BYTES
    """Token bucket depth in bytes: the most that can pass at once after the link was idle."""

    seed: int = 0
    """Seed of the jitter RNG; together with the connection's ordinal and the direction it fixes
    the sequence of jitter draws of that connection."""

    def __post_init__(self) -> None:
        if self.rate_bps is not None and not (
            isinstance(self.rate_bps, (int, float))
            and math.isfinite(self.rate_bps)
            and self.rate_bps > 0
        ):
            raise ValueError(
                f"rate_bps must be a finite number > 0, or None for unlimited; got {self.rate_bps!r}"
            )
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
        if (
            isinstance(self.burst_bytes, bool)
            or not isinstance(self.burst_bytes, int)
            or self.burst_bytes < 1
        ):
            raise ValueError(f"burst_bytes must be an integer >= 1; got {self.burst_bytes!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer; got {self.seed!r}")

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The rate cap in bytes per second, ``None`` when unlimited."""
        return None if self.rate_bps is None else self.rate_bps / 8.0

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0

    @property
    def jitter_s(self) -> float:
        return self.jitter_ms / 1000.0

    def to_spec(self) -> str:
        """The :func:`parse_profile` form of this profile; ``parse_profile(p.to_spec()) == p``."""
        items = [_format_rate(self.rate_bps)]
        if self.delay_ms:
            items.append(f"{_format_number(self.delay_ms)}ms")
        if self.jitter_ms:
            items.append(f"jitter={_format_number(self.jitter_ms)}ms")
        if self.burst_bytes != DEFAULT_BURST_BYTES:
            items.append(f"burst={self.burst_bytes}")
        if self.seed:
            items.append(f"seed={self.seed}")
        return ",".join(items)


UNLIMITED = LinkProfile(rate_bps=None)
"""No rate cap, no delay: a plain forwarding proxy (still useful for fault injection)."""

PRESETS: dict[str, LinkProfile] = {
    "eu": LinkProfile(rate_bps=200e6, delay_ms=20.0),
    "us": LinkProfile(rate_bps=50e6, delay_ms=80.0),
    "ap": LinkProfile(rate_bps=20e6, delay_ms=150.0),
    "lan": UNLIMITED,
}
"""Named links: rate cap and one-way delay per direction (round trip = twice the delay)."""

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_RATE_RE = re.compile(rf"({_NUMBER})\s*([kmgt]?bit)(?:/s)?")
_TIME_RE = re.compile(rf"({_NUMBER})\s*(us|ms|s)")
_SIZE_RE = re.compile(rf"({_NUMBER})\s*(b|k|kb|kib|m|mb|mib)?")
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_SIZE_UNITS = {
    None: 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
}
_EXAMPLES = "e.g. '200mbit,20ms', '50mbit,80ms,jitter=5ms', 'unlimited' or a preset"


def parse_profile(spec: str) -> LinkProfile:
    """Parse a link spec such as ``"200mbit,20ms"``, ``"50mbit,80ms,jitter=5ms"``, ``"unlimited"``.

    Comma-separated items: a rate (``<n>bit|kbit|mbit|gbit`` with decimal prefixes as in ``tc``,
    optionally ``/s``, or ``unlimited``), a one-way delay (``<n>us|ms|s``), and ``key=value`` items
    ``rate=``, ``delay=``, ``jitter=``, ``burst=`` (bytes; ``k``/``m`` suffixes are binary) and
    ``seed=``. A preset name (:data:`PRESETS`) may stand first, the other items then override it:
    ``"us,jitter=10ms"``. Case does not matter. Raises ``ValueError`` saying what is wrong.
    """
    text = spec.strip().lower()
    if not text:
        raise ValueError(f"bad link profile {spec!r}: empty; {_EXAMPLES} ({', '.join(PRESETS)})")
    base: LinkProfile | None = None
    fields: dict[str, Any] = {}

    def bad(reason: str) -> ValueError:
        return ValueError(f"bad link profile {spec!r}: {reason}; {_EXAMPLES}")

    def put(field_name: str, value: Any) -> None:
        if field_name in fields:
            raise bad(f"{field_name.split('_')[0]} given twice")
        fields[field_name] = value

    for index, raw_item in enumerate(text.split(",")):
        item = raw_item.strip()
        if not item:
            raise bad("empty item")
        if index == 0 and item in PRESETS:
            base = PRESETS[item]
            continue
        if "=" in item:
            key, _, value = (part.strip() for part in item.partition("="))
            if key == "rate":
                put("rate_bps", _parse_rate(value, bad))
            elif key == "delay":
                put("delay_ms", _parse_time_ms(value, bad))
            elif key == "jitter":
                put("jitter_ms", _parse_time_ms(value, bad))
            elif key == "burst":
                put("burst_bytes", _parse_size(value, bad))
            elif key == "seed":
                if not re.fullmatch(r"[+-]?\d+", value):
                    raise bad(f"seed must be an integer, got {value!r}")
                put("seed", int(value))
            else:
                raise bad(f"unknown key {key!r} (known: rate, delay, jitter, burst, seed)")
        elif item == "unlimited" or _RATE_RE.fullmatch(item):
            put("rate_bps", _parse_rate(item, bad))
        elif _TIME_RE.fullmatch(item):
            put("delay_ms", _parse_time_ms(item, bad))
        elif item in PRESETS:
            raise bad(f"preset {item!r} must come first")
        elif re.fullmatch(rf"{_NUMBER}\s*[kmgt]?(?:bps|b/s|byte/s)", item):
            raise bad(f"{item!r} is ambiguous: write the rate in bits, e.g. '200mbit'")
        else:
            raise bad(f"cannot read {item!r} as a rate, a delay or key=value")
    if base is None and "rate_bps" not in fields:
        raise bad("no rate given (write 'unlimited' for no rate cap)")
    try:
        if base is None:
            return LinkProfile(**fields)
        return dataclasses.replace(base, **fields)
    except ValueError as exc:
        raise ValueError(f"bad link profile {spec!r}: {exc}") from None


def _parse_rate(value: str, bad: Callable[[str], ValueError]) -> float | None:
    if value == "unlimited":
        return None
    match = _RATE_RE.fullmatch(value)
    if match is None:
        raise bad(f"cannot read {value!r} as a rate such as '200mbit' or 'unlimited'")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def _parse_time_ms(value: str, bad: Callable[[str], ValueError]) -> float:
    match = _TIME_RE.fullmatch(value)
    if match is None:
        raise bad(f"cannot read {value!r} as a time such as '20ms'")
    return float(match.group(1)) * _TIME_UNITS_MS[match.group(2)]


def _parse_size(value: str, bad: Callable[[str], ValueError]) -> int:
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise bad(f"cannot read {value!r} as a size in bytes such as '64k'")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size != int(size):
        raise bad(f"burst must be a whole number of bytes, got {value!r}")
    return int(size)


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _format_rate(rate_bps: float | None) -> str:
    if rate_bps is None:
        return "unlimited"
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        count = rate_bps / factor
        if count.is_integer() and int(count) * factor == rate_bps:
            return f"{int(count)}{unit}"
    return f"{_format_number(rate_bps)}bit"


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


_LISTENER = "listener"
_WAKER = "waker"


class LinkEmulator:
    """A TCP proxy on ``listen_host`` that emulates one WAN link to ``upstream_host:upstream_port``.

    Lifecycle: construct, :meth:`start` (binds and runs the proxy loop in a background thread),
    :meth:`close` (closes every socket and joins the thread); or use it as a context manager.
    ``profile`` applies to both directions unless ``down_profile`` is given. Control methods may
    be called from any thread; they return once the proxy loop has applied them.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        profile: LinkProfile = UNLIMITED,
        down_profile: LinkProfile | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        name: str = "link",
    ) -> None:
        if not 0 < upstream_port < 65536:
            raise ValueError(f"upstream_port must be in 1..65535; got {upstream_port!r}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"listen_port must be in 0..65535; got {listen_port!r}")
        self.name = name
        self._upstream = (upstream_host, upstream_port)
        self._listen = (listen_host, listen_port)
        self._profiles: dict[Direction, LinkProfile] = {
            "up": profile,
            "down": profile if down_profile is None else down_profile,
        }
        self._clock: Callable[[], float] = time.monotonic
        self._bytes: dict[Direction, int] = {"up": 0, "down": 0}
        self._cut_budget: dict[Direction, int | None] = {"up": None, "down": None}
        self._down = False
        self._num_accepted = 0
        self._num_refused = 0
        self._num_cuts = 0
        self._conns: dict[int, _Conn] = {}
        self._by_fd: dict[int, tuple[_Conn, socket.socket]] = {}
        self._lined: set[_Pipe] = set()
        self._shapers: dict[Direction, _Shaper] = {}
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._upstream_addr: tuple[socket.AddressFamily, Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._lock = threading.Lock()
        self._commands: deque[tuple[Callable[[float], Any], _Reply]] = deque()
        self._port = 0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the listening socket and start the proxy thread."""
        if self._thread is not None or self._closed:
            raise RuntimeError(f"[link={self.name}] start() called twice or after close()")
        family, _, _, _, address = socket.getaddrinfo(*self._upstream, type=socket.SOCK_STREAM)[0]
        self._upstream_addr = (family, address)
        listen_family = socket.AF_INET6 if ":" in self._listen[0] else socket.AF_INET
        listener = socket.create_server(self._listen, family=listen_family, backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKER)
        now = self._clock()
        self._shapers = {d: _Shaper(self._profiles[d], now) for d in DIRECTIONS}
        self._thread = threading.Thread(target=self._serve, name=f"wanem-{self.name}", daemon=True)
        self._thread.start()
        log.info(
            "[link=%s port=%d] forwarding to %s:%d up=%s down=%s",
            self.name,
            self._port,
            *self._upstream,
            self._profiles["up"].to_spec(),
            self._profiles["down"].to_spec(),
        )

    def close(self) -> None:
        """Stop the proxy loop, close every socket and join the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._stop = True
        self._wake()
        thread.join(timeout=10.0)
        assert not thread.is_alive(), "proxy thread did not stop"
        with self._lock:
            pending = list(self._commands)
            self._commands.clear()
        for _, reply in pending:
            reply.fail(RuntimeError(f"[link={self.name}] closed"))

    def __enter__(self) -> LinkEmulator:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- observation ----------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound listening port (after :meth:`start`)."""
        if self._thread is None:
            raise RuntimeError(f"[link={self.name}] not started")
        return self._port

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` to connect a ZeroMQ socket to."""
        return f"tcp://{self._listen[0]}:{self.port}"

    @property
    def bytes_up(self) -> int:
        """Bytes forwarded to the upstream so far."""
        return self._bytes["up"]

    @property
    def bytes_down(self) -> int:
        """Bytes forwarded back to the connecting side so far."""
        return self._bytes["down"]

    def bytes_forwarded(self, direction: Direction) -> int:
        return self._bytes[direction]

    @property
    def num_connections(self) -> int:
        """Connections open right now."""
        return len(self._conns)

    @property
    def num_accepted(self) -> int:
        """Connections accepted and forwarded so far (not counting those refused while down)."""
        return self._num_accepted

    @property
    def num_refused(self) -> int:
        """Connections dropped on arrival because the link was down."""
        return self._num_refused

    @property
    def num_cuts(self) -> int:
        """Cuts performed so far (by :meth:`cut`, :meth:`set_down` or :meth:`cut_after_bytes`)."""
        return self._num_cuts

    def profile(self, direction: Direction) -> LinkProfile:
        return self._profiles[direction]

    @property
    def is_down(self) -> bool:
        return self._down

    # -- control --------------------------------------------------------------------------

    def set_profile(self, profile: LinkProfile, direction: Direction | None = None) -> None:
        """Change the link in one or both directions from now on.

        Bytes already in the delay line keep their due time; later bytes never overtake them.
        A new seed applies to connections opened afterwards.
        """

        def apply(now: float) -> None:
            for d in DIRECTIONS if direction is None else (direction,):
                self._profiles[d] = profile
                if d in self._shapers:
                    self._shapers[d].set_profile(profile, now)
                for conn in self._conns.values():
                    line = conn.pipe(d).line
                    line.delay_s, line.jitter_s = profile.delay_s, profile.jitter_s
            log.info("[link=%s] profile %s: %s", self.name, direction or "both", profile.to_spec())

        self._call(apply)

    def cut(self) -> int:
        """Reset every current connection now; both sides see a reset. Returns how many."""
        return self._call(lambda now: self._cut_all("cut()"))

    def set_down(self, down: bool) -> None:
        """Take the link down (cut current connections, reset new ones on arrival) or up."""

        def apply(now: float) -> None:
            self._down = down
            log.info("[link=%s] link %s", self.name, "down" if down else "up")
            if down:
                self._cut_all("set_down(True)")

        self._call(apply)

    def cut_after_bytes(self, n_bytes: int, direction: Direction) -> None:
        """Cut every connection once exactly ``n_bytes`` more bytes have been forwarded in
        ``direction`` (counted over all connections). One-shot; re-arming replaces the count."""
        if n_bytes < 1:
            raise ValueError(f"n_bytes must be >= 1; got {n_bytes!r}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'up' or 'down'; got {direction!r}")

        def apply(now: float) -> None:
            self._cut_budget[direction] = n_bytes

        self._call(apply)

    # -- proxy loop -----------------------------------------------------------------------

    def _call(self, fn: Callable[[float], _T]) -> _T:
        thread = self._thread
        if thread is None or threading.current_thread() is thread:
            return fn(self._clock())
        if self._closed or not thread.is_alive():
            raise RuntimeError(f"[link={self.name}] not running")
        reply: _Reply = _Reply()
        with self._lock:
            self._commands.append((fn, reply))
        self._wake()
        result: _T = reply.wait(timeout_s=10.0)
        return result

    def _wake(self) -> None:
        if self._wake_w is not None:
            # BlockingIOError: a wake-up is already pending; OSError: the loop is gone.
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _serve(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stop:
                timeout = self._timeout(self._clock())
                events = sel.select(timeout)
                now = self._clock()
                touched: set[_Conn] = set()
                for key, mask in events:
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKER:
                        self._drain_waker()
                    else:
                        self._on_event(key.fd, mask, touched)
                self._run_commands()
                self._tick(now, touched)
        except Exception:
            log.exception("[link=%s port=%d] proxy loop failed", self.name, self._port)
        finally:
            self._shutdown()

    def _timeout(self, now: float) -> float | None:
        wake: float | None = None
        for shaper in self._shapers.values():
            at = shaper.wake_at(now)
            if at is not None and (wake is None or at < wake):
                wake = at
        for pipe in self._lined:
            due = pipe.line.next_due()
            if due is not None and (wake is None or due < wake):
                wake = due
        return None if wake is None else max(0.0, wake - now)

    def _tick(self, now: float, touched: set[_Conn]) -> None:
        for direction in DIRECTIONS:
            self._shapers[direction].release(now, touched)
        for pipe in self._lined:
            due = pipe.line.next_due()
            if due is not None and due <= now:
                touched.add(pipe.conn)
        for conn in touched:
            if not conn.closed:
                self._flush(conn.up, now)
            if not conn.closed:
                self._flush(conn.down, now)
        if any(budget == 0 for budget in self._cut_budget.values()):
            self._cut_all("cut_after_bytes")
            for direction in DIRECTIONS:
                if self._cut_budget[direction] == 0:
                    self._cut_budget[direction] = None
        for conn in touched:
            if not conn.closed:
                self._finish_or_update(conn)

    def _run_commands(self) -> None:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for fn, reply in commands:
            try:
                reply.set(fn(self._clock()))
            except Exception as exc:  # handed to the caller's thread
                reply.fail(exc)

    def _drain_waker(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None and self._upstream_addr is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("[link=%s port=%d] accept failed: %s", self.name, self._port, exc)
                return
            if self._down:
                self._num_refused += 1
                _reset_close(client)
                continue
            family, address = self._upstream_addr
            upstream = socket.socket(family, socket.SOCK_STREAM)
            for sock in (client, upstream):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = upstream.connect_ex(address)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                _reset_close(client)
                upstream.close()
                continue
            conn = _Conn(self._num_accepted, client, upstream, self._profiles)
            self._num_accepted += 1
            conn.connected = err == 0
            self._conns[conn.conn_id] = conn
            self._by_fd[client.fileno()] = (conn, client)
            self._by_fd[upstream.fileno()] = (conn, upstream)
            self._update_interest(conn)

    def _on_event(self, fd: int, mask: int, touched: set[_Conn]) -> None:
        entry = self._by_fd.get(fd)
        if entry is None:
            return
        conn, sock = entry
        if conn.closed:
            return
        touched.add(conn)
        if sock is conn.upstream and not conn.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._abort(conn)
                return
            conn.connected = True
            return
        if mask & selectors.EVENT_READ:
            self._read(conn.up if sock is conn.client else conn.down)

    def _read(self, pipe: _Pipe) -> None:
        shaper = self._shapers[pipe.direction]
        budget = min(shaper.window - pipe.buffered, _READ_BUDGET_BYTES)
        while budget > 0 and not pipe.src_eof:
            want = min(budget, _RECV_BYTES)
            try:
                data = pipe.src.recv(want)
            except BlockingIOError:
                break
            except OSError:
                self._peer_failed(pipe.conn, pipe.src)
                return
            if not data:
                pipe.src_eof = True
                break
            pipe.queue.append(memoryview(data))
            pipe.queue_bytes += len(data)
            budget -= len(data)
            if len(data) < want:
                break  # drained; skip the extra recv that would only say EAGAIN
        shaper.enqueue(pipe)

    def _flush(self, pipe: _Pipe, now: float) -> None:
        due = pipe.line.pop_due(now)
        if due:
            pipe.out.extend(due)
            pipe.out_bytes += sum(len(c) for c in due)
        if pipe.line.nbytes:
            self._lined.add(pipe)
        else:
            self._lined.discard(pipe)
        if pipe.direction == "up" and not pipe.conn.connected:
            return
        direction = pipe.direction
        while pipe.out:
            budget = self._cut_budget[direction]
            if budget == 0:
                return
            chunk = pipe.out[0]
            view = chunk if budget is None or budget >= len(chunk) else chunk[:budget]
            try:
                sent = pipe.dst.send(view)
            except BlockingIOError:
                return
            except OSError:
                self._peer_failed(pipe.conn, pipe.dst)
                return
            self._bytes[direction] += sent
            pipe.out_bytes -= sent
            if budget is not None:
                self._cut_budget[direction] = budget - sent
            if sent == len(chunk):
                pipe.out.popleft()
            else:
                pipe.out[0] = chunk[sent:]
                if sent < len(view):
                    return  # the socket buffer is full; wait for writability
        if pipe.src_eof and not pipe.dst_shut and pipe.buffered == 0:
            if pipe.src_reset:
                self._abort(pipe.conn)  # everything sent before the reset arrived; now the reset
                return
            try:
                pipe.dst.shutdown(socket.SHUT_WR)
            except OSError:
                self._peer_failed(pipe.conn, pipe.dst)
                return
            pipe.dst_shut = True

    def _finish_or_update(self, conn: _Conn) -> None:
        if conn.up.dst_shut and conn.down.dst_shut:
            # Both sides ended their stream and everything was delivered: close politely.
            self._forget(conn)
            conn.client.close()
            conn.upstream.close()
            return
        self._update_interest(conn)

    def _update_interest(self, conn: _Conn) -> None:
        sel = self._sel
        assert sel is not None
        read, write = selectors.EVENT_READ, selectors.EVENT_WRITE
        up_window = self._shapers["up"].window
        down_window = self._shapers["down"].window
        client_mask = 0
        if not conn.up.src_eof and conn.up.buffered < up_window:
            client_mask |= read
        if conn.down.out:
            client_mask |= write
        if not conn.connected:
            upstream_mask = write
        else:
            upstream_mask = 0
            if not conn.down.src_eof and conn.down.buffered < down_window:
                upstream_mask |= read
            if conn.up.out:
                upstream_mask |= write
        for sock, mask in ((conn.client, client_mask), (conn.upstream, upstream_mask)):
            fd = sock.fileno()
            old = conn.masks[fd]
            if mask == old:
                continue
            if old == 0:
                sel.register(sock, mask)
            elif mask == 0:
                sel.unregister(sock)
            else:
                sel.modify(sock, mask)
            conn.masks[fd] = mask

    def _forget(self, conn: _Conn) -> None:
        conn.closed = True
        sel = self._sel
        assert sel is not None
        for sock in (conn.client, conn.upstream):
            fd = sock.fileno()
            if conn.masks.get(fd):
                sel.unregister(sock)
                conn.masks[fd] = 0
            self._by_fd.pop(fd, None)
        for pipe in (conn.up, conn.down):
            self._drop(pipe)
        self._conns.pop(conn.conn_id, None)

    def _drop(self, pipe: _Pipe) -> None:
        """Discard every byte of ``pipe``: queued, in the delay line, ready to write."""
        self._lined.discard(pipe)
        pipe.line.clear()
        pipe.queue.clear()
        pipe.queue_bytes = 0
        pipe.out.clear()
        pipe.out_bytes = 0

    def _peer_failed(self, conn: _Conn, sock: socket.socket) -> None:
        """One end of ``conn`` reset or failed. As on a real network, what it sent before is on
        the link and still reaches the other end, followed by the reset; what was on its way to
        it is lost, and nothing more is read from the other end."""
        if conn.closed:
            return
        sent_by = conn.up if sock is conn.client else conn.down
        lost = conn.down if sent_by is conn.up else conn.up
        sent_by.src_eof = sent_by.src_reset = True
        lost.src_eof = lost.dst_shut = True
        self._drop(lost)
        if sent_by.buffered == 0 or sent_by.dst_shut:
            self._abort(conn)
            return
        self._update_interest(conn)

    def _abort(self, conn: _Conn) -> None:
        if conn.closed:
            return
        self._forget(conn)
        _reset_close(conn.client)
        _reset_close(conn.upstream)

    def _cut_all(self, reason: str) -> int:
        conns = list(self._conns.values())
        self._num_cuts += 1  # before the resets, so a peer that saw one also sees the count
        for conn in conns:
            self._abort(conn)
        log.info(
            "[link=%s port=%d] %s: cut %d connection(s)", self.name, self._port, reason, len(conns)
        )
        return len(conns)

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._abort(conn)
        if self._sel is not None:
            self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()


class _Reply:
    """A one-shot result handed from the proxy thread to the caller of a control method."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def wait(self, *, timeout_s: float) -> Any:
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"proxy loop did not answer within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value
