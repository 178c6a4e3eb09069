"""Updates of a sharded site: its tensors come as slices of their rows, which the weighted mean
folds to the same mean as whole tensors; slices that do not cover a tensor exactly once
are refused, and aggregators that take whole tensors only refuse them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.wire.schema import Error, ErrorCode, Global
from comm.wire.tensors import encode_slice, encode_tensors
from coordinator.aggregate import ForwardFold, MeanFold, Refused
from coordinator.secure_aggregation import MaskedFold
from tests.support.coordinator import PARAMS, Harness, rejected, running, start_round, update
from tests.support.secagg import CFG, make_plan, make_sessions

pytestmark = pytest.mark.timeout(60)

RNG = np.random.default_rng(35)
SHAPES = {"emb": (12, 64), "norm": (128,)}


def _delta(scale: float) -> dict[str, np.ndarray]:
    return {n: (scale * RNG.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}


def _sliced(
    delta: Mapping[str, np.ndarray], cuts: Mapping[str, Sequence[int]], spec: str = "fp32"
) -> tuple[EncodedTensor, ...]:
    """Each tensor as a sharded site's ranks send it: rows between ``cuts``, in rank order."""
    codec = get_codec(spec)
    out: list[EncodedTensor] = []
    for name, value in delta.items():
        edges = [0, *cuts[name], value.shape[0]]
        for a, b in zip(edges, edges[1:], strict=False):
            out.append(encode_slice(name, value[a:b], a, codec))
    return tuple(out)


@pytest.mark.parametrize("spec", ["fp32", "int8:block=64"])
def test_a_sliced_update_folds_to_the_sum_of_the_whole_one_bit_for_bit(spec: str) -> None:
    """One site sends whole tensors, another the same kind of update in 2-3 slices per tensor
    (on the block grid): the mean is bit for bit those of two whole
    updates, the fold being elementwise in the same order."""
    codec = get_codec(spec)
    one, two = _delta(0.1), _delta(0.3)
    cuts = {"emb": [4, 9], "norm": [64]}  # 4 x 64, 9 x 64 and 64: on the grid of 64
    sliced, whole = MeanFold(1e6, ["one", "two"]), MeanFold(1e6, ["one", "two"])
    for fold, second in ((sliced, _sliced(two, cuts, spec)), (whole, encode_tensors(two, codec))):
        assert isinstance(fold.add("one", 100.0, encode_tensors(one, codec), SHAPES), str)
        assert isinstance(fold.add("two", 300.0, second, SHAPES), str)
    assert (sliced.count, sliced.weight) == (whole.count, whole.weight) == (2, 400)
    got, want = sliced.mean(), whole.mean()
    for name in SHAPES:
        assert got[name].tobytes() == want[name].tobytes()


def test_the_norm_bound_covers_the_whole_update_across_its_slices() -> None:
    """Three slices of norm 1 each are an update of norm sqrt(3): over a bound of 1.5."""
    rows = np.zeros((3, 4), np.float32)
    rows[:, 0] = 1.0
    payload = tuple(encode_slice("w", rows[i : i + 1], i, get_codec("fp32")) for i in range(3))
    fold = MeanFold(1.5)
    refused = fold.add("eu", 1.0, payload, {"w": (3, 4)})
    assert isinstance(refused, Refused) and "update norm 1.73 > bound 1.5" in refused.detail
    assert fold.count == 0 and fold.nbytes == 0
    assert isinstance(MeanFold(1.8).add("eu", 1.0, payload, {"w": (3, 4)}), str)


def test_the_sparse_forward_and_secure_aggregation_refuse_slices() -> None:
    payload = _sliced(_delta(0.1), {"emb": [6], "norm": []})
    forward = ForwardFold(1e6)
    refused = forward.add("eu", 1.0, payload, SHAPES)
    assert isinstance(refused, Refused) and refused.code == ErrorCode.BAD_PAYLOAD
    assert (
        refused.detail
        == "tensor 'emb' comes in slices: the sparse broadcast forwards whole tensors"
    )
    assert not forward.kept
    masked = MaskedFold(CFG, make_plan(make_sessions(["eu", "us"], CFG)))
    refused = masked.add("eu", 1.0, payload, SHAPES)
    assert isinstance(refused, Refused) and refused.code == ErrorCode.BAD_PAYLOAD
    assert "'emb' comes in slices: masked updates are of whole tensors" in refused.detail
    assert not masked.sum.senders


