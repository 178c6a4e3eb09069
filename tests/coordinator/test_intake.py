"""What the coordinator takes in: every bad update refused with an Error naming it, a counter
and no change of state; duplicates; another model refused at join naming the difference; θ0
proved by hash or built by the launcher; the /metrics endpoint; and one way to forget a site
that left or went silent."""

from __future__ import annotations

import math
import urllib.request
from dataclasses import replace

import numpy as np
import pytest

from comm.codecs.base import EncodedTensor
from comm.codecs.floats import Fp32Codec
from comm.codecs.registry import get_codec
from comm.ops.observe import ObserveServer
from comm.security.rolekits import SecurityConfig
from comm.wire.schema import (
    Error,
    ErrorCode,
    Global,
    Heartbeat,
    InitParams,
    Join,
    Leave,
    Message,
    RoundStart,
)
from comm.wire.tensors import encode_tensors, state_hash
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator, InitialModel
from coordinator.state import MemoryStateStore
from tests.support.coordinator import (
    D_EU,
    D_US,
    PARAMS,
    Harness,
    ManualClock,
    _bad_updates,
    heard,
    join,
    land,
    rejected,
    running,
    start_round,
    update,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("case", range(9))
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


def test_an_initial_model_in_another_codec_than_fp32_is_refused(harness: Harness) -> None:
    """θ0 has no shapes to be checked against: in a sparse codec a few bytes could claim any
    size (a topk tensor of 2^31 elements is 9 bytes of values and indices), so only fp32,
    what sites send, is decoded."""
    h = harness
    eu = h.site("eu")
    assert join(h, eu).need_init
    bomb = EncodedTensor(
        name="w",
        shape=(1 << 31,),
        codec="topk:0.01",
        meta={"k": 1, "values": "fp32"},
        buffers=(np.ones(1, np.float32), np.zeros(1, np.uint32)),
    )
    for payload in ((bomb,), encode_tensors(PARAMS, get_codec("fp16"))):
        eu.send(InitParams(site_id="eu", model_fingerprint="fp", payload=payload))
        err: Error = h.expect(eu, Error)
        assert err.code == int(ErrorCode.BAD_PAYLOAD) and "expected ['fp32']" in err.detail
    assert h.coord.state is None
    eu.send(
        InitParams(
            site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
        )
    )
    h.until(lambda: h.coord.state is not None)


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


@pytest.mark.timeout(60)
def test_a_site_timed_out_is_forgotten_as_one_that_left() -> None:
    """Both removal paths (a Leave, the site timeout) drop what the coordinator kept about the
    site: its join claim, its scheduler view, and what its channel held for it."""
    clock = ManualClock()
    with running(clock=clock) as h:  # site timeout 30 s
        eu, us, rs = start_round(h)
        land(h, eu, rs, D_EU)
        coord = h.coord
        assert "us" in coord.intake.claims and "eu" in coord.planner.views
        chan, peer = coord.post.chan, coord.members["us"].peer
        assert chan is not None and peer in chan.out_streams and peer in chan.in_streams
        for _ in range(4):  # eu keeps heartbeating; us stays silent past the site timeout
            clock.now += 10.0
            heard(h, eu)
        h.until(lambda: "us" not in coord.members)
        assert "us" not in coord.intake.claims and "us" not in coord.planner.views
        assert peer not in chan.out_streams and peer not in chan.in_streams
        assert "eu" in coord.intake.claims


def test_a_heartbeat_after_leave_is_echoed_not_refused() -> None:
    # The site's link asks for the acknowledgement of its LEAVE with a heartbeat; that is no
    # message from a stranger, so it is echoed, not refused (crossdc_rejected_total feeds an alert).
    with running() as h:
        eu, us, _ = start_round(h)
        eu.send(Leave(site_id="eu", reason="the training loop ended"))
        h.until(lambda: "eu" not in h.coord.members)
        assert heard(h, eu) == []
        assert rejected(h.coord, "not_joined") == 0.0
        ap = h.site("ap")  # a site that never joined is still told to join
        ap.send(Heartbeat(site_id="ap", global_version=0, sent_at=1.0))
        error: Error = h.expect(ap, Error)
        assert error.code == ErrorCode.NOT_JOINED and rejected(h.coord, "not_joined") == 1.0


def test_a_site_that_reports_no_train_loss_is_left_out_of_the_mean() -> None:
    # eu's loop recorded no loss (NaN): the round's loss is us's alone, not (100 * 0 + 300 * 2) / 400.
    with running() as h:
        eu, us, rs = start_round(h)
        eu.send(replace(update("eu", rs.round_id, D_EU, weight=100.0), train_loss=math.nan))
        us.send(update("us", rs.round_id, D_US, weight=300.0))
        h.expect(eu, Global)
        assert rejected(h.coord, "non_finite") == 0.0
        assert h.coord.state is not None and h.coord.state.history[-1]["train_loss"] == 2.0


@pytest.mark.parametrize(
    ("losses", "expected"), [((1.0, 3.0), 2.5), ((math.nan, 3.0), 3.0), ((math.nan,) * 2, None)]
)
def test_mean_train_loss_weighs_the_sites_that_reported_one(
    losses: tuple[float, float], expected: float | None
) -> None:
    from coordinator.closing import mean_train_loss
    from coordinator.round import Accepted

    updates = [
        Accepted(s, 1, w, x, 1.0, 0) for s, w, x in zip("ab", (1.0, 3.0), losses, strict=True)
    ]
    assert mean_train_loss(updates) == expected
