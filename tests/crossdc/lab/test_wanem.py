"""Tests for crossdc.lab (the WAN emulator): profiles and their parser, the pure token bucket and delay line, and the
proxy itself over real loopback TCP (integrity, rate cap, delay, cuts, ZeroMQ reconnect)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from crossdc.lab.profiles import DEFAULT_BURST_BYTES, PRESETS, UNLIMITED, LinkProfile, parse_profile
from crossdc.lab.shaping import DelayLine, TokenBucket
from crossdc.lab.wanem import LinkEmulator

WAIT_S = 10.0  # upper bound on waiting for an event that must happen; never a speed assertion


# --------------------------------------------------------------------------------------------
# Loopback servers standing in for the coordinator


class _ConnRecord:
    def __init__(self) -> None:
        self.data = bytearray()
        self.last_byte_at = 0.0
        self.reset = False
        self.ended = threading.Event()


class _Server:
    """A loopback TCP server: ``echo`` returns what it reads, ``sink`` keeps it, ``source``
    waits for one byte ``g`` then sends ``payload`` and closes. One thread per connection; ``close`` joins them all."""

    def __init__(self, mode: str, payload: bytes = b"") -> None:
        self.mode = mode
        self.payload = payload
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self.records: list[_ConnRecord] = []
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._accepted = threading.Condition()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(WAIT_S)
            record = _ConnRecord()
            thread = threading.Thread(target=self._handle, args=(sock, record), daemon=True)
            with self._accepted:
                self.records.append(record)
                self._socks.append(sock)
                self._threads.append(thread)
                self._accepted.notify_all()
            thread.start()

    def _handle(self, sock: socket.socket, record: _ConnRecord) -> None:
        try:
            if self.mode == "source":
                assert sock.recv(1) == b"g"  # the client is surely connected by now
                sock.sendall(self.payload)
                sock.shutdown(socket.SHUT_WR)
            while True:
                data = sock.recv(1 << 20)
                if not data:
                    break
                record.data += data
                record.last_byte_at = time.monotonic()
                if self.mode == "echo":
                    sock.sendall(data)
            if self.mode == "echo":
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            record.reset = True
        finally:
            record.ended.set()

    def record(self, index: int) -> _ConnRecord:
        with self._accepted:
            assert self._accepted.wait_for(lambda: len(self.records) > index, WAIT_S)
            return self.records[index]

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(WAIT_S)
        self.listener.close()
        with self._accepted:
            socks, threads = list(self._socks), list(self._threads)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(WAIT_S)
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def _server(mode: str, payload: bytes = b"") -> Iterator[_Server]:
    server = _Server(mode, payload)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def echo() -> Iterator[_Server]:
    with _server("echo") as server:
        yield server


@pytest.fixture
def sink() -> Iterator[_Server]:
    with _server("sink") as server:
        yield server


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, n_bytes: int) -> bytes:
    buf = bytearray()
    while len(buf) < n_bytes:
        data = sock.recv(n_bytes - len(buf))
        assert data, f"connection ended after {len(buf)} of {n_bytes} bytes"
        buf += data
    return bytes(buf)


def _recv_until_end(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the peer sends, and whether the stream ended in a reset."""
    buf = bytearray()
    try:
        while data := sock.recv(1 << 20):
            buf += data
    except ConnectionResetError:
        return bytes(buf), True
    return bytes(buf), False


def _assert_cut(sock: socket.socket) -> None:
    """The emulator ended this connection: a reset, or at worst an end of stream."""
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def _assert_dropped_on_arrival(port: int) -> None:
    """A new connection is reset by the emulator (possibly before ``connect`` even returns)."""
    try:
        sock = _connect(port)
    except ConnectionResetError:
        return
    with sock:
        _assert_cut(sock)