def _round_with(h: Harness, us_payload: tuple[EncodedTensor, ...]) -> dict[str, np.ndarray]:
    """eu sends a whole update, us ``us_payload``; the coordinator's parameters after the close."""
    eu, us, rs = start_round(h)
    eu.send(update("eu", rs.round_id, EU, weight=100.0))
    us.send(update("us", rs.round_id, us_payload, weight=300.0))
    result: Global = h.expect(eu, Global)
    assert result.merged == ("eu", "us")
    assert h.coord.state is not None
    return h.coord.state.params


EU = {n: (0.1 * RNG.standard_normal(v.shape)).astype(np.float32) for n, v in PARAMS.items()}
US = {n: (0.1 * RNG.standard_normal(v.shape)).astype(np.float32) for n, v in PARAMS.items()}


def test_a_round_of_a_whole_and_a_sharded_site_lands_where_two_whole_ones_do() -> None:
    """Through the coordinator's socket: the same parameters, bit for bit, whether us sends its
    update whole or as its ranks' slices."""
    assert {n: v.shape for n, v in PARAMS.items()} == {"w": (2, 3), "b": (3,)}
    with running() as h:
        whole = _round_with(h, encode_tensors(US, get_codec("fp32")))
    with running() as h:
        sharded = _round_with(h, _sliced(US, {"w": [1], "b": [1, 2]}))
    assert whole.keys() == sharded.keys()
    for name in whole:
        assert whole[name].tobytes() == sharded[name].tobytes()


@pytest.mark.parametrize(
    ("cuts", "detail"),
    [
        ({"w": [(0, 1)], "b": [(0, 3)]}, "tensor 'w': rows 1:2 missing"),
        ({"w": [(0, 2), (1, 2)], "b": [(0, 3)]}, "tensor 'w': rows 1:2 overlap rows before 2"),
        ({"w": [(0, 2)], "b": [(0, 2), (2, 4)]}, "tensor 'b': rows 2:4 beyond its 3 rows"),
        ({"w": [(0, 2)], "b": [(0, 3), None]}, "tensor 'b' comes whole and in slices"),
    ],
)
def test_slices_not_covering_a_tensor_once_are_refused_with_a_counter_and_no_change(
    harness: Harness, cuts: dict[str, list[tuple[int, int] | None]], detail: str
) -> None:
    h = harness
    eu, us, rs = start_round(h)
    fp32 = get_codec("fp32")
    padded = {n: np.zeros((v.shape[0] + 1, *v.shape[1:]), np.float32) for n, v in US.items()}
    payload = tuple(
        fp32.encode(name, US[name])
        if rows is None
        else encode_slice(name, padded[name][rows[0] : rows[1]], rows[0], fp32)
        for name, pieces in cuts.items()
        for rows in pieces
    )
    before_round, before_state = h.coord.open_round, h.coord.state
    us.send(update("us", rs.round_id, payload))
    err: Error = h.expect(us, Error)
    assert err.code == int(ErrorCode.BAD_PAYLOAD) and detail in err.detail
    assert rejected(h.coord, "bad_payload") == 1.0
    assert h.coord.open_round == before_round and h.coord.state is before_state
    assert h.coord.open_round is not None and "us" not in h.coord.open_round.received
    # Nothing of the refused update stuck: the same site's good sliced update is taken.
    us.send(update("us", rs.round_id, _sliced(US, {"w": [1], "b": [2]})))
    h.until(lambda: h.coord.open_round is not None and "us" in h.coord.open_round.received)
    eu.send(update("eu", rs.round_id, EU))
    assert h.expect(eu, Global).merged == ("eu", "us")
