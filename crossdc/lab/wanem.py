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

The kernel-level alternative (network namespaces, veth, ``tc`` HTB) lives in ``crossdc.lab.netns``.
The profiles are in ``crossdc.lab.profiles``, the token bucket, delay line and per-connection
shaping in ``crossdc.lab.shaping``, the proxy thread in ``crossdc.lab.proxy_io`` and
``crossdc.lab.proxy_loop``.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading

from crossdc.lab.profiles import DIRECTIONS, Direction, LinkProfile
from crossdc.lab.proxy_io import _LISTENER, _WAKER
from crossdc.lab.proxy_loop import _ProxyLoop
from crossdc.lab.shaping import _Shaper

log = logging.getLogger(__name__)


class LinkEmulator(_ProxyLoop):
    """A TCP proxy on ``listen_host`` that emulates one WAN link to ``upstream_host:upstream_port``.

    Lifecycle: construct, :meth:`start` (binds and runs the proxy loop in a background thread),
    :meth:`close` (closes every socket and joins the thread); or use it as a context manager.
    ``profile`` applies to both directions unless ``down_profile`` is given. Control methods may
    be called from any thread; they return once the proxy loop has applied them.
    """

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
