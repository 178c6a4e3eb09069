"""The coordinator service in-process, driven by real DEALER sockets over tcp loopback.

Covers the join/init/round/broadcast path, the validation of every update (each bad one gets an
Error naming the problem, a counter, and no change of state), and the /metrics endpoint.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from comm.codecs.base import EncodedTensor
from comm.codecs.floats import Fp32Codec
from comm.ops.observe import ObserveServer
from comm.security.kits import SecurityConfig
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import (
    Error,
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
from comm.wire.tensors import encode_tensors, fragments, state_hash
from coordinator.config import CoordinatorConfig
from coordinator.lifecycle import next_fragment
from coordinator.service import Coordinator, InitialModel
from coordinator.state import GlobalState, MemoryStateStore

pytestmark = pytest.mark.timeout(60)

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

    def expect(self, site: Site, kind: type, steps: int = 400) -> Any:
        """Run the coordinator until ``site`` receives a message of ``kind`` (others skipped)."""
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


@pytest.fixture
def harness() -> Iterator[Harness]:
    with running() as h:
        yield h


def rejected(coord: Coordinator, reason: str) -> float:
    value = coord.metrics.registry.get_sample_value("crossdc_rejected_total", {"reason": reason})
    return value or 0.0


def join(h: Harness, site: Site, version: int = -1, digest: str = "") -> Welcome:
    site.send(
        Join(
            site_id=site.site_id, model_fingerprint="fp", global_version=version, state_hash=digest
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


def start_round(h: Harness) -> tuple[Site, Site, RoundStart]:
    eu, us = h.site("eu"), h.site("us")
    assert join(h, eu).need_init
    eu.send(
        InitParams(
            site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
        )
    )
    assert not join(h, us).need_init
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


def test_join_init_round_and_outer_step(harness: Harness) -> None:
    h = harness
    eu, us, rs = start_round(h)
    g_eu = merge_round(h, eu, us, rs)
    g_us: Global = h.expect(us, Global)
    assert not g_eu.is_full and g_eu.global_version == rs.round_id and g_eu.base_version == 0
    assert g_eu.state_hash == g_us.state_hash
    delta = decoded(g_eu)
    new = {k: PARAMS[k] + delta[k] for k in PARAMS}
    assert state_hash(new) == g_eu.state_hash
    # g = (100*0.2 + 300*0.6)/400 = 0.5. The model has 3 inner steps behind it, within the outer
    # warm-up (3): the plain mean, whatever the outer lr.
    np.testing.assert_allclose(new["w"], PARAMS["w"] - 0.5, rtol=1e-6)
    assert h.coord.state is not None and h.coord.state.global_version == rs.round_id
    assert h.coord.state.history[-1]["inner_steps_total"] == 3
    assert h.coord.state.history[-1]["outer_rule"].startswith("mean (outer warm-up")
    assert h.coord.metrics.registry.get_sample_value("crossdc_rounds_total") == 1.0
    # Round 2 (6 inner steps): Nesterov, its buffer restarted from round 1's mean:
    # b = 0.9 * 0.5 + 0.5 = 0.95, θ − lr (g + μ b) = θ − 0.5 * (0.5 + 0.855) = θ − 0.6775.
    rs2: RoundStart = h.expect(eu, RoundStart)
    h.expect(us, RoundStart)
    delta2 = decoded(merge_round(h, eu, us, rs2, base=rs.round_id))
    np.testing.assert_allclose(new["w"] + delta2["w"], new["w"] - 0.6775, rtol=1e-6)
    assert h.coord.state.history[-1]["inner_steps_total"] == 6
    assert h.coord.state.history[-1]["outer_rule"] == "nesterov lr=0.5 momentum=0.9"


@pytest.mark.parametrize("final_mean", [True, False])
def test_last_round_merges_by_the_plain_mean(final_mean: bool) -> None:
    # max_rounds = 2, no warm-up: round 1 is a Nesterov step (0.5 * 1.9 * 0.5), round 2 (the
    # last) the plain mean, unless outer_final_mean is off.
    with running(max_rounds=2, outer_warmup_steps=0, outer_final_mean=final_mean) as h:
        eu, us, rs = start_round(h)
        delta1 = decoded(merge_round(h, eu, us, rs))
        np.testing.assert_allclose(delta1["w"], np.full((2, 3), -0.475, np.float32), rtol=1e-6)
        rs2: RoundStart = h.expect(eu, RoundStart)
        h.expect(us, RoundStart)
        delta2 = decoded(merge_round(h, eu, us, rs2, base=rs.round_id))
        # Nesterov instead: b = 0.9 * 0.5 + 0.5, step 0.5 * (0.5 + 0.9 b) = 0.6775.
        expected = -0.5 if final_mean else -0.6775
        np.testing.assert_allclose(delta2["w"], np.full((2, 3), expected, np.float32), rtol=1e-6)
        assert h.coord.state is not None
        assert [e["outer_rule"] for e in h.coord.state.history] == [
            "nesterov lr=0.5 momentum=0.9",
            "mean (final round)" if final_mean else "nesterov lr=0.5 momentum=0.9",
        ]


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
        ("not_joined", update("ap", rid, ok), ErrorCode.NOT_JOINED),
    ]


@pytest.mark.parametrize("case", range(8))
def test_bad_update_is_rejected_with_error_counter_and_no_state_change(
    harness: Harness, case: int
) -> None:
    h = harness
    eu, _us, rs = start_round(h)
    reason, bad, code = _bad_updates(rs.round_id)[case]
    before_round, before_state = h.coord.open_round, h.coord.state
    sender = eu if bad.site_id == "eu" else h.site(bad.site_id)
    sender.send(bad)
    err: Error = h.expect(sender, Error)
    assert err.code == int(code), err.detail
    assert rejected(h.coord, reason) == 1.0
    assert h.coord.open_round == before_round and h.coord.state is before_state


def test_duplicate_update_is_rejected(harness: Harness) -> None:
    h = harness
    eu, _us, rs = start_round(h)
    ok = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    eu.send(update("eu", rs.round_id, ok))
    h.until(lambda: h.coord.open_round is not None and "eu" in h.coord.open_round.received)
    eu.send(update("eu", rs.round_id, ok))
    err: Error = h.expect(eu, Error)
    assert err.code == int(ErrorCode.DUPLICATE)
    assert rejected(h.coord, "duplicate") == 1.0


def test_model_mismatch_is_refused(harness: Harness) -> None:
    h = harness
    start_round(h)
    ap = h.site("ap")
    ap.send(Join(site_id="ap", model_fingerprint="other", global_version=-1, state_hash=""))
    err: Error = h.expect(ap, Error)
    assert err.code == int(ErrorCode.MODEL_MISMATCH)
    assert "ap" not in h.coord.members


def test_metrics_endpoint_serves_prometheus_text(harness: Harness) -> None:
    server = ObserveServer(
        registry=harness.coord.metrics.registry, status=harness.coord.status, port=0
    )
    server.start()
    try:
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert "crossdc_rounds_total" in body and "crossdc_members" in body
        status = (
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/status", timeout=5)
            .read()
            .decode()
        )
        assert harness.coord.session_id in status
    finally:
        server.close()


@pytest.mark.parametrize(
    ("history", "num_fragments", "expected"),
    [
        ([], 3, 0),
        ([{"fragment": 0, "num_fragments": 3}], 3, 1),
        ([{"fragment": 0, "num_fragments": 3}, {"fragment": 2, "num_fragments": 3}], 3, 0),
        ([{"fragment": 1, "num_fragments": 2}], 3, 0),  # the fragment count changed
        ([{"round_id": 4}], 2, 0),  # an entry from before fragments were recorded
    ],
)
def test_next_fragment_after_a_restart(
    history: list[dict[str, Any]], num_fragments: int, expected: int
) -> None:
    assert next_fragment(history, num_fragments) == expected


@pytest.mark.timeout(60)
def test_a_restarted_coordinator_keeps_the_fragment_rotation() -> None:
    store = MemoryStateStore()
    first = fragments(list(PARAMS), 2)[0]
    with running(store=store, num_fragments=2, num_inner_steps=6) as h:
        eu, us, rs = start_round(h)
        assert rs.fragment == 0
        part = {"eu": D_EU, "us": D_US}
        for site, weight in ((eu, 100.0), (us, 300.0)):
            delta = {k: part[site.site_id][k] for k in first}
            site.send(update(site.site_id, rs.round_id, delta, weight=weight))
        done: Global = h.expect(eu, Global)
        assert done.global_version == rs.round_id
        nxt: RoundStart = h.expect(eu, RoundStart)
        assert nxt.fragment == 1  # opened, then the coordinator stops before it completes
        digest = state_hash({k: PARAMS[k] + decoded(done).get(k, 0) for k in PARAMS})
    with running(store=store, num_fragments=2, num_inner_steps=6) as h:
        eu, us = h.site("eu"), h.site("us")
        for site in (eu, us):
            assert not join(h, site, version=done.global_version, digest=digest).need_init
        resumed: RoundStart = h.expect(eu, RoundStart)
        assert resumed.round_id > nxt.round_id  # ids are never reused
        assert resumed.fragment == 1  # the rotation goes on where the last completed round left it


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


@pytest.mark.timeout(60)
def test_a_site_that_lands_early_trains_extra_steps_in_the_next_round() -> None:
    clock = ManualClock()
    with running(clock=clock) as h:  # blocking rounds: one open at a time
        eu, us, rs = start_round(h)
        plans = []
        for _ in range(2):
            land(h, eu, rs, D_EU)
            clock.now += 1.0  # us lands a second after eu (step_seconds 0.3 in both updates)
            us.send(on_base("us", rs, D_US))
            h.expect(eu, Global)
            nxt_eu: RoundStart = h.expect(eu, RoundStart)
            nxt_us: RoundStart = h.expect(us, RoundStart)
            plans.append((nxt_eu.num_inner_steps, nxt_us.num_inner_steps))
            assert "us: +" not in nxt_eu.reason
            rs = nxt_eu
        # Round 2: eu fills 0.8 of the second it waited, floor(0.8 / 0.3) = 2 steps on the slot of
        # 3. Round 3: it still waited a second with those 2 steps (0.6 s), so it would have
        # waited 1.6 s without them: floor(0.8 x 1.6 / 0.3) = 4, capped at one more slot (3).
        assert plans == [(5, 3), (6, 3)]
        assert "eu: +3 steps (1.60s early)" in rs.reason
        assert h.coord.state is not None
        assert [e["extra_steps"] for e in h.coord.state.history] == [{}, {"eu": 2}]


@pytest.mark.timeout(60)
def test_extra_steps_already_planned_count_against_the_earliness() -> None:
    clock = ManualClock()
    with running(clock=clock, overlap=True) as h:  # the next round opens before this one closes
        eu, us, r1 = start_round(h)
        r2: RoundStart = h.expect(eu, RoundStart)
        h.expect(us, RoundStart)
        assert r2.round_id == r1.round_id + 1 and r2.num_inner_steps == 3
        rounds, steps = [r1, r2], []
        for i in range(3):  # rounds 1, 2 and 3 (planned when round 1 closed)
            rs = rounds[i]
            land(h, eu, rs, D_EU)
            clock.now += 1.0
            us.send(on_base("us", rs, D_US))
            nxt: RoundStart = h.expect(eu, RoundStart)
            rounds.append(nxt)
            steps.append(nxt.num_inner_steps)
        # After round 1: eu was 1 s early, 2 extra steps (0.6 s) for round 3. After round 2
        # (planned before any of that): again 1 s early, of which round 3's steps fill 0.6 s;
        # the 0.4 s left give floor(0.8 x 0.4 / 0.3) = 1 extra step for round 4. After round 3:
        # 1 s early, round 4's step takes 0.3 s: floor(0.8 x 0.7 / 0.3) = 1 for round 5.
        assert steps == [5, 4, 4]
        # Two rounds were in flight at once, yet no byte is counted twice and none is left out:
        # a round counts what crossed the socket since the previous result went out (the first,
        # since the start: the joins and the initial model). Everything received came before
        # the last close; after the last result, only RoundStarts went out.
        assert h.coord.state is not None and h.coord.chan is not None
        history, stats = h.coord.state.history, h.coord.chan.stats
        assert all(e["wire_bytes_in"] > 0 and e["wire_bytes_out"] > 0 for e in history)
        assert sum(e["wire_bytes_in"] for e in history) == stats.bytes_received
        assert sum(e["wire_bytes_out"] for e in history) <= stats.bytes_sent


class GatedStore(MemoryStateStore):
    """A store whose full saves block while ``gate`` is clear (a slow disk, deterministically)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def save(self, state: GlobalState) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        super().save(state)


