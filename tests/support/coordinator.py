"""The in-process coordinator harness its tests share: the coordinator on tcp loopback with
real DEALER sockets standing in for sites, and helpers to join, train and land updates."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import zmq

from comm.codecs.base import EncodedTensor
from comm.codecs.floats import Fp32Codec
from comm.security.rolekits import SecurityConfig
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import (
    ErrorCode,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Message,
    RoundStart,
    Update,
    Welcome,
)
from comm.wire.tensors import encode_tensors, state_hash
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator, InitialModel
from coordinator.state import GlobalState, MemoryStateStore

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


class Site:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str, site_id: str) -> None:
        self.site_id = site_id
        self.chan = DealerChannel(ChannelConfig(linger_s=0.1), identity=site_id, context=ctx)
        self.chan.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.chan.send(msg)


class Harness:
    def __init__(self, coord: Coordinator, ctx: zmq.Context[Any]) -> None:
        self.coord = coord
        self.ctx = ctx

    def site(self, site_id: str) -> Site:
        return Site(self.ctx, self.coord.endpoint, site_id)

    def expect(self, site: Site, kind: type, steps: int = 4000) -> Any:
        """Run the coordinator until ``site`` receives a message of ``kind`` (others skipped).
        ``steps`` bounds a test that fails: a passing one returns at the message, and on a
        starved machine a new connection's first message can take seconds of steps."""
        for _ in range(steps):
            self.coord.step(0.005)
            msg = site.chan.recv(0.0)
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"{site.site_id} got no {kind.__name__}")

    def until(self, cond: Callable[[], bool], steps: int = 400) -> None:
        for _ in range(steps):
            if cond():
                return
            self.coord.step(0.005)
        raise AssertionError("condition never held")


@contextlib.contextmanager
def running(
    store: MemoryStateStore | None = None,
    clock: Callable[[], float] | None = None,
    initial: InitialModel | None = None,
    **overrides: Any,
) -> Iterator[Harness]:
    """A started coordinator on a free port with the test defaults, and a ZeroMQ context;
    ``store`` carries durable state from one coordinator to the next (a restart), ``clock``
    replaces the monotonic clock."""
    defaults: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:0",
        "state_dir": "",
        "metrics_port": 0,
        "min_sites": 2,
        "num_inner_steps": 3,
        "outer_lr": 0.5,
        "outer_momentum": 0.9,
        "outer_warmup_steps": 3,
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
        "overlap": False,
        "security": SecurityConfig(insecure=True),
    }
    coord = Coordinator(
        CoordinatorConfig(**{**defaults, **overrides}),
        store=store or MemoryStateStore(),
        initial=initial,
        **({} if clock is None else {"clock": clock}),
    )
    coord.start()
    ctx = zmq.Context()
    try:
        yield Harness(coord, ctx)
    finally:
        coord.close()
        ctx.destroy(linger=0)


def rejected(coord: Coordinator, reason: str) -> float:
    value = coord.metrics.registry.get_sample_value("crossdc_rejected_total", {"reason": reason})
    return value or 0.0


def join(
    h: Harness,
    site: Site,
    version: int = -1,
    digest: str = "",
    capabilities: dict[str, Any] | None = None,
) -> Welcome:
    site.send(
        Join(
            site_id=site.site_id,
            model_fingerprint="fp",
            global_version=version,
            state_hash=digest,
            capabilities=capabilities or {},
        )
    )
    welcome: Welcome = h.expect(site, Welcome)
    return welcome


def update(
    site: str,
    round_id: int,
    delta: dict[str, np.ndarray] | tuple[EncodedTensor, ...],
    weight: float = 100.0,
) -> Update:
    payload = delta if isinstance(delta, tuple) else encode_tensors(delta, Fp32Codec())
    return Update(
        site_id=site,
        round_id=round_id,
        global_version=0,
        fragment=0,
        weight=weight,
        train_loss=2.0,
        compute_seconds=1.0,
        step_seconds=0.3,
        link_rtt_s=0.1,
        link_goodput_bps=1e8,
        payload=payload,
    )


def start_round(
    h: Harness, evaluates: tuple[bool, bool] = (True, True)
) -> tuple[Site, Site, RoundStart]:
    """eu and us join (``evaluates``: what each says at its join), eu sends θ0, round 1 opens."""
    eu, us = h.site("eu"), h.site("us")
    assert join(h, eu, capabilities={"evaluates": evaluates[0]}).need_init
    eu.send(
        InitParams(
            site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
        )
    )
    assert not join(h, us, capabilities={"evaluates": evaluates[1]}).need_init
    full = h.expect(us, Global)
    assert full.is_full and full.state_hash == state_hash(PARAMS)
    rs: RoundStart = h.expect(eu, RoundStart)
    assert rs.participants == ("eu", "us") and rs.num_inner_steps == 3
    h.expect(us, RoundStart)
    return eu, us, rs