def _payload(n_bytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


def _echo_rtt(sock: socket.socket) -> float:
    start = time.monotonic()
    sock.sendall(b"p")
    assert _recv_exact(sock, 1) == b"p"
    return time.monotonic() - start


# --------------------------------------------------------------------------------------------
# Profiles and parsing


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("200mbit,20ms", LinkProfile(rate_bps=200e6, delay_ms=20)),
        ("50mbit,80ms,jitter=5ms", LinkProfile(rate_bps=50e6, delay_ms=80, jitter_ms=5)),
        ("unlimited", UNLIMITED),
        (" 200Mbit/s , 20ms ", LinkProfile(rate_bps=200e6, delay_ms=20)),
        ("1500kbit,500us", LinkProfile(rate_bps=1.5e6, delay_ms=0.5)),
        ("unlimited,0.25s", LinkProfile(rate_bps=None, delay_ms=250)),
        (
            "rate=1gbit,delay=1.5ms,burst=256k,seed=7",
            LinkProfile(rate_bps=1e9, delay_ms=1.5, burst_bytes=256 * 1024, seed=7),
        ),
        ("eu", LinkProfile(rate_bps=200e6, delay_ms=20)),
        ("us,jitter=10ms", LinkProfile(rate_bps=50e6, delay_ms=80, jitter_ms=10)),
        ("ap,30ms", LinkProfile(rate_bps=20e6, delay_ms=30)),
        ("lan", UNLIMITED),
    ],
)
def test_parse_profile_forms(spec: str, expected: LinkProfile) -> None:
    assert parse_profile(spec) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("", "empty"),
        ("fast", "cannot read 'fast'"),
        ("200mbps,20ms", "ambiguous"),
        ("200mbit,20ms,30ms", "delay given twice"),
        ("200mbit,unlimited", "rate given twice"),
        ("20ms", "no rate"),
        ("200mbit,jitter=-5ms", "cannot read '-5ms'"),
        ("200mbit,jitter=5", "cannot read '5'"),
        ("200mbit,color=red", "unknown key 'color'"),
        ("200mbit,,20ms", "empty item"),
        ("0mbit", "rate_bps must be"),
        ("200mbit,burst=0", "burst_bytes must be"),
        ("200mbit,burst=1.5", "whole number"),
        ("200mbit,seed=x", "seed must be an integer"),
        ("200mbit,eu", "preset 'eu' must come first"),
    ],
)
def test_parse_profile_errors(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match="bad link profile") as info:
        parse_profile(spec)
    assert repr(spec) in str(info.value)
    assert reason in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"rate_bps": 0}, "rate_bps"),
        ({"rate_bps": -1.0}, "rate_bps"),
        ({"rate_bps": math.inf}, "rate_bps"),
        ({"rate_bps": None, "delay_ms": -1}, "delay_ms"),
        ({"rate_bps": None, "delay_ms": math.nan}, "delay_ms"),
        ({"rate_bps": None, "jitter_ms": -0.5}, "jitter_ms"),
        ({"rate_bps": None, "burst_bytes": 0}, "burst_bytes"),
        ({"rate_bps": None, "burst_bytes": 1.5}, "burst_bytes"),
        ({"rate_bps": None, "seed": "7"}, "seed"),
    ],
)
def test_profile_validation_names_the_field(kwargs: dict[str, object], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        LinkProfile(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_presets() -> None:
    assert set(PRESETS) >= {"eu", "us", "ap", "lan"}
    assert PRESETS["eu"].rate_bps == 200e6 and PRESETS["eu"].delay_ms == 20
    assert PRESETS["us"].rate_bps == 50e6 and PRESETS["us"].delay_ms == 80
    assert PRESETS["ap"].rate_bps == 20e6 and PRESETS["ap"].delay_ms == 150
    assert PRESETS["lan"].rate_bps is None and PRESETS["lan"].delay_ms == 0
    assert PRESETS["eu"].rate_bytes_per_s == 25e6


_rates = st.one_of(
    st.none(),
    st.integers(1, 10**12).map(float),
    st.floats(1e-3, 1e13, allow_nan=False, allow_infinity=False),
)
_times = st.one_of(st.integers(0, 10**5).map(float), st.floats(0, 1e5, allow_nan=False))


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    rate=_rates,
    delay=_times,
    jitter=_times,
    burst=st.one_of(st.just(DEFAULT_BURST_BYTES), st.integers(1, 1 << 40)),
    seed=st.integers(-(2**63), 2**63),
)
def test_profile_spec_round_trips(
    rate: float | None, delay: float, jitter: float, burst: int, seed: int
) -> None:
    profile = LinkProfile(
        rate_bps=rate, delay_ms=delay, jitter_ms=jitter, burst_bytes=burst, seed=seed
    )
    assert parse_profile(profile.to_spec()) == profile


# --------------------------------------------------------------------------------------------
# Pure building blocks, driven by a fake clock


@pytest.mark.timeout(60)
def test_token_bucket_golden_numbers() -> None:
    bucket = TokenBucket(rate_bytes_per_s=1000.0, burst_bytes=500, now=0.0)
    assert bucket.take(0.0, 10_000) == 500  # starts full
    assert bucket.take(0.0, 10_000) == 0
    assert bucket.take(0.1, 10_000) == 100
    assert bucket.seconds_until(0.1, 250) == pytest.approx(0.25)
    assert bucket.take(0.35, 250) == 250
    assert bucket.take(100.0, 10_000) == 500  # idle time refills only up to the depth
    bucket.set_rate(100.0, rate_bytes_per_s=10.0, burst_bytes=5)
    assert bucket.take(101.0, 10_000) == 5


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(1.0, 1e9),
    burst=st.integers(1, 1 << 20),
    steps=st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(0, 1 << 21)), max_size=40),
)
def test_token_bucket_never_exceeds_its_bound(
    rate: float, burst: int, steps: list[tuple[float, int]]
) -> None:
    bucket = TokenBucket(rate_bytes_per_s=rate, burst_bytes=burst, now=0.0)
    now = 0.0
    log: list[tuple[float, int]] = []
    for dt, want in steps:
        now += dt
        taken = bucket.take(now, want)
        assert 0 <= taken <= want
        log.append((now, taken))
    # Over every interval [t_i, t_j]: taken <= burst + rate * (t_j - t_i).
    for i, (t_i, _) in enumerate(log):
        total = 0
        for t_j, taken in log[i:]:
            total += taken
            bound = burst + rate * (t_j - t_i)
            assert total <= bound * (1 + 1e-9) + 1


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    delay_s=st.floats(0.0, 1.0),
    jitter_s=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
    gaps=st.lists(st.floats(0.0, 0.1), min_size=1, max_size=40),
)
def test_delay_line_delays_and_never_reorders(
    delay_s: float, jitter_s: float, seed: int, gaps: list[float]
) -> None:
    def run() -> tuple[list[float], list[bytes]]:
        line = DelayLine(delay_s=delay_s, jitter_s=jitter_s, rng=random.Random(seed))
        now = 0.0
        dues: list[float] = []
        popped: list[bytes] = []
        for index, gap in enumerate(gaps):
            now += gap
            chunk = memoryview(index.to_bytes(2, "big"))
            due = line.push(now, [chunk])
            assert due >= now + max(0.0, delay_s - jitter_s)
            assert due <= max(dues[-1] if dues else 0.0, now + delay_s + jitter_s)
            dues.append(due)
            popped += [bytes(c) for c in line.pop_due(now)]
        popped += [bytes(c) for c in line.pop_due(math.inf)]
        assert line.nbytes == 0 and line.next_due() is None
        return dues, popped

    dues, popped = run()
    assert dues == sorted(dues)
    assert popped == [i.to_bytes(2, "big") for i in range(len(gaps))]
    assert run() == (dues, popped)  # the seed fixes the jitter draws


