"""Coordinator rounds in-process over tcp loopback: join, θ0, a round and its outer step, the
plain mean of a last round, the fragment rotation across a restart, arrival alignment (extra
steps), and announcements held behind a slow save."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from comm.codecs.floats import Fp32Codec
from comm.security.masking import SecAggConfig, x25519_public_bytes
from comm.security.secagg import SecAggSession, plan_from_message
from comm.wire.schema import (
    Global,
    Heartbeat,
    InitParams,
    RoundStart,
    Shutdown,
    Update,
)
from comm.wire.tensors import encode_tensors, fragments, state_hash
from coordinator.rounds import next_fragment
from coordinator.state import MemoryStateStore
from site_agent.payload import masked_payload
from tests.support.coordinator import (
    D_EU,
    D_US,
    PARAMS,
    GatedStore,
    Harness,
    ManualClock,
    decoded,
    join,
    land,
    merge_round,
    on_base,
    running,
    start_round,
    update,
)

pytestmark = pytest.mark.timeout(60)


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
    h.until(lambda: h.coord.status()["global_version"] == rs.round_id)
    assert h.coord.status()["state_hash"] == g_eu.state_hash  # what sites compare theirs with
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


def test_a_round_keeps_no_round_start_once_sent(harness: Harness) -> None:
    # A RoundStart is sent and not kept: under secure aggregation each carries every peer's
    # session key and certificate (O(n^2) a round), which closed rounds would otherwise hold up
    # to the staleness horizon.
    h = harness
    eu, us, rs = start_round(h)
    merge_round(h, eu, us, rs)
    h.expect(eu, RoundStart)
    rounds = [*h.coord.book.open_rounds, *h.coord.book.closed.values()]
    assert {r.round_id for r in rounds} == {rs.round_id, rs.round_id + 1}
    for r in rounds:
        held = [v for v in vars(r).values() for v in (v.values() if isinstance(v, dict) else [v])]
        assert not any(isinstance(v, RoundStart) for v in held), r.round_id


@pytest.mark.timeout(60)
def test_masked_rounds_plan_no_extra_steps_from_arrivals() -> None:
    # Secure aggregation: when a masked update lands does not time its site's training (a
    # re-run's survivors mask the update they already trained, with no new steps), so arrival
    # alignment plans nothing from it, however staggered the arrivals.
    clock = ManualClock()
    cfg = SecAggConfig(clip_bound=8.0)
    with running(clock=clock, secure_aggregation=cfg) as h:
        eu, us = h.site("eu"), h.site("us")
        keys = {s: X25519PrivateKey.generate() for s in ("eu", "us")}
        sessions = {}
        for site in (eu, us):
            public = x25519_public_bytes(keys[site.site_id]).hex()
            welcome = join(h, site, capabilities={"secagg_session_public": public})
            sessions[site.site_id] = SecAggSession(
                site_id=site.site_id,
                session_id=welcome.session_id,
                config=cfg,
                session_key=keys[site.site_id],
            )
            if welcome.need_init:
                site.send(
                    InitParams(
                        site_id=site.site_id,
                        model_fingerprint="fp",
                        payload=encode_tensors(PARAMS, Fp32Codec()),
                    )
                )

        def masked(site: str, rs: RoundStart, delta: dict[str, np.ndarray]) -> Update:
            attempt, peers = plan_from_message(rs.secagg)
            vectors = sessions[site].mask(
                delta, round_id=rs.round_id, participants=peers, attempt=attempt
            )
            return replace(on_base(site, rs, delta), payload=masked_payload(vectors, attempt))

        rs_eu: RoundStart = h.expect(eu, RoundStart)
        rs_us: RoundStart = h.expect(us, RoundStart)
        plans = []
        for _ in range(2):
            eu.send(masked("eu", rs_eu, D_EU))
            h.until(lambda: any("eu" in r.received for r in h.coord.open_rounds))
            clock.now += 1.0  # us lands a second after eu (step_seconds 0.3 in both updates)
            us.send(masked("us", rs_us, D_US))
            h.expect(eu, Global)
            rs_eu, rs_us = h.expect(eu, RoundStart), h.expect(us, RoundStart)
            plans.append((rs_eu.num_inner_steps, rs_us.num_inner_steps))
        assert plans == [(3, 3), (3, 3)], "a plain round gives eu 2 extra steps here"
        assert h.coord.state is not None
        assert [e["extra_steps"] for e in h.coord.state.history] == [{}, {}]
        assert [e["merged"] for e in h.coord.state.history] == [["eu", "us"]] * 2


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


def test_a_site_that_cannot_evaluate_is_never_asked() -> None:
    # eu, first by name, would be asked; it said at its join that it cannot evaluate.
    with running(eval_every_rounds=1) as h:
        eu, us, rs = start_round(h, evaluates=(False, True))
        g_eu = merge_round(h, eu, us, rs)
        g_us: Global = h.expect(us, Global)
        assert not g_eu.evaluate and g_us.evaluate


def test_without_a_site_that_evaluates_the_last_round_ends_at_once() -> None:
    # The final model's validation would be awaited for an hour; no member can give it.
    with running(max_rounds=1, final_eval_wait_s=3600.0) as h:
        eu, us, rs = start_round(h, evaluates=(False, False))
        g_eu = merge_round(h, eu, us, rs)
        assert not g_eu.evaluate and not h.expect(us, Global).evaluate
        assert h.expect(eu, Shutdown).reason == "completed 1 rounds"
        h.expect(us, Shutdown)