D_EU = {"w": np.full((2, 3), 0.2, np.float32), "b": np.zeros(3, np.float32)}


D_US = {"w": np.full((2, 3), 0.6, np.float32), "b": np.ones(3, np.float32)}


def merge_round(h: Harness, eu: Site, us: Site, rs: RoundStart, base: int = 0) -> Global:
    """Both sites send their update for ``rs`` (eu weight 100, us 300: mean w 0.5, b 0.75);
    returns the result eu receives."""
    eu.send(replace(update("eu", rs.round_id, D_EU, weight=100.0), global_version=base))
    us.send(replace(update("us", rs.round_id, D_US, weight=300.0), global_version=base))
    result: Global = h.expect(eu, Global)
    return result


def decoded(g: Global) -> dict[str, np.ndarray]:
    return {e.name: Fp32Codec().decode(e) for e in g.payload}


def _bad_updates(rid: int) -> list[tuple[str, Update, ErrorCode]]:
    # Built by hand: the codec itself refuses to encode NaN, a corrupt peer need not.
    nan = tuple(
        EncodedTensor(name=k, shape=v.shape, codec="fp32", buffers=(v.reshape(-1),))
        for k, v in {"w": np.full((2, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)}.items()
    )
    wrong_shape = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)}
    missing = {"w": np.zeros((2, 3), np.float32)}
    ok = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    unknown_codec = tuple(replace(e, codec="zip9") for e in encode_tensors(ok, Fp32Codec()))
    huge = {"w": np.full((2, 3), 1e7, np.float32), "b": np.zeros(3, np.float32)}
    return [
        ("non_finite", update("eu", rid, nan), ErrorCode.NON_FINITE),
        ("bad_payload", update("eu", rid, wrong_shape), ErrorCode.BAD_PAYLOAD),
        ("bad_payload", update("eu", rid, missing), ErrorCode.BAD_PAYLOAD),
        ("unknown_codec", update("eu", rid, unknown_codec), ErrorCode.UNKNOWN_CODEC),
        ("bad_payload", update("eu", rid, huge), ErrorCode.BAD_PAYLOAD),
        ("stale_round", update("eu", rid + 7, ok), ErrorCode.STALE_ROUND),
        ("non_finite", update("eu", rid, ok, weight=float("nan")), ErrorCode.NON_FINITE),
        ("non_finite", replace(update("eu", rid, ok), train_loss=-math.inf), ErrorCode.NON_FINITE),
        ("not_joined", update("ap", rid, ok), ErrorCode.NOT_JOINED),
    ]


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def on_base(site: str, rs: RoundStart, delta: dict[str, np.ndarray]) -> Update:
    """``site``'s update for ``rs``, trained from the version the round builds on."""
    return replace(update(site, rs.round_id, delta), global_version=rs.fragment_base_version)


def land(h: Harness, site: Site, rs: RoundStart, delta: dict[str, np.ndarray]) -> None:
    """``site`` sends its update for ``rs`` and the coordinator takes it in."""
    site.send(on_base(site.site_id, rs, delta))
    h.until(lambda: any(site.site_id in r.received for r in h.coord.open_rounds))


class GatedStore(MemoryStateStore):
    """A store whose full saves block while ``gate`` is clear (a slow disk, deterministically)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def save(self, state: GlobalState) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        super().save(state)


def heard(h: Harness, site: Site) -> list[Message]:
    """``site`` sends a heartbeat: what it receives up to the echo (sent after anything the
    heartbeat made the coordinator send, on the same connection)."""
    site.send(Heartbeat(site_id=site.site_id, global_version=0, sent_at=1.0))
    got: list[Message] = []
    for _ in range(400):
        h.coord.step(0.005)
        msg = site.chan.recv(0.0)
        if isinstance(msg, Heartbeat):
            return got
        if msg is not None:
            got.append(msg)
    raise AssertionError(f"{site.site_id} got no echo")


def two_rounds(h: Harness) -> tuple[Site, Site, Global, Global]:
    """eu and us merge two rounds; returns them and the two results (as eu received them)."""
    eu, us, rs = start_round(h)
    g1 = merge_round(h, eu, us, rs)
    h.expect(us, Global)
    rs2: RoundStart = h.expect(eu, RoundStart)
    h.expect(us, RoundStart)
    return eu, us, g1, merge_round(h, eu, us, rs2, base=rs.round_id)
