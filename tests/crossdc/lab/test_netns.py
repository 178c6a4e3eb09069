"""Tests for crossdc.lab.netns: HTB shape validation everywhere; with root, ``ip`` and ``tc``, real
namespace pairs: addressing, running code inside, cleanup, and that the kernel shaping holds a
TCP transfer to its rate."""

from __future__ import annotations

import errno
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

import crossdc.lab.netns
from crossdc.lab.netns import HtbShape, NetnsError, NetnsPair, Side, netns_available, run_in_netns

WAIT_S = 10.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"rate_bps": 0}, "rate_bps"),
        ({"rate_bps": -5e6}, "rate_bps"),
        ({"rate_bps": 50e6, "ceil_bps": 10e6}, "ceil_bps"),
        ({"rate_bps": 50e6, "burst_bytes": 0}, "burst_bytes"),
        ({"rate_bps": 50e6, "cburst_bytes": 1.5}, "cburst_bytes"),
    ],
)
def test_htb_shape_validation_names_the_field(kwargs: dict[str, object], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        HtbShape(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_htb_shape_tc_arguments() -> None:
    assert HtbShape(rate_bps=50e6).tc_class_args() == [
        "rate", "50000000bit", "ceil", "50000000bit",
        "burst", "25000", "cburst", "25000", "quantum", "200000",
    ]  # fmt: skip
    shape = HtbShape(rate_bps=1e6, ceil_bps=2e6, burst_bytes=3000, cburst_bytes=1600)
    assert shape.tc_class_args() == [
        "rate", "1000000bit", "ceil", "2000000bit",
        "burst", "3000", "cburst", "1600", "quantum", "12500",
    ]  # fmt: skip


@pytest.mark.timeout(60)
def test_pair_rejects_a_subnet_without_two_hosts() -> None:
    with pytest.raises(ValueError, match="subnet"):
        NetnsPair(subnet="10.1.2.3/32")


@pytest.mark.timeout(60)
def test_netns_available_reports_a_reason() -> None:
    ok, reason = netns_available()
    assert isinstance(ok, bool) and reason


# --------------------------------------------------------------------------------------------
# With real namespaces


@pytest.fixture(scope="module")
def netns_here() -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.fixture
def shaped_pair(netns_here: None) -> Iterator[NetnsPair]:
    shape = HtbShape(rate_bps=50e6)
    with NetnsPair(a_to_b=shape, b_to_a=shape) as pair:
        yield pair


def _listen(host: str) -> socket.socket:
    listener = socket.create_server((host, 0))
    listener.settimeout(WAIT_S)
    return listener


def _transfer_goodput_bps(pair: NetnsPair, sender: Side, receiver: Side, n_bytes: int) -> float:
    """Send ``n_bytes`` over TCP from ``sender`` to ``receiver``; return the receiver's goodput
    in bits/s, timed from its first read to its last so connection setup is not counted."""
    listener = pair.call(receiver, _listen, pair.address(receiver))
    port = int(listener.getsockname()[1])
    socks: list[socket.socket] = [listener]
    try:
        client = pair.call(sender, socket.create_connection, (pair.address(receiver), port), WAIT_S)
        socks.append(client)
        server, _ = listener.accept()
        socks.append(server)
        server.settimeout(WAIT_S)

        def send() -> None:
            client.sendall(b"\x5a" * n_bytes)
            client.shutdown(socket.SHUT_WR)

        sender_thread = threading.Thread(target=send)
        sender_thread.start()
        first = server.recv(1 << 20)
        first_at = time.monotonic()
        counted, last_at = 0, first_at
        while data := server.recv(1 << 20):
            counted += len(data)
            last_at = time.monotonic()
        sender_thread.join(WAIT_S)
        assert len(first) + counted == n_bytes
        return counted * 8 / (last_at - first_at)
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sender", "receiver"), [("a", "b"), ("b", "a")])
def test_veth_shaping_holds_goodput_to_the_rate(
    shaped_pair: NetnsPair, sender: Side, receiver: Side
) -> None:
    rate_bps = 50e6
    goodput_bps = _transfer_goodput_bps(shaped_pair, sender, receiver, 4 << 20)
    # Correctness of the shaper: it must never let more through than the rate, and TCP over it
    # should get most of the rate (headers take ~5 %).
    assert 0.8 * rate_bps <= goodput_bps <= 1.0 * rate_bps, goodput_bps


@pytest.mark.timeout(60)
def test_pair_addresses_commands_and_callables(shaped_pair: NetnsPair) -> None:
    pair = shaped_pair
    assert pair.ns_a != pair.ns_b and {pair.ns_a, pair.ns_b} <= _namespaces()
    shown = pair.run("a", ["ip", "-o", "-4", "addr", "show", "dev", pair.device("a")]).stdout
    assert f"{pair.addr_a}/30" in shown
    assert "htb" in pair.tc_stats("b")
    # A thread inside namespace b owns b's address; this (host) thread does not.
    assert pair.call("b", lambda: _listen(pair.addr_b).close()) is None
    with pytest.raises(OSError) as info:
        _listen(pair.addr_b)
    assert info.value.errno == errno.EADDRNOTAVAIL
    with pytest.raises(ZeroDivisionError):
        run_in_netns(pair.ns_a, lambda: 1 // 0)
    proc = pair.popen("a", ["true"])
    assert proc.wait(WAIT_S) == 0


@pytest.mark.timeout(60)
def test_set_shape_changes_and_removes_shaping(shaped_pair: NetnsPair) -> None:
    shaped_pair.set_shape("a", HtbShape(rate_bps=10e6))
    assert "rate 10Mbit" in shaped_pair.tc_stats("a")
    shaped_pair.set_shape("a", None)
    assert shaped_pair.shape("a") is None
    assert "htb" not in shaped_pair.tc_stats("a")


@pytest.mark.timeout(60)
def test_close_deletes_everything_even_after_an_error(netns_here: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), NetnsPair() as pair:
        names = {pair.ns_a, pair.ns_b}
        assert names <= _namespaces()
        raise RuntimeError("boom")
    assert not names & _namespaces()
    pair.close()  # idempotent


@pytest.mark.timeout(60)
def test_failed_start_cleans_up(netns_here: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = crossdc.lab.netns._run

    def failing_tc(argv: Sequence[str], **kwargs: float) -> str:
        if argv[0] == "tc":
            raise NetnsError("tc refused")
        return real_run(argv, **kwargs)

    monkeypatch.setattr(crossdc.lab.netns, "_run", failing_tc)
    pair = NetnsPair(a_to_b=HtbShape(rate_bps=1e6))
    with pytest.raises(NetnsError, match="tc refused"):
        pair.start()
    assert not {pair.ns_a, pair.ns_b} & _namespaces()


@pytest.mark.timeout(60)
def test_parallel_pairs_do_not_collide(netns_here: None) -> None:
    with NetnsPair() as first, NetnsPair() as second:
        assert {first.ns_a, first.ns_b}.isdisjoint({second.ns_a, second.ns_b})
        assert first.device("a") != second.device("a")
        # Same subnet, separate namespaces: both work.
        for pair in (first, second):
            listener = pair.call("b", _listen, pair.addr_b)
            listener.close()