# --------------------------------------------------------------------------------------------
# The proxy over loopback TCP


@pytest.fixture(scope="module")
def jittery_link() -> Iterator[tuple[LinkEmulator, _Server]]:
    """An echo upstream behind a fast link whose shaper splits reads and whose jitter would
    reorder chunks if the delay line allowed it."""
    profile = parse_profile("1gbit,1ms,jitter=1ms,burst=256k,seed=3")
    with _server("echo") as server, LinkEmulator("127.0.0.1", server.port, profile=profile) as emu:
        yield emu, server


@pytest.mark.timeout(60)
@settings(max_examples=25, deadline=None)
@given(chunk_sizes=st.lists(st.integers(1, 100_000), min_size=1, max_size=10))
def test_bytes_arrive_intact_and_in_order(
    jittery_link: tuple[LinkEmulator, _Server], chunk_sizes: list[int]
) -> None:
    emu, _ = jittery_link
    payload = _payload(sum(chunk_sizes), seed=len(chunk_sizes))
    up_before, down_before = emu.bytes_up, emu.bytes_down
    with _connect(emu.port) as sock:

        def send() -> None:
            offset = 0
            for size in chunk_sizes:
                sock.sendall(payload[offset : offset + size])
                offset += size
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        echoed, was_reset = _recv_until_end(sock)
        sender.join(WAIT_S)
    assert not was_reset
    assert echoed == payload
    assert emu.bytes_up - up_before == len(payload)
    assert emu.bytes_down - down_before == len(payload)