def test_a_slow_save_leaves_the_loop_serving_and_holds_announcements() -> None:
    store = GatedStore()
    with running(store=store) as h:
        eu, us, rs = start_round(h)
        store.gate.clear()  # round 1's save will hang in the writer thread
        eu.send(update("eu", rs.round_id, D_EU))
        us.send(update("us", rs.round_id, D_US))
        h.until(lambda: h.coord.state is not None and h.coord.state.global_version == 1)
        # The loop still serves while the save is held: a heartbeat is taken in ...
        seen = h.coord.members["eu"].last_seen
        eu.send(Heartbeat(site_id="eu", global_version=0, sent_at=1.0))
        h.until(lambda: h.coord.members["eu"].last_seen > seen)
        for _ in range(200):
            h.coord.step(0.005)
            msg = eu.chan.recv(0.0)
            # ... but nothing goes out before the round's state is durable: not the result,
            # and not the echo either (it queues behind the save, in order).
            assert not isinstance(msg, Global | Heartbeat), msg
        assert store.state is not None and store.state.global_version == 0
        store.gate.set()
        result = h.expect(eu, Global)
        assert result.global_version == 1
        assert store.state is not None and store.state.global_version == 1
        assert isinstance(h.expect(eu, Heartbeat), Heartbeat)


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


