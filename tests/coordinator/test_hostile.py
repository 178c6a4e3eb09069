"""A member's messages never stop the coordinator's loop: an update before θ0 exists, figures a
site reports that are not finite or out of range, a join that would change which tensors the
federation averages; each is refused by name, counted, and leaves the state as it was."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import Error, ErrorCode, Global, InitParams, Join, RoundStart, Update
from comm.wire.tensors import encode_tensors, state_hash
from coordinator.reported import RANGES, check_reported
from tests.support.coordinator import (
    PARAMS,
    Harness,
    join,
    merge_round,
    rejected,
    start_round,
    update,
)

pytestmark = pytest.mark.timeout(60)

OK = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}


def test_an_update_before_the_initial_model_is_refused_by_name(harness: Harness) -> None:
    h = harness
    eu, us = h.site("eu"), h.site("us")
    assert join(h, eu).need_init
    eu.send(update("eu", 1, OK))
    err: Error = h.expect(eu, Error)
    assert err.code == int(ErrorCode.UNEXPECTED) and "no global model" in err.detail
    assert rejected(h.coord, "unexpected") == 1.0
    assert h.coord.state is None and not h.coord.planner.views
    # The loop goes on: θ0 arrives and the first round opens.
    eu.send(
        InitParams(
            site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
        )
    )
    assert not join(h, us).need_init
    assert h.expect(us, Global).state_hash == state_hash(PARAMS)
    assert h.expect(eu, RoundStart).round_id == 1


BAD_FIGURES: list[tuple[str, float, ErrorCode]] = [
    ("link_rtt_s", math.inf, ErrorCode.NON_FINITE),
    ("link_rtt_s", math.nan, ErrorCode.NON_FINITE),
    ("link_rtt_s", -0.5, ErrorCode.OUT_OF_RANGE),
    ("step_seconds", 5e-324, ErrorCode.OUT_OF_RANGE),
    ("step_seconds", -1.0, ErrorCode.OUT_OF_RANGE),
    ("link_goodput_bps", 5e-324, ErrorCode.OUT_OF_RANGE),
    ("link_goodput_bps", math.inf, ErrorCode.NON_FINITE),
    ("weight", 1e300, ErrorCode.OUT_OF_RANGE),
    ("weight", 0.0, ErrorCode.OUT_OF_RANGE),
    ("weight", 1e-46, ErrorCode.OUT_OF_RANGE),  # float32 rounds it to 0: a NaN mean
    ("compute_seconds", -1.0, ErrorCode.OUT_OF_RANGE),
    ("train_loss", 1e300, ErrorCode.OUT_OF_RANGE),
]


@pytest.mark.parametrize(("name", "value", "code"), BAD_FIGURES)
def test_a_figure_out_of_range_refuses_the_update_and_rounds_go_on(
    harness: Harness, name: str, value: float, code: ErrorCode
) -> None:
    h = harness
    eu, us, rs = start_round(h)
    before_round, before_state = h.coord.open_round, h.coord.state
    eu.send(replace(update("eu", rs.round_id, OK), **{name: value}))
    err: Error = h.expect(eu, Error)
    assert err.code == int(code) and name in err.detail, err.detail
    assert rejected(h.coord, code.name.lower()) == 1.0
    assert h.coord.open_round == before_round and h.coord.state is before_state
    assert "eu" not in h.coord.planner.views
    # Both sites' good updates close the round and the next one opens: nothing the refused
    # update said reached the planner.
    merge_round(h, eu, us, rs)
    assert h.expect(eu, RoundStart).round_id == rs.round_id + 1


def _figures(**over: Any) -> Update:
    return replace(update("eu", 1, OK), **over)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"step_seconds": 0.0, "link_rtt_s": 0.0, "link_goodput_bps": 0.0},  # not measured
        {"train_loss": math.nan},  # no loss reported
        {"step_seconds": 2e-9, "link_goodput_bps": 1e12, "weight": 1e9},
    ],
)
def test_honest_figures_pass(over: dict[str, float]) -> None:
    assert check_reported(_figures(**over)) is None


@pytest.mark.parametrize("name", sorted(RANGES))
def test_each_figure_has_a_finite_range_and_infinity_is_refused(name: str) -> None:
    low, high, _ = RANGES[name]
    assert math.isfinite(low) and math.isfinite(high) and low < high
    refusal = check_reported(_figures(**{name: math.inf}))
    assert refusal is not None and refusal.code == ErrorCode.NON_FINITE and name in refusal.detail


SPEC = [["w", [2, 3], "float32"], ["b", [3], "float32"]]


def test_a_join_that_averages_other_tensors_is_refused_naming_one(harness: Harness) -> None:
    h = harness
    eu, us, ap = h.site("eu"), h.site("us"), h.site("ap")
    assert join(h, eu, capabilities={"state_spec": SPEC, "averaged": ["b"]}).need_init
    us.send(
        Join(
            site_id="us",
            model_fingerprint="fp",
            global_version=-1,
            state_hash="",
            capabilities={"state_spec": SPEC, "averaged": []},
        )
    )
    err: Error = h.expect(us, Error)
    assert err.code == int(ErrorCode.MODEL_MISMATCH) and "'b'" in err.detail, err.detail
    assert "us" not in h.coord.members and rejected(h.coord, "model_mismatch") == 1.0
    spec = h.coord.model.spec
    assert spec is not None and spec.averaged == frozenset({"b"})
    # The same list, or none declared, is welcome.
    join(h, ap, capabilities={"state_spec": SPEC, "averaged": ["b"]})
    join(h, us)
    assert {"eu", "us", "ap"} <= set(h.coord.members)