@pytest.mark.timeout(60)
def test_large_transfer_through_unlimited_link(sink: _Server) -> None:
    payload = _payload(16 << 20)
    with LinkEmulator("127.0.0.1", sink.port, profile=PRESETS["lan"]) as emu:
        with _connect(emu.port) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            record = sink.record(0)
            assert record.ended.wait(WAIT_S)
        assert emu.bytes_up == len(payload)
    assert hashlib.sha256(record.data).digest() == hashlib.sha256(payload).digest()


@pytest.mark.timeout(60)
def test_rate_cap_obeys_the_token_bucket_bound(sink: _Server) -> None:
    rate_bps = 20e6
    profile = LinkProfile(rate_bps=rate_bps, burst_bytes=16 * 1024)
    payload = _payload(1 << 20)
    with LinkEmulator("127.0.0.1", sink.port, profile=profile) as emu:
        start = time.monotonic()  # before the first byte can reach the bucket
        with _connect(emu.port) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            record = sink.record(0)
            assert record.ended.wait(WAIT_S)
        assert emu.bytes_up == len(payload)
    assert bytes(record.data) == payload
    # The bucket lets at most burst + rate * t bytes through in any interval of length t.
    min_elapsed_s = (len(payload) - profile.burst_bytes) / (rate_bps / 8)
    assert record.last_byte_at - start >= min_elapsed_s


@pytest.mark.timeout(60)
def test_rate_cap_is_shared_by_all_connections(sink: _Server) -> None:
    rate_bps = 20e6
    profile = LinkProfile(rate_bps=rate_bps, burst_bytes=16 * 1024)
    payloads = [_payload(384 * 1024, seed=i) for i in range(2)]
    with LinkEmulator("127.0.0.1", sink.port, profile=profile) as emu:
        start = time.monotonic()
        socks = [_connect(emu.port) for _ in payloads]
        try:
            senders = [
                threading.Thread(target=s.sendall, args=(p,))
                for s, p in zip(socks, payloads, strict=True)
            ]
            for thread in senders:
                thread.start()
            for thread in senders:
                thread.join(WAIT_S)
            for sock in socks:
                sock.shutdown(socket.SHUT_WR)
            records = [sink.record(i) for i in range(len(payloads))]
            for record in records:
                assert record.ended.wait(WAIT_S)
        finally:
            for sock in socks:
                sock.close()
    assert sorted(bytes(r.data) for r in records) == sorted(payloads)
    total = sum(len(p) for p in payloads)
    min_elapsed_s = (total - profile.burst_bytes) / (rate_bps / 8)
    assert max(r.last_byte_at for r in records) - start >= min_elapsed_s