def plans_resent(coord: Coordinator) -> float:
    return coord.metrics.registry.get_sample_value("crossdc_round_plans_resent_total") or 0.0


@pytest.mark.timeout(60)
def test_a_site_heard_from_after_a_silence_gets_the_plans_it_owes_again() -> None:
    clock = ManualClock()
    with running(clock=clock) as h:  # heartbeat timeout 10 s, site timeout 30 s
        eu, us, rs = start_round(h)
        land(h, eu, rs, D_EU)  # round 1 now waits on us only
        clock.now += 9.9  # shorter than the heartbeat timeout: the connection held, nothing lost
        assert heard(h, us) == [] and heard(h, eu) == []
        clock.now += 10.0  # as long as the heartbeat timeout: what was in flight may be lost
        again = heard(h, us)
        assert [type(m) for m in again] == [RoundStart], again
        plan = again[0]
        assert isinstance(plan, RoundStart)
        assert (plan.round_id, plan.participants, plan.num_inner_steps) == (1, ("eu", "us"), 3)
        assert heard(h, eu) == []  # eu sent its update: the round owes it nothing
        assert plans_resent(h.coord) == 1
        # The plan sent again is the plan: us's update for it closes the round.
        us.send(on_base("us", plan, D_US))
        assert h.expect(eu, Global).global_version == 1
        assert h.expect(us, RoundStart).round_id == 2  # blocking: round 2 opens on the result
        clock.now += 10.0
        # us owes round 2 and gets its plan again; nothing of the closed round 1 is sent again.
        again = heard(h, us)
        assert [m.round_id for m in again if isinstance(m, RoundStart)] == [2], again
        assert plans_resent(h.coord) == 2


