"""The sparse broadcast on the wire: the coordinator forwards the round's encoded updates with
their weights, every site runs the coordinator's step on them and lands on its parameters bit for
bit; a malformed broadcast is refused naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from comm.codecs.broadcast import sparse_step
from comm.codecs.registry import get_codec
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import ErrorCode, Global
from comm.wire.tensors import decode_parts, encode_tensors, split_parts, state_hash
from coordinator.aggregate import sparse_outer_step
from coordinator.config import CoordinatorConfig
from coordinator.state import GlobalState
from coordinator.strategies.sparseloco import SparseLoCo
from tests.conftest import (
    Procs,
    read_status,
    sites_on_coordinator_hash,
    write_coordinator_config,
    write_site_config,
)

CODEC = "chunktopk:chunk=256,k=8,bits=2"
SHAPES = {"a.w": (40, 30), "b.w": (300,), "norm.running": (16,)}


def _params(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _state() -> GlobalState:
    params = _params(0)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    return GlobalState(
        params=params,
        momentum=zeros,
        residual=dict(zeros),
        global_version=4,
        round_counter=4,
        model_fingerprint="f",
    )


def _parts(n: int) -> list[tuple[float, tuple]]:
    codec = get_codec(CODEC)
    return [(100.0 + 37.0 * i, encode_tensors(_params(10 + i, 0.01), codec)) for i in range(n)]


def _global(st: GlobalState, step) -> Global:  # type: ignore[no-untyped-def]
    return Global(
        round_id=5,
        base_version=4,
        global_version=5,
        fragment=0,
        merged=("eu", "us", "ap"),
        is_full=False,
        state_hash=state_hash(step.state.params),
        signature=b"",
        evaluate=False,
        payload=step.encoded,
        part_weights=step.part_weights,
        outer_lr=step.outer_lr,
    )


def test_a_site_applying_the_broadcast_off_the_wire_lands_on_the_coordinators_params() -> None:
    st = _state()
    before = {k: v.copy() for k, v in st.params.items()}
    names = list(SHAPES)
    step = sparse_outer_step(
        SparseLoCo(lr=0.8), st, names, _parts(3), averaged=frozenset({"norm.running"})
    )
    # The step ran in place: the new state's arrays are the old state's, overwritten.
    assert all(step.state.params[k] is st.params[k] for k in SHAPES)
    msg = from_wire(to_wire(_global(st, step), session="s", seq=1))
    assert isinstance(msg, Global)
    assert msg.part_weights == (100.0, 137.0, 174.0) and msg.outer_lr == 0.8
    # What a site computes, from the frames alone.
    parts = decode_parts(msg.payload, msg.part_weights, {k: SHAPES[k] for k in SHAPES})
    site = sparse_step(before, parts, lr=msg.outer_lr, averaged=["norm.running"])
    assert state_hash(site) == msg.state_hash == state_hash(step.state.params)
    for k in SHAPES:
        assert np.array_equal(site[k], step.state.params[k])
    # The step is SparseLoCo's: θ − lr · weighted mean, statistics at lr 1; no residual kept.
    decoded = [d for _, d in parts]
    w = np.array([100.0, 137.0, 174.0]) / 411.0
    mean = {k: sum(np.float64(wi) * d[k] for wi, d in zip(w, decoded, strict=True)) for k in SHAPES}
    for k, lr in (("a.w", 0.8), ("norm.running", 1.0)):
        want = before[k] - lr * mean[k]
        np.testing.assert_allclose(step.state.params[k], want, rtol=0, atol=1e-6)
    assert all(not r.any() for r in step.state.residual.values())
    assert "sparse broadcast of 3 update(s)" in step.rule
    # Sparse: the three updates together are a small fraction of the dense fp32 delta.
    assert sum(e.nbytes for e in step.encoded) < 0.25 * sum(4 * v.size for v in before.values())


def _bad(payload: tuple, weights: tuple[float, ...], match: str) -> None:
    with pytest.raises(WireError, match=match) as err:
        decode_parts(payload, weights, SHAPES)
    assert err.value.code == ErrorCode.BAD_PAYLOAD


def test_a_malformed_sparse_broadcast_is_refused_naming_what_is_wrong() -> None:
    (w0, p0), (w1, p1) = _parts(2)
    _bad(p0 + p1, (), "no updates")
    _bad(p0 + p1, (1.0, 0.0), "must be > 0")
    _bad(p0 + p1, (1.0, float("nan")), "must be > 0")
    _bad(p0 + p1[:2], (1.0, 2.0), "do not split into 2 equal updates")
    _bad(p0 + (p1[1], p1[0], p1[2]), (1.0, 2.0), "update 1 names other tensors")
    renamed = tuple(
        type(e)(**{**vars(e), "name": "c.w"}) if i == 0 else e for i, e in enumerate(p0)
    )
    _bad(renamed, (1.0,), r"unknown tensors \['c.w'\]")
    reshaped = tuple(
        type(e)(**{**vars(e), "shape": (30, 40)}) if i == 0 else e for i, e in enumerate(p0)
    )
    _bad(reshaped, (1.0,), "'a.w' has shape")
    assert [w for w, _ in split_parts(p0 + p1, (w0, w1))] == [w0, w1]


def test_the_sparse_broadcast_needs_sparseloco_and_names_the_field() -> None:
    from comm.security.rolekits import SecurityConfig

    insecure = SecurityConfig(insecure=True)
    with pytest.raises(ValueError, match="broadcast must be 'dense' or 'sparse'"):
        CoordinatorConfig(security=insecure, outer_strategy="sparseloco", broadcast="topk")
    with pytest.raises(ValueError, match="broadcast = 'sparse' needs coordinator.outer_strategy"):
        CoordinatorConfig(security=insecure, broadcast="sparse")
    cfg = CoordinatorConfig(security=insecure, outer_strategy="sparseloco", broadcast="sparse")
    assert cfg.broadcast == "sparse"


@pytest.mark.timeout(300)
def test_a_federation_on_the_sparse_broadcast_keeps_every_site_on_the_coordinators_hash(
    procs: Procs, tmp_path: Path
) -> None:
    cfg = write_coordinator_config(
        tmp_path,
        max_rounds=3,
        outer_strategy="sparseloco",
        outer_lr=1.0,
        broadcast="sparse",
        uplink_codec="chunktopk:chunk=1024,k=64,bits=2",
    )
    procs.start("coordinator", "coordinator", "--config", str(cfg))
    for i, site in enumerate(["eu", "us"]):
        site_cfg = write_site_config(tmp_path, site, i, 2, error_feedback_decay=0.95)
        procs.start(f"site-{site}", "agent", "--config", str(site_cfg))
    state = sites_on_coordinator_hash(procs, tmp_path, ("eu", "us"), 3)["state"]
    assert all(not r.any() for r in state.residual.values())  # nothing kept for a downlink
    logs = procs.log("site-eu") + procs.log("site-us")
    assert "hash_mismatch" not in logs and "asking for the model" not in logs
    status = read_status(tmp_path)
    assert status is not None
    history = status["history"]
    assert len(history) == 3
    assert all("sparse broadcast of 2 update(s)" in h["outer_rule"] for h in history)
    raw = 4 * sum(v.size for v in state.params.values())
    # Each round's broadcast (both updates to both sites, headers and all) is far below the
    # dense fp32 model the same two sites would otherwise be sent.
    assert all(h["broadcast_bytes"] < 0.25 * 2 * raw for h in history), history


def test_bench_wan_checks_the_sparse_setting_before_any_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from crossdc.bench.wan import main

    assert main(["--broadcast", "sparse"]) == 2
    assert "--broadcast sparse needs --outer-strategy sparseloco" in capsys.readouterr().err
    assert main(["--uplink-codec", "chunktopk:k=0"]) == 2
    assert "--uplink-codec" in capsys.readouterr().err
    bad_decay = ["--outer-strategy", "sparseloco", "--error-feedback-decay", "1.5"]
    assert main(bad_decay) == 2
    assert "--error-feedback-decay must be in [0, 1]" in capsys.readouterr().err