@pytest.mark.timeout(60)
def test_delay_is_applied_per_direction(echo: _Server) -> None:
    up = LinkProfile(rate_bps=None, delay_ms=30)
    down = LinkProfile(rate_bps=None, delay_ms=20)
    with LinkEmulator("127.0.0.1", echo.port, profile=up, down_profile=down) as emu:
        assert emu.profile("up") == up and emu.profile("down") == down
        with _connect(emu.port) as sock:
            for _ in range(3):
                assert _echo_rtt(sock) >= 0.050


@pytest.mark.timeout(60)
def test_set_profile_changes_a_live_link(echo: _Server) -> None:
    with LinkEmulator("127.0.0.1", echo.port) as emu, _connect(emu.port) as sock:
        _echo_rtt(sock)
        emu.set_profile(LinkProfile(rate_bps=None, delay_ms=40))
        assert _echo_rtt(sock) >= 0.080
        emu.set_profile(LinkProfile(rate_bps=None, delay_ms=0), direction="down")
        assert emu.profile("up").delay_ms == 40 and emu.profile("down").delay_ms == 0
        assert _echo_rtt(sock) >= 0.040


@pytest.mark.timeout(60)
def test_cut_resets_live_connections_and_new_ones_work(echo: _Server) -> None:
    with LinkEmulator("127.0.0.1", echo.port) as emu:
        with _connect(emu.port) as first:
            _echo_rtt(first)
            assert emu.num_connections == 1
            assert emu.cut() == 1
            assert emu.num_connections == 0 and emu.num_cuts == 1
            _assert_cut(first)
        assert echo.record(0).ended.wait(WAIT_S)  # the upstream side was cut as well
        with _connect(emu.port) as second:
            _echo_rtt(second)
        assert emu.num_accepted == 2


@pytest.mark.timeout(60)
def test_set_down_drops_connections_until_up_again(echo: _Server) -> None:
    with LinkEmulator("127.0.0.1", echo.port) as emu:
        with _connect(emu.port) as live:
            _echo_rtt(live)
            emu.set_down(True)
            assert emu.is_down and emu.num_cuts == 1
            _assert_cut(live)
        _assert_dropped_on_arrival(emu.port)
        assert emu.num_refused == 1 and emu.num_accepted == 1
        emu.set_down(False)
        with _connect(emu.port) as again:
            _echo_rtt(again)


@pytest.mark.timeout(60)
def test_cut_after_bytes_up_cuts_at_exactly_n(sink: _Server) -> None:
    n_bytes = 100_000
    payload = _payload(1 << 20)
    with LinkEmulator("127.0.0.1", sink.port) as emu:
        emu.cut_after_bytes(n_bytes, "up")
        with _connect(emu.port) as sock:
            with contextlib.suppress(ConnectionError):
                sock.sendall(payload)  # the cut may interrupt the send
            record = sink.record(0)
            assert record.ended.wait(WAIT_S)
            _assert_cut(sock)
        assert record.reset
        assert bytes(record.data) == payload[:n_bytes]
        assert emu.bytes_up == n_bytes and emu.num_cuts == 1
        # One-shot: the next connection is not cut.
        with _connect(emu.port) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            assert sink.record(1).ended.wait(WAIT_S)
        assert emu.bytes_up == n_bytes + len(payload) and emu.num_cuts == 1


@pytest.mark.timeout(60)
def test_cut_after_bytes_down_cuts_at_exactly_n() -> None:
    n_bytes = 50_000
    payload = _payload(1 << 20)
    with _server("source", payload) as source, LinkEmulator("127.0.0.1", source.port) as emu:
        emu.cut_after_bytes(n_bytes, "down")
        with _connect(emu.port) as sock:
            sock.sendall(b"g")
            received, was_reset = _recv_until_end(sock)
        assert was_reset
        assert received == payload[:n_bytes]
        assert emu.bytes_down == n_bytes and emu.num_cuts == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resetting_end", ["server", "client"])