class Reset:
    """An injector on the coordinator's socket: while ``on``, a send to ``site`` of a message
    ``kind`` fails as a send to a peer that is not connected (its connection was reset)."""

    def __init__(self, h: Harness, site: str, kind: type = object) -> None:
        assert h.coord.chan is not None
        self.chan, self.peer, self.kind = h.coord.chan, h.coord.members[site].peer, kind
        self.real, self.on, self.dropped = self.chan.send, True, 0
        self.chan.send = self._send  # type: ignore[method-assign]

    def _send(self, peer: bytes, msg: Message) -> bool:
        if self.on and peer == self.peer and isinstance(msg, self.kind):
            self.dropped += 1
            return False
        return self.real(peer, msg)


@pytest.mark.timeout(60)
def test_a_site_a_result_failed_to_reach_gets_the_deltas_when_heard_from() -> None:
    with running() as h:  # blocking rounds, both sites needed
        eu, us, rs = start_round(h)
        reset = Reset(h, "us")
        assert merge_round(h, eu, us, rs).global_version == 1
        h.until(lambda: reset.dropped == 1)
        # us missed v1, so it is not in sync, and round 2 (both sites needed) cannot open: the
        # federation would wait for us for good.
        assert not h.coord.members["us"].in_sync and h.coord.members["us"].global_version == 0
        assert h.coord.open_rounds == []
        reset.on = False
        got = heard(h, us)  # the connection is back: us is sent what it missed
        assert [type(m) for m in got] == [Global], got
        delta = got[0]
        assert isinstance(delta, Global)
        assert (delta.is_full, delta.base_version, delta.global_version) == (False, 0, 1)
        assert h.coord.members["us"].in_sync and h.coord.members["us"].global_version == 1
        plan: RoundStart = h.expect(us, RoundStart)
        assert (plan.round_id, plan.participants) == (2, ("eu", "us"))
        assert heard(h, us) == []  # once


