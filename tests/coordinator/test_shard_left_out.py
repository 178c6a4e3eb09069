"""Two shards of a coordinator, in process over tcp loopback, when one site's update cannot be
merged whole: a shard refuses its part (a value that is not finite in a tensor only shard 1
owns), its parts are each within the norm bound but the whole update is not, or it sends its
part to shard 0 only. Shard 0 leaves the site out on both shards at the freeze (an Error to
the site, counted as ``left_out``), the round closes with the other sites, and the results
equal, bit for bit, a single coordinator's that refused that update (or never got it); the
next round merges the site again.

No timing: grace floor and ceiling are 0, so a round closes as soon as its quorum (2 of 3) is
in, and a site half-way is left out at once; each step waits for what it needs by pumping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import Error, Global, RoundStart, Update
from comm.wire.tensors import encode_tensors
from tests.coordinator.test_shard_service import (
    PARAMS,
    PARTS,
    _Federation,
    _join_all,
    _params_after,
    _sharded,
    _single,
    _update,
)

pytestmark = pytest.mark.timeout(90)

QUICK = {"quorum_fraction": 0.6, "grace_floor_s": 0.0, "grace_ceiling_s": 0.0, "max_rounds": 2}
BOUND = 1e6


def _nan_in_shard_1(rs: RoundStart) -> Update:
    """ap's update with a NaN in ``b``, a tensor only shard 1 owns (written into the encoded
    bytes: the codec itself refuses to encode one)."""
    assert "b" in PARTS[1] and "b" not in PARTS[0]
    msg = _update("ap", rs)
    payload = list(msg.payload)
    i = next(i for i, e in enumerate(payload) if e.name == "b")
    values = np.array(payload[i].buffers[0], copy=True)
    values[1] = np.nan
    payload[i] = replace(payload[i], buffers=(values,))
    return replace(msg, payload=tuple(payload))


def _norm_over_both(rs: RoundStart) -> Update:
    """ap's update of norm 1.13e6: 8e5 in ``w`` (shard 0) and 8e5 in ``b`` (shard 1), each part
    within the bound of 1e6, the whole over it."""
    assert "w" in PARTS[0] and "b" in PARTS[1]
    delta = {k: np.zeros_like(v) for k, v in PARAMS.items()}
    delta["w"][0, 0] = 8e5
    delta["b"][0] = 8e5
    return replace(_update("ap", rs), payload=encode_tensors(delta, Fp32Codec()))


CASES: dict[str, tuple[Callable[[RoundStart], Update] | None, str, str]] = {
    # (ap's update, why shard 0 leaves it out, why a single coordinator refuses it)
    "nan_in_a_tensor_of_shard_1": (
        _nan_in_shard_1,
        "shard 1 refused its part: tensor 'b' has non-finite values",
        "non_finite",
    ),
    "norm_over_the_bound_across_shards": (
        _norm_over_both,
        "update norm 1.13e+06 > bound 1e+06",
        "bad_payload",
    ),
    "part_sent_to_shard_0_only": (None, "shard 1 holds no part of it at the freeze", ""),
}


def _pump_until(fed: _Federation, done: Callable[[], bool], steps: int = 3000) -> None:
    for _ in range(steps):
        if done():
            return
        fed.pump()
    raise AssertionError("never came")


def _round_2(fed: _Federation) -> Global:
    """ap and eu send good updates (us none): the round closes with both at its quorum."""
    starts = {s: fed.expect(s, RoundStart) for s in ("ap", "eu")}
    assert starts["ap"].round_id == 2
    for s in ("ap", "eu"):
        fed.sites[s].link.send(_update(s, starts[s]))
    return fed.expect("eu", Global)


def _run_single(bad: Callable[[RoundStart], Update] | None, reason: str) -> list[Global]:
    """Round 1: ap's bad update (refused, counted under ``reason``) or none, then eu's and
    us's; round 2: ap and eu. The results."""
    with _single(**QUICK, max_update_norm=BOUND) as (fed, coord):
        _join_all(fed)
        starts = {s: fed.expect(s, RoundStart) for s in fed.sites}
        if bad is not None:
            fed.sites["ap"].link.send(bad(starts["ap"]))
            fed.expect("ap", Error)
            counted = coord.metrics.registry.get_sample_value(
                "crossdc_rejected_total", {"reason": reason}
            )
            assert counted == 1.0
        for s in ("eu", "us"):
            fed.sites[s].link.send(_update(s, starts[s]))
        results = [fed.expect("eu", Global)]
        results.append(_round_2(fed))
        return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_site_left_out_on_every_shard_gives_a_single_coordinators_results(case: str) -> None:
    bad, why, reason = CASES[case]
    single = _run_single(bad, reason)
    with _sharded(**QUICK, max_update_norm=BOUND) as (fed, lead, follow):
        _join_all(fed)
        starts = {s: fed.expect(s, RoundStart) for s in fed.sites}
        rid = starts["ap"].round_id
        ap = fed.sites["ap"].link
        if bad is not None:
            ap.send(bad(starts["ap"]))
            _pump_until(fed, lambda: "ap" in lead.plane.void(rid))
        else:  # ap's part reaches shard 0 only (its other part is lost with its channel)
            part0 = tuple(e for e in _update("ap", starts["ap"]).payload if e.name in PARTS[0])
            ap.links[0].send(replace(_update("ap", starts["ap"]), payload=part0))
            _pump_until(fed, lambda: lead.plane.partial(rid) == {"ap"})
        assert lead.coord.book.open_round(rid) is not None, "no close before the others sent"
        for s in ("eu", "us"):
            fed.sites[s].link.send(_update(s, starts[s]))
        first: Global = fed.expect("eu", Global)
        # ap is told its update was left out on every shard, and why.
        while True:
            err: Error = fed.expect("ap", Error)
            if "left out on every shard" in err.detail:
                break
        assert why in err.detail
        rejected = lead.coord.metrics.registry.get_sample_value(
            "crossdc_rejected_total", {"reason": "left_out"}
        )
        assert rejected == 1.0
        history = lead.coord.state.history if lead.coord.state else []
        assert [h["round_id"] for h in history] == [rid]
        # Neither shard holds anything of ap's update any more.
        for shard in (lead, follow):
            r = shard.coord.book.closed[rid]
            assert r.merged == {"eu", "us"} and r.received == {"eu", "us"}
            assert "ap" not in r.charges
        second = _round_2(fed)
        assert lead.committed == 2
        held = {**lead.coord.state.params, **follow.coord.state.params}  # type: ignore[union-attr]
    sharded = [first, second]
    assert [g.state_hash for g in sharded] == [g.state_hash for g in single]
    single_params, sharded_params = _params_after(single), _params_after(sharded)
    for k in PARAMS:
        assert sharded_params[k].tobytes() == single_params[k].tobytes()
        assert held[k].tobytes() == single_params[k].tobytes()
