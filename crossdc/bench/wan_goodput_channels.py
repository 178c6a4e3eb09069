"""The goodput benchmark's full path: CURVE channels with acknowledged delivery over a long link.

A site's :class:`~comm.transport.dealer.DealerChannel` in namespace ``a`` sends one ``InitParams``
of the benchmark's size to a coordinator's :class:`~comm.transport.router.RouterChannel` in
namespace ``b``, both with CURVE keys from a federation kit made for the run (the coordinator's
ZAP handler checks the site's X.509 certificate, once per connection). The site
connects through the WAN link emulator (``crossdc.lab.wanem``), running in ``a``, which adds a
one-way delay of RTT/2 each way to the tc-shaped veth. The message is numbered and held until the
coordinator acknowledges it on the echo of a site heartbeat, as every message that must arrive.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from comm.codecs.floats import Fp32Codec
from comm.security.identity import CurveKeys
from comm.security.kits import init_kit, issue_site
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import CoordinatorKit, load_coordinator_kit, load_site_kit
from comm.security.zap import ZapHandler
from comm.transport.dealer import DealerChannel
from comm.transport.profile import COORDINATOR_PEER, ChannelConfig
from comm.transport.router import RouterChannel
from comm.wire.schema import Heartbeat, InitParams
from crossdc.lab.netns import NetnsPair
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator

WAIT_S = 300.0


def _kits(root: Path) -> tuple[CoordinatorKit, CurveKeys]:
    """A federation kit with one site, ``bench``: the coordinator's kit and the site's keys."""
    init_kit(root / "kit")
    issue_site(root / "kit", "bench", days=1, out_dir=root / "site")
    return load_coordinator_kit(root / "kit"), load_site_kit(root / "site").curve


def _loop(stop: threading.Event, step: Callable[[], None]) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            step()

    thread = threading.Thread(target=run, name="bench-channel", daemon=True)
    thread.start()
    return thread


def channel_transfer(
    pair: NetnsPair, values: np.ndarray, *, curve: bool, rtt_ms: float
) -> dict[str, Any]:
    """Send ``values`` (float32) as one message; seconds from the send to its arrival, and
    what the channels counted."""
    workdir = tempfile.TemporaryDirectory(prefix="crossdc-goodput-")
    server_keys: CurveKeys | None = None
    client_keys: CurveKeys | None = None
    kit: CoordinatorKit | None = None
    if curve:
        kit, client_keys = _kits(Path(workdir.name))
        server_keys = kit.curve
    cfg = ChannelConfig(send_timeout_s=WAIT_S)
    stop = threading.Event()
    arrived: list[float] = []
    closers: list[Callable[[], None]] = []
    try:

        def start_coordinator() -> tuple[RouterChannel, int]:
            ctx: zmq.Context[Any] = zmq.Context()
            closers.append(lambda: ctx.destroy(linger=0))
            if kit is not None:
                zap = ZapHandler(ctx, CertificateRegistry.from_kit(kit.kit_dir))
                zap.start()
                closers.append(zap.close)
            router = RouterChannel(
                ChannelConfig(send_timeout_s=WAIT_S, curve=server_keys), context=ctx
            )
            endpoint = router.bind(f"tcp://{pair.addr_b}:0")

            def serve() -> None:
                got = router.recv(0.01)
                if got is None:
                    return
                if isinstance(got[1], Heartbeat):
                    router.notify(got[0], got[1])  # carries the acknowledgement
                elif isinstance(got[1], InitParams):
                    arrived.append(time.monotonic())

            closers.append(_loop(stop, serve).join)
            return router, int(endpoint.rsplit(":", 1)[1])

        router, port = pair.call("b", start_coordinator)

        def start_site() -> tuple[DealerChannel, LinkEmulator]:
            emulator = LinkEmulator(
                pair.addr_b, port, profile=LinkProfile(rate_bps=None, delay_ms=rtt_ms / 2)
            )
            emulator.start()
            closers.append(emulator.close)
            ctx: zmq.Context[Any] = zmq.Context()
            closers.append(lambda: ctx.destroy(linger=0))
            site_cfg = ChannelConfig(send_timeout_s=WAIT_S, curve=client_keys)
            dealer = DealerChannel(site_cfg, identity="bench", context=ctx)
            dealer.connect(emulator.endpoint)
            return dealer, emulator

        dealer, _ = pair.call("a", start_site)
        msg = InitParams(
            site_id="bench", model_fingerprint="bench", payload=(Fp32Codec().encode("w", values),)
        )
        started = [0.0]
        beat_at = [0.0]

        def site_step() -> None:
            now = time.monotonic()
            if now >= beat_at[0]:
                dealer.send(Heartbeat(site_id="bench", global_version=0, sent_at=now))
                beat_at[0] = now + cfg.heartbeat_interval_s
            got = dealer.recv(0.005)
            if isinstance(got, Heartbeat):  # the echo: connected (and CURVE done), an RTT
                now = time.monotonic()
                dealer.rtt_sample(COORDINATOR_PEER, now - got.sent_at, now)
                if not started[0]:
                    started[0] = now
                    dealer.send(msg)

        closers.append(_loop(stop, site_step).join)
        deadline = time.monotonic() + WAIT_S
        while not arrived or (
            COORDINATOR_PEER not in dealer.out_streams or dealer.out_streams[COORDINATOR_PEER].held
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the message was not delivered and acknowledged in time")
            time.sleep(0.01)
        stats = dealer.stats
        return {
            "elapsed_s": arrived[0] - started[0],
            "chunk_bytes": cfg.chunk_bytes,
            "chunks_sent": stats.chunks_sent,
            "chunks_resent": stats.chunks_resent,
            "messages_acked": stats.messages_acked,
            "messages_resent": stats.messages_resent,
            "rtt_s": dealer.send_link(COORDINATOR_PEER).snapshot().rtt_s,
        }
    finally:
        stop.set()
        for close in reversed(closers):
            close()
        workdir.cleanup()