@pytest.mark.timeout(60)
def test_a_plan_that_failed_to_reach_a_site_is_sent_when_it_is_heard_from() -> None:
    with running() as h:
        eu, us, rs = start_round(h)
        reset = Reset(h, "us", RoundStart)
        merge_round(h, eu, us, rs)
        h.expect(us, Global)
        plan_eu: RoundStart = h.expect(eu, RoundStart)
        assert reset.dropped == 1 and plan_eu.participants == ("eu", "us")
        reset.on = False
        got = heard(h, us)
        assert [(type(m), getattr(m, "round_id", 0)) for m in got] == [(RoundStart, 2)], got
        assert heard(h, us) == []
        assert plans_resent(h.coord) == 1


def test_a_site_that_built_the_same_initial_model_downloads_nothing(harness: Harness) -> None:
    h = harness
    eu, us = h.site("eu"), h.site("us")
    # eu is asked for the initial parameters; before they arrive, us joins saying it holds v0
    # with θ0's hash (it built θ0 from the federation's seed).
    assert join(h, eu).need_init
    assert not join(h, us, version=0, digest=state_hash(PARAMS)).need_init
    eu.send(
        InitParams(
            site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
        )
    )
    got: list[Message] = []
    for _ in range(400):
        h.coord.step(0.005)
        while (msg := us.chan.recv(0.0)) is not None:
            got.append(msg)
        if any(isinstance(m, RoundStart) for m in got):
            break
    # No model went to us: the round started on the θ0 it proved by hash.
    assert [type(m) for m in got] == [RoundStart], got
    assert got[0].global_version == 0 and got[0].participants == ("eu", "us")
    ap = h.site("ap")
    assert not join(h, ap, version=0, digest="not-theta0").need_init
    full = h.expect(ap, Global)  # a site whose θ0 differs gets the model
    assert full.is_full and full.state_hash == state_hash(PARAMS)


def test_a_coordinator_given_theta0_asks_no_site_to_upload_it() -> None:
    store = MemoryStateStore()
    with running(store=store, initial=InitialModel(PARAMS, "fp")) as h:
        # θ0 becomes durable at version 0 without any site.
        h.until(lambda: store.load() is not None)
        saved = store.load()
        assert saved is not None and saved.global_version == 0
        assert saved.model_fingerprint == "fp" and state_hash(saved.params) == state_hash(PARAMS)
        eu, us = h.site("eu"), h.site("us")
        assert not join(h, eu, version=0, digest=state_hash(PARAMS)).need_init
        assert not join(h, us, version=0, digest=state_hash(PARAMS)).need_init
        got: list[Message] = []
        for _ in range(400):
            h.coord.step(0.005)
            while (msg := us.chan.recv(0.0)) is not None:
                got.append(msg)
            if any(isinstance(m, RoundStart) for m in got):
                break
        assert [type(m) for m in got] == [RoundStart], got  # no model travelled
        ap = h.site("ap")
        assert not join(h, ap, version=0, digest="not-theta0").need_init
        full = h.expect(ap, Global)  # a site whose θ0 differs gets the model
        assert full.is_full and full.state_hash == state_hash(PARAMS)
        # An unrequested upload changes nothing.
        before = rejected(h.coord, "unexpected")
        zeros = {k: np.zeros_like(v) for k, v in PARAMS.items()}
        eu.send(
            InitParams(
                site_id="eu", model_fingerprint="fp", payload=encode_tensors(zeros, Fp32Codec())
            )
        )
        h.expect(eu, Error)
        assert rejected(h.coord, "unexpected") == before + 1
        assert h.coord.state is not None and state_hash(h.coord.state.params) == state_hash(PARAMS)


def test_a_site_of_another_model_is_refused_when_theta0_is_built() -> None:
    with running(initial=InitialModel(PARAMS, "fp-built")) as h:
        eu = h.site("eu")
        eu.send(Join(site_id="eu", model_fingerprint="fp", global_version=0, state_hash=""))
        err: Error = h.expect(eu, Error)
        assert err.code == ErrorCode.MODEL_MISMATCH and "fp-built" in err.detail