def test_what_a_resetting_end_sent_still_arrives_before_the_reset(resetting_end: str) -> None:
    """An end that sends and then resets (it closes with bytes left unread, so the kernel sends
    a reset): what it sent is already on the link and arrives first, as on a real network; the
    other end then sees the reset."""
    payload = _payload(20_000)
    profile = LinkProfile(rate_bps=None, delay_ms=300)  # the reset comes long before the bytes
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        LinkEmulator("127.0.0.1", int(listener.getsockname()[1]), profile=profile) as emu,
    ):
        client = _connect(emu.port)
        server, _ = listener.accept()
        server.settimeout(WAIT_S)
        sender, receiver = (server, client) if resetting_end == "server" else (client, server)
        with receiver:
            with sender:
                receiver.sendall(b"g" + b"left unread")
                assert sender.recv(1) == b"g"  # both pieces crossed the link together
                sender.sendall(payload)
            received, was_reset = _recv_until_end(receiver)
        assert received == payload and was_reset
        assert emu.num_connections == 0


@pytest.mark.timeout(60)
def test_refused_upstream_resets_the_client() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead_port = int(probe.getsockname()[1])
    with LinkEmulator("127.0.0.1", dead_port) as emu:
        _assert_dropped_on_arrival(emu.port)
        assert emu.num_connections == 0
        assert emu.cut() == 0  # still serving


@pytest.mark.timeout(60)
def test_lifecycle_and_control_argument_errors(echo: _Server) -> None:
    emu = LinkEmulator("127.0.0.1", echo.port, name="life")
    with pytest.raises(RuntimeError, match="not started"):
        _ = emu.port
    with pytest.raises(ValueError, match="n_bytes"):
        emu.cut_after_bytes(0, "up")
    with pytest.raises(ValueError, match="direction"):
        emu.cut_after_bytes(1, "sideways")  # type: ignore[arg-type]
    emu.start()
    try:
        with pytest.raises(RuntimeError, match="twice"):
            emu.start()
        assert emu.endpoint == f"tcp://127.0.0.1:{emu.port}"
        assert any(t.name == "wanem-life" for t in threading.enumerate())
    finally:
        emu.close()
    emu.close()  # idempotent
    assert not any(t.name == "wanem-life" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="not running"):
        emu.cut()
    with pytest.raises(ValueError, match="upstream_port"):
        LinkEmulator("127.0.0.1", 0)


# --------------------------------------------------------------------------------------------
# ZeroMQ through the emulator


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def _exchange(dealer: zmq.Socket[bytes], router: zmq.Socket[bytes], text: bytes) -> bool:
    """One request/reply through the link; False if it was lost (e.g. in flight at a cut)."""
    dealer.send(text)
    if not router.poll(500):
        return False
    routing_id, request = router.recv_multipart()
    router.send_multipart([routing_id, b"re:" + request])
    while dealer.poll(500):
        if dealer.recv() == b"re:" + text:
            return True
    return False


@pytest.mark.timeout(60)
def test_zmq_dealer_router_survive_a_cut(zmq_context: zmq.Context[zmq.Socket[bytes]]) -> None:
    router = zmq_context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.bind("tcp://127.0.0.1:0")
    router_port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    with LinkEmulator("127.0.0.1", router_port, profile=parse_profile("100mbit,2ms")) as emu:
        dealer = zmq_context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, b"site-eu")
        dealer.setsockopt(zmq.RECONNECT_IVL, 20)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        dealer.connect(emu.endpoint)
        for i in range(5):
            assert _exchange(dealer, router, b"before-%d" % i)
        assert emu.cut() == 1
        # Messages in flight at the cut may be lost; the link must come back on its own.
        deadline = time.monotonic() + WAIT_S
        attempt = 0
        while not _exchange(dealer, router, b"retry-%d" % attempt):
            attempt += 1
            assert time.monotonic() < deadline, "no exchange after the cut"
        for i in range(5):
            assert _exchange(dealer, router, b"after-%d" % i)
        assert emu.num_accepted == 2 and emu.num_cuts == 1
