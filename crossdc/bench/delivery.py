"""How fast acknowledged delivery recovers a lost message, against 10 x RTT + transfer time.

A coordinator's ROUTER channel and a site's DEALER channel talk through the WAN link emulator
(``crossdc.lab.wanem``: a rate cap and a one-way delay of RTT/2 each way), with the channels'
default profile (heartbeats every ``heartbeat_interval_s``, which carry the acknowledgements).
A deterministic injector (``comm.transport.faults``) loses, per case:

- ``lost_after_accept``: a small message the socket accepted (as a reset loses what ZeroMQ had
  queued). Recovery: from the send to its arrival.
- ``rerun_plan``: a secure-aggregation re-run's plan (a second ``RoundStart`` for a round
  whose first plan arrived: the same round id, a higher attempt, the survivors' keys), lost
  after accept. Recovery: from the send to its arrival.
- ``stalled_transfer``: every chunk of a large message, resends included, until the channel gives
  the transfer up after ``send_timeout_s`` without progress, dropping with it the small message
  queued behind it. Recovery: from the give-up to the arrival of both, in order.

Each case is repeated ``--repeats`` times; the report gives every recovery, the worst, and the
bound ``10 x RTT + size / rate`` it is held against (``within_bound``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import zmq

from comm.codecs.floats import Fp32Codec
from comm.transport.dealer import DealerChannel
from comm.transport.faults import WireFaults
from comm.transport.profile import ChannelConfig
from comm.transport.router import RouterChannel
from comm.wire.schema import Heartbeat, InitParams, Leave, Message, RoundStart, SyncRequest
from crossdc.bench import print_report
from crossdc.lab.profiles import LinkProfile
from crossdc.lab.wanem import LinkEmulator

_WAIT_S = 120.0


class _Link:
    """A ROUTER, a DEALER through an emulated link, and a loop that runs both."""

    def __init__(self, ctx: zmq.Context[Any], cfg: ChannelConfig, profile: LinkProfile) -> None:
        self.cfg = cfg
        self.router = RouterChannel(cfg, context=ctx)
        port = int(self.router.bind("tcp://127.0.0.1:0").rsplit(":", 1)[1])
        self.emulator = LinkEmulator("127.0.0.1", port, profile=profile)
        self.emulator.start()
        self.dealer = DealerChannel(cfg, identity="site", context=ctx)
        self.dealer.connect(self.emulator.endpoint)
        self.router.faults = self.faults = WireFaults()
        self.got: list[tuple[float, Message]] = []
        self._next_beat = 0.0
        self.dealer.send(Heartbeat(site_id="site", global_version=0, sent_at=time.monotonic()))
        first = self.router.recv(_WAIT_S)
        if first is None:
            raise RuntimeError("the site never reached the coordinator through the emulator")
        self.peer = first[0]

    def run_until(self, done: Any) -> None:
        deadline = time.monotonic() + _WAIT_S
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError("a lost message was never recovered")
            if now >= self._next_beat:
                self.dealer.send(Heartbeat(site_id="site", global_version=0, sent_at=now))
                self._next_beat = now + self.cfg.heartbeat_interval_s
            got = self.router.recv(0.002)
            if got is not None and isinstance(got[1], Heartbeat):
                self.router.notify(got[0], got[1])
            msg = self.dealer.recv(0.002)
            if msg is not None and not isinstance(msg, Heartbeat):
                self.got.append((time.monotonic(), msg))

    def settle(self) -> None:
        """Until everything sent is acknowledged (so cases do not overlap)."""
        stream = self.router.out_streams.get(self.peer)
        self.run_until(lambda: stream is None or not stream.held)
        self.got.clear()

    def close(self) -> None:
        self.dealer.close(flush_timeout_s=0)
        self.router.close(flush_timeout_s=0)
        self.emulator.close()


def _lost_after_accept(link: _Link, index: int) -> float:
    link.faults.lose_next(SyncRequest)
    start = time.monotonic()
    link.router.send(link.peer, SyncRequest(site_id="site", global_version=index))
    link.run_until(lambda: bool(link.got))
    arrived = link.got[0][0] - start
    link.settle()
    return arrived


def _plan(round_id: int, attempt: int, survivors: tuple[str, ...]) -> RoundStart:
    keys = {site: [f"{attempt:02d}" * 32, ""] for site in survivors}
    return RoundStart(
        round_id=round_id,
        global_version=round_id - 1,
        fragment_base_version=round_id - 1,
        fragment=0,
        num_fragments=1,
        num_inner_steps=0 if attempt else 30,
        overlap=False,
        codec="secagg",
        deadline_s=1800.0,
        participants=survivors,
        evaluate=False,
        reason="secure aggregation: re-run" if attempt else "planned",
        secagg={"attempt": attempt, "peers": keys},
    )


def _rerun_plan(link: _Link, index: int) -> float:
    round_id = index + 1
    link.router.send(link.peer, _plan(round_id, 0, ("ap", "eu", "site", "us")))
    link.run_until(lambda: bool(link.got))
    link.got.clear()
    link.faults.lose_next(RoundStart)
    start = time.monotonic()
    link.router.send(link.peer, _plan(round_id, 1, ("eu", "site", "us")))
    link.run_until(lambda: bool(link.got))
    arrived = link.got[0][0] - start
    got = link.got[0][1]
    if not (isinstance(got, RoundStart) and got.secagg["attempt"] == 1):
        raise RuntimeError(f"expected the re-run plan, got {got!r}")
    link.settle()
    return arrived


def _stalled_transfer(link: _Link, index: int, nbytes: int) -> float:
    values = np.random.default_rng(index).standard_normal(nbytes // 4).astype(np.float32)
    big = InitParams(
        site_id="site", model_fingerprint=f"m{index}", payload=(Fp32Codec().encode("w", values),)
    )
    link.faults.stall_next(InitParams)
    dropped = link.router.stats.messages_dropped
    link.router.send(link.peer, big)
    link.router.send(link.peer, Leave(site_id="site", reason=f"behind {index}"))
    link.run_until(lambda: link.router.stats.messages_dropped > dropped)
    given_up = time.monotonic()
    link.run_until(lambda: len(link.got) == 2)
    if [type(m) for _, m in link.got] != [InitParams, Leave]:
        raise RuntimeError(f"arrived out of order: {[type(m).__name__ for _, m in link.got]}")
    recovered = link.got[-1][0] - given_up
    link.settle()
    return recovered


def run(*, rtt_ms: float, rate_mbit: float, size_mib: float, repeats: int) -> dict[str, Any]:
    """Both cases ``repeats`` times over one emulated link; the report."""
    rtt_s = rtt_ms / 1000.0
    nbytes = int(size_mib * (1 << 20))
    cfg = ChannelConfig(send_timeout_s=3.0)
    profile = LinkProfile(rate_bps=rate_mbit * 1e6, delay_ms=rtt_ms / 2, burst_bytes=1 << 20)
    ctx: zmq.Context[Any] = zmq.Context()
    link = _Link(ctx, cfg, profile)
    try:
        link.settle()
        small = [_lost_after_accept(link, i) for i in range(repeats)]
        reruns = [_rerun_plan(link, i) for i in range(repeats)]
        large = [_stalled_transfer(link, i, nbytes) for i in range(repeats)]
        stats = link.router.stats
        counts = {
            "messages_resent": stats.messages_resent,
            "messages_acked": stats.messages_acked,
            "messages_dropped": stats.messages_dropped,
            "duplicates_dropped": link.dealer.stats.duplicates_dropped,
        }
    finally:
        link.close()
        ctx.destroy(linger=0)
    transfer_s = nbytes * 8 / (rate_mbit * 1e6)
    cases: dict[str, dict[str, Any]] = {
        "lost_after_accept": {"recovery_s": small, "bound_s": 10 * rtt_s},
        "rerun_plan": {"recovery_s": reruns, "bound_s": 10 * rtt_s},
        "stalled_transfer": {"recovery_s": large, "bound_s": 10 * rtt_s + transfer_s},
    }
    for case in cases.values():
        case["max_recovery_s"] = max(case["recovery_s"])
        case["within_bound"] = case["max_recovery_s"] <= case["bound_s"]
    return {
        "config": {
            "rtt_ms": rtt_ms,
            "rate_mbit": rate_mbit,
            "size_mib": size_mib,
            "repeats": repeats,
            "heartbeat_interval_s": cfg.heartbeat_interval_s,
            "resend_timeout_min_s": cfg.resend_timeout_min_s,
        },
        **cases,
        **counts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crossdc bench delivery", description=__doc__)
    parser.add_argument("--rtt-ms", type=float, default=150.0, help="emulated round trip, ms")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="emulated rate, Mbit/s")
    parser.add_argument("--size-mib", type=float, default=4.0, help="the large message, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="losses per case")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    for name in ("rtt_ms", "rate_mbit", "size_mib"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    report = run(
        rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit, size_mib=args.size_mib, repeats=args.repeats
    )
    print_report(report, as_json=args.json)
    return 0


__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
