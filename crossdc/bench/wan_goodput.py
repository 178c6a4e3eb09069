"""WAN goodput benchmark: a credit-controlled chunked transfer against the link's rate.

Two network namespaces joined by a veth whose ends are shaped with ``tc`` HTB to ``rate_mbit``
(``crossdc.lab.netns``): the sender (a ZeroMQ DEALER) lives in one, the receiver (a ROUTER) in the
other, and a ``size_mib`` MiB message travels as ``comm.transport`` chunks under the receiver's
credit window. ``goodput_ratio`` = payload bits / elapsed seconds / link rate, elapsed from the
sender's first byte (the RTT ping included) to the receiver holding the whole message. Raw TCP
over the same link, timed the same way (first ``send`` to last byte received), is the reference
(``tcp_goodput_ratio``): what the kernel's shaper lets through after TCP/IP headers.

With ``--curve`` or ``--rtt-ms`` the message goes the whole way a model goes in a federation
(``crossdc.bench.wan_goodput_channels``): a site's channel to a coordinator's, CURVE on (with a
kit made for the run), numbered and acknowledged, through the WAN link emulator adding the round
trip on top of the shaped veth; the raw TCP reference then goes through the same emulator.

Needs root for the namespaces; without them it prints ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import threading
import time
from typing import Any

import numpy as np
import zmq

from comm.transport.credit import TransferConfig
from crossdc.bench.transfer_drivers import ZmqTransferReceiver, ZmqTransferSender
from crossdc.bench.wan_goodput_channels import channel_transfer
from crossdc.lab.netns import HtbShape, NetnsPair, netns_available
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator

WAIT_S = 120.0  # a bound on anything that must happen; the link may be slow


def _tcp_seconds(pair: NetnsPair, payload: bytes, rtt_ms: float = 0.0) -> float:
    """Raw TCP from namespace ``a`` to ``b``: seconds from the first send to the last byte;
    through the WAN link emulator adding ``rtt_ms`` when it is > 0, as the channels go."""

    def listen() -> socket.socket:
        listener = socket.create_server((pair.addr_b, 0))
        listener.settimeout(WAIT_S)
        return listener

    listener = pair.call("b", listen)
    socks = [listener]
    emulator: LinkEmulator | None = None
    try:
        port = int(listener.getsockname()[1])
        target = (pair.addr_b, port)
        if rtt_ms > 0:
            profile = LinkProfile(rate_bps=None, delay_ms=rtt_ms / 2)
            emulator = pair.call("a", LinkEmulator, pair.addr_b, port, profile=profile)
            pair.call("a", emulator.start)
            target = ("127.0.0.1", emulator.port)
        client = pair.call("a", socket.create_connection, target, WAIT_S)
        socks.append(client)
        server, _ = listener.accept()
        socks.append(server)
        server.settimeout(WAIT_S)
        started: list[float] = []

        def send() -> None:
            started.append(time.monotonic())
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, name="bench-tcp-send")
        sender.start()
        received = 0
        view = memoryview(bytearray(1 << 20))
        while n := server.recv_into(view):
            received += n
        done_at = time.monotonic()
        sender.join(WAIT_S)
        if received != len(payload):
            raise RuntimeError(f"TCP delivered {received} of {len(payload)} bytes")
        return done_at - started[0]
    finally:
        for sock in socks:
            sock.close()
        if emulator is not None:
            emulator.close()


def _transfer(pair: NetnsPair, payload: bytes, cfg: TransferConfig) -> dict[str, Any]:
    """One ``comm.transport`` of ``payload`` from ``a`` to ``b`` over DEALER/ROUTER."""

    def make_router() -> tuple[zmq.Context[Any], zmq.Socket[Any], str]:
        # Created inside namespace b: the context's I/O thread, which owns the TCP
        # connections, is started by the first socket and stays in b.
        context: zmq.Context[Any] = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.RCVHWM, cfg.high_water_mark)
        sock.bind(f"tcp://{pair.addr_b}:*")
        return context, sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def make_dealer(endpoint: str) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
        context: zmq.Context[Any] = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"bench-site")
        sock.setsockopt(zmq.SNDHWM, cfg.high_water_mark)
        sock.connect(endpoint)
        return context, sock

    rx_context, router, endpoint = pair.call("b", make_router)
    tx_context, dealer = pair.call("a", make_dealer, endpoint)
    stop = threading.Event()
    arrived: list[tuple[float, str]] = []

    def on_message(peer: bytes, frames: list[memoryview]) -> None:
        arrived.append((time.monotonic(), hashlib.sha256(frames[0]).hexdigest()))

    server = ZmqTransferReceiver(router, cfg)
    serving = threading.Thread(target=server.serve, args=(stop, on_message), name="bench-rx")
    serving.start()
    try:
        report = ZmqTransferSender(dealer, cfg).send([payload], timeout_s=WAIT_S)
    finally:
        stop.set()
        serving.join(WAIT_S)
        dealer.close(linger=0)
        router.close(linger=0)
        tx_context.term()
        rx_context.term()
    if len(arrived) != 1 or arrived[0][1] != hashlib.sha256(payload).hexdigest():
        raise RuntimeError("the transfer did not deliver the payload intact")
    return {
        "elapsed_s": arrived[0][0] - report.started_at,
        "window_bytes": server.max_credit_bytes,
        "chunks_sent": report.chunks_sent,
        "chunks_resent": report.chunks_resent,
        "rtt_s": report.rtt_s,
    }


def run(
    size_mib: int = 64, rate_mbit: float = 100, *, curve: bool = False, rtt_ms: float = 0.0
) -> dict[str, Any]:
    """Measure goodput of a ``size_mib`` MiB transfer over a ``rate_mbit`` Mbit/s shaped veth;
    with ``curve`` or ``rtt_ms`` over the full channels (``wan_goodput_channels``)."""
    if size_mib < 1 or rate_mbit <= 0:
        raise ValueError(f"size_mib must be >= 1 and rate_mbit > 0, got {size_mib}, {rate_mbit}")
    ok, reason = netns_available()
    if not ok:
        return {"skipped": reason}
    rate_bps = rate_mbit * 1e6
    cfg = TransferConfig()
    payload = np.random.default_rng(0).bytes(size_mib << 20)
    shape = HtbShape(rate_bps=rate_bps)
    channels = curve or rtt_ms > 0
    with NetnsPair(a_to_b=shape, b_to_a=shape, name_prefix="crossdc-bench") as pair:
        tcp_s = _tcp_seconds(pair, payload, rtt_ms)
        if channels:
            values = np.frombuffer(payload, dtype=np.uint8).view(np.float32)
            values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
            moved = channel_transfer(pair, values, curve=curve, rtt_ms=rtt_ms)
        else:
            moved = _transfer(pair, payload, cfg)
    bits = len(payload) * 8.0
    extra = {"path": "channels", "curve": curve, "rtt_ms": rtt_ms} if channels else {}
    return {
        **extra,
        "size_mib": size_mib,
        "rate_mbit": rate_mbit,
        "chunk_bytes": moved.get("chunk_bytes", cfg.chunk_bytes),
        "window_bytes": moved.get("window_bytes"),
        "elapsed_s": moved["elapsed_s"],
        "goodput_mbit": bits / moved["elapsed_s"] / 1e6,
        "goodput_ratio": bits / moved["elapsed_s"] / rate_bps,
        "tcp_elapsed_s": tcp_s,
        "tcp_goodput_ratio": bits / tcp_s / rate_bps,
        "chunks_sent": moved["chunks_sent"],
        "chunks_resent": moved["chunks_resent"],
        "rtt_s": moved["rtt_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crossdc bench wan_goodput", description=__doc__)
    parser.add_argument("--size-mib", type=int, default=64, help="message size in MiB")
    parser.add_argument("--rate-mbit", type=float, default=100, help="HTB link rate, Mbit/s")
    parser.add_argument(
        "--curve", action="store_true", help="full channels with CURVE and acknowledged delivery"
    )
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="round trip added by the WAN link emulator"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.rtt_ms < 0:
        parser.error("--rtt-ms must be >= 0")
    report = run(
        size_mib=args.size_mib, rate_mbit=args.rate_mbit, curve=args.curve, rtt_ms=args.rtt_ms
    )
    if args.json or "skipped" in report:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['size_mib']} MiB over {report['rate_mbit']:g} Mbit/s HTB: "
            f"transfer {report['goodput_ratio']:.3f} of the rate ({report['elapsed_s']:.2f} s, "
            f"{report['chunk_bytes'] >> 20} MiB chunks, window {(report['window_bytes'] or 0) >> 20} MiB)"
            f", raw TCP {report['tcp_goodput_ratio']:.3f} ({report['tcp_elapsed_s']:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