def test_a_state_dir_of_another_model_than_the_built_theta0_refuses_to_start() -> None:
    store = MemoryStateStore()
    with running(store=store, initial=InitialModel(PARAMS, "fp")):
        pass
    cfg = CoordinatorConfig(
        bind="tcp://127.0.0.1:0",
        state_dir="",
        metrics_port=0,
        security=SecurityConfig(insecure=True),
    )
    coord = Coordinator(cfg, store=store, initial=InitialModel(PARAMS, "other"))
    try:
        with pytest.raises(ValueError, match="initial_model describes model other.*holds model fp"):
            coord.start()
        assert coord.chan is None  # refused before binding anything
    finally:
        coord.close()


def two_rounds(h: Harness) -> tuple[Site, Site, Global, Global]:
    """eu and us merge two rounds; returns them and the two results (as eu received them)."""
    eu, us, rs = start_round(h)
    g1 = merge_round(h, eu, us, rs)
    h.expect(us, Global)
    rs2: RoundStart = h.expect(eu, RoundStart)
    h.expect(us, RoundStart)
    return eu, us, g1, merge_round(h, eu, us, rs2, base=rs.round_id)


def test_after_a_coordinator_restart_a_site_behind_still_gets_deltas(tmp_path: Path) -> None:
    """The delta log is durable: a site that missed the last broadcast before the coordinator
    restarted catches up by the delta, not the model."""
    store = MemoryStateStore()
    with running(store=store, state_dir=str(tmp_path), downlink_codec="int8") as h:
        _, us, g1, g2 = two_rounds(h)
    with running(store=store, state_dir=str(tmp_path), downlink_codec="int8") as h:
        us2 = h.site("us")
        welcome = join(h, us2, version=g1.global_version, digest=g1.state_hash)
        assert not welcome.need_init and welcome.global_version == g2.global_version
        got: Global = h.expect(us2, Global)
        assert not got.is_full and got.base_version == g1.global_version
        assert got.state_hash == g2.state_hash and got.signature == g2.signature
        for a, b in zip(got.payload, g2.payload, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=True))
        assert h.coord.metrics.registry.get_sample_value("crossdc_catch_up_deltas_total") == 1.0


def test_a_site_that_rejoins_behind_gets_the_deltas_since_its_version() -> None:
    with running(downlink_codec="int8") as h:
        _, us, g1, g2 = two_rounds(h)
        h.expect(us, Global)
        # us restarts from its checkpoint at v1 (it missed nothing else) and joins again.
        us2 = h.site("us")
        welcome = join(h, us2, version=g1.global_version, digest=g1.state_hash)
        assert not welcome.need_init and welcome.global_version == g2.global_version
        got: Global = h.expect(us2, Global)
        assert not got.is_full and got.base_version == g1.global_version
        assert got.global_version == g2.global_version and got.state_hash == g2.state_hash
        assert not got.evaluate  # the very delta broadcast, without the evaluation request
        for a, b in zip(got.payload, g2.payload, strict=True):
            assert a.codec == b.codec == "int8" and a.meta == b.meta
            assert all(np.array_equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=True))
        assert h.coord.metrics.registry.get_sample_value("crossdc_catch_up_deltas_total") == 1.0
        assert h.coord.book.members["us"].in_sync
        # A site whose v1 is not the federation's gets the whole model instead.
        ap = h.site("ap")
        join(h, ap, version=g1.global_version, digest="not-v1")
        full: Global = h.expect(ap, Global)
        assert full.is_full and full.state_hash == g2.state_hash


@pytest.mark.timeout(60)
def test_a_site_timed_out_is_forgotten_as_one_that_left() -> None:
    """Both removal paths (a Leave, the site timeout) drop what the coordinator kept about the
    site: its join claim, its scheduler view, its missed results and undelivered models."""
    clock = ManualClock()
    with running(clock=clock) as h:  # site timeout 30 s
        eu, us, rs = start_round(h)
        land(h, eu, rs, D_EU)
        coord = h.coord
        assert "us" in coord.intake.claims and "eu" in coord.planner.views
        coord.redelivery.missed("us")
        coord.redelivery.undelivered.add("us")
        for _ in range(4):  # eu keeps heartbeating; us stays silent past the site timeout
            clock.now += 10.0
            heard(h, eu)
        h.until(lambda: "us" not in coord.members)
        assert "us" not in coord.intake.claims and "us" not in coord.planner.views
        assert "us" not in coord.redelivery.missed_result
        assert "us" not in coord.redelivery.undelivered
        assert "eu" in coord.intake.claims
