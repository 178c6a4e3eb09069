"""Streaming aggregation: a float32 running weighted sum equals the weighted mean of the
updates it folded in up to float32 rounding, holds one model's worth of memory however many it
took, folds an encoded update without a float copy of it, and (:class:`MeanFold`) gives the same
sum bit for bit whichever order the updates arrive in."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.codecs.registry import get_codec
from comm.wire.schema import ErrorCode
from comm.wire.tensors import check_payload, encode_slice, encode_tensors
from coordinator.aggregate import MeanFold, Refused, RunningSum, WeightedMean
from coordinator.strategies.base import weighted_mean

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(min_value=0.01, max_value=1e4), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_running_mean_is_the_weighted_mean_in_any_order(weights: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    updates = [
        (w, {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5)})
        for w in weights
    ]
    forward, backward = RunningSum(), RunningSum()
    for w, x in updates:
        forward.add(w, x)
    for w, x in reversed(updates):
        backward.add(w, x)
    reference = weighted_mean(updates)
    # Both sides are float32 arithmetic. Ours: each weight and each product w·x rounded (u =
    # eps / 2 each), n - 1 additions with a partial sum below Σ w·|x| (u each), the total weight
    # rounded and the division: at most (n + 3) u relative to Σ w·|x| / Σ w <= scale. The
    # reference's error is as large again.
    n, eps = len(updates), float(np.finfo(np.float32).eps)
    for name in ("a", "b"):
        scale = max(float(np.max(np.abs(x[name]))) for _, x in updates)
        for got in (forward.mean()[name], backward.mean()[name]):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, reference[name], rtol=0, atol=(n + 3) * eps * scale)
    assert forward.weight == pytest.approx(sum(weights)) and forward.count == n


def test_memory_is_one_model_however_many_updates() -> None:
    model = {"w": np.ones((100, 100), np.float32)}
    total = RunningSum()
    total.add(1.0, model)
    one = total.nbytes
    for _ in range(63):
        total.add(2.0, model)
    assert total.nbytes == one and total.count == 64


def test_bad_updates_are_refused_and_change_nothing() -> None:
    total = RunningSum()
    total.add(1.0, {"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="weight"):
        total.add(float("nan"), {"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="other tensors"):
        total.add(1.0, {"v": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="no updates"):
        RunningSum().mean()
    assert total.count == 1 and total.weight == 1.0
    np.testing.assert_array_equal(total.mean()["w"], np.ones(3, np.float32))


SHAPES = {"emb": (40, 24), "norm": (24,)}


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


@pytest.mark.parametrize("spec", ["fp32", "fp16", "int8:block=64", "int4", "int2", "topk:0.2"])
def test_an_encoded_update_folds_as_its_decode_does_bit_for_bit(spec: str) -> None:
    codec = get_codec(spec)
    payloads = [encode_tensors(_update(i), codec) for i in range(3)]
    decoded, encoded = RunningSum(), RunningSum()
    for i, payload in enumerate(payloads):
        weight = 10.0 * i + 3.7
        decoded.add(weight, {e.name: codec.decode(e) for e in payload})
        pieces, _ = check_payload(payload, SHAPES)
        encoded.add_encoded(weight, pieces, SHAPES)
    for name in SHAPES:
        assert decoded.tensor_mean(name).tobytes() == encoded.tensor_mean(name).tobytes()
    assert encoded.names == list(SHAPES) and encoded.count == 3


def test_slices_fold_at_their_rows() -> None:
    codec = get_codec("int4")
    x = _update(1)
    pieces = [encode_slice("emb", x["emb"][a:b], a, codec) for a, b in [(0, 8), (8, 40)]]
    payload = [*pieces, *encode_tensors({"norm": x["norm"]}, codec)]
    total = RunningSum()
    total.add_encoded(2.0, check_payload(payload, SHAPES, slices=True)[0], SHAPES)
    whole = RunningSum()
    whole.add(2.0, {e.name: codec.decode(e) for e in encode_tensors(x, codec)})
    for name in SHAPES:
        assert total.tensor_mean(name).tobytes() == whole.tensor_mean(name).tobytes()


def test_folding_an_encoded_update_makes_no_copy_of_the_model() -> None:
    """The second update of a 16M-parameter model (64 MiB of float32) folds in with a few
    tiles' worth of temporaries: decoding it whole would take 64 MiB."""
    shapes = {"w": (4096, 4096)}
    codec = get_codec("int4")
    x = np.random.default_rng(0).standard_normal(shapes["w"]).astype(np.float32)
    payload = encode_tensors({"w": x}, codec)
    fold = MeanFold(1e9, ["eu", "us"])
    assert isinstance(fold.add("eu", 1.0, payload, shapes), str)
    tracemalloc.start()
    try:
        assert isinstance(fold.add("us", 2.0, payload, shapes), str)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fold.sum.count == 2
    assert peak < 16 << 20, peak


@settings(max_examples=25, deadline=None)
@given(
    order=st.permutations(["ap", "eu", "us", "sa"]),
    sent=st.sets(st.sampled_from(["ap", "eu", "us", "sa"]), min_size=1),
)
def test_the_fold_is_the_same_bit_for_bit_whatever_the_arrival_order(
    order: list[str], sent: set[str]
) -> None:
    """Updates arriving in any order, some participants sending nothing: the same sum as the
    same updates arriving in the participants' order."""
    codec = get_codec("int8")
    payloads = {s: encode_tensors(_update(i), codec) for i, s in enumerate(sorted(order))}
    weights = {s: 1.0 + 0.37 * i for i, s in enumerate(sorted(order))}
    participants = ["us", "eu", "sa", "ap"]

    def run(arrivals: list[str]) -> dict[str, bytes]:
        fold = MeanFold(1e9, participants)
        for s in arrivals:
            assert isinstance(fold.add(s, weights[s], payloads[s], SHAPES), str)
        fold.fold_waiting()
        assert fold.sum.count == len(arrivals)
        return {n: fold.sum.tensor_mean(n).tobytes() for n in SHAPES}

    assert run([s for s in order if s in sent]) == run(sorted(sent))


def test_an_update_ahead_of_its_turn_waits_encoded() -> None:
    codec = get_codec("int4")
    payloads = {s: encode_tensors(_update(i), codec) for i, s in enumerate(["a", "b", "c"])}
    fold = MeanFold(1e9, ["a", "b", "c"])
    assert isinstance(fold.add("c", 1.0, payloads["c"], SHAPES), str)
    assert isinstance(fold.add("b", 1.0, payloads["b"], SHAPES), str)
    encoded = sum(e.nbytes for s in "bc" for e in payloads[s])
    assert fold.sum.count == 0 and fold.nbytes == encoded  # nothing summed yet
    assert isinstance(fold.add("a", 1.0, payloads["a"], SHAPES), str)
    assert fold.sum.count == 3 and fold.nbytes == fold.sum.nbytes


def test_a_refused_update_changes_nothing_and_blocks_no_one() -> None:
    codec = get_codec("fp32")
    fold = MeanFold(1e9, ["a", "b"])
    bad = list(encode_tensors(_update(0), codec))
    values = np.array(bad[1].buffers[0], copy=True)
    values[3] = np.nan
    bad[1] = type(bad[1])(name="norm", shape=(24,), codec="fp32", buffers=(values,))
    refused = fold.add("a", 1.0, bad, SHAPES)
    assert isinstance(refused, Refused) and "'norm'" in refused.detail
    assert fold.sum.count == 0 and fold.nbytes == 0
    assert isinstance(fold.add("b", 1.0, encode_tensors(_update(1), codec), SHAPES), str)
    result = fold.result("1", [])
    assert result.count == 1 and fold.sum.count == 1


def test_an_update_that_could_overflow_the_float32_sum_is_refused() -> None:
    """No norm bound (inf): an update whose weight times norm could overflow the float32 sum
    is refused as out of range, and the fold goes on with the next."""
    codec = get_codec("fp32")
    fold = MeanFold(float("inf"), ["a", "b"])
    huge = {n: v * np.float32(1e25) for n, v in _update(0).items()}
    refused = fold.add("a", 1e15, encode_tensors(huge, codec), SHAPES)
    assert isinstance(refused, Refused) and refused.code == ErrorCode.OUT_OF_RANGE
    assert "overflow" in refused.detail and fold.sum.count == 0 and fold.nbytes == 0
    assert isinstance(fold.add("b", 1e15, encode_tensors(_update(1), codec), SHAPES), str)
    fold.result("1", [])
    assert all(np.isfinite(fold.sum.tensor_mean(n)).all() for n in SHAPES)


def test_late_updates_wait_and_fold_by_site_at_the_result() -> None:
    codec = get_codec("int8")
    sums = []
    for arrivals in itertools.permutations(["x", "y", "z"]):
        fold = MeanFold(1e9)
        for s in arrivals:
            seed = "xyz".index(s)
            assert isinstance(
                fold.add(s, 1.0 + seed, encode_tensors(_update(seed), codec), SHAPES), str
            )
            assert fold.sum.count == 0
        fold.result("1", [])
        sums.append(fold.sum.tensor_mean("emb").tobytes())
    assert len(set(sums)) == 1


def test_a_dropped_sum_lends_its_arrays_to_the_next_round() -> None:
    """A closed round's sum goes back to the aggregator's pool and the next round's sum writes
    into those arrays (stale values and all): the same means as sums of fresh arrays."""
    codec = get_codec("int4")
    payloads = [encode_tensors(_update(i), codec) for i in range(3)]
    aggregator = WeightedMean(1e9)
    alone = []
    previous: dict[str, int] = {}
    for r in range(3):
        fold = aggregator.fold(r, ["a"])
        assert isinstance(fold, MeanFold)
        assert isinstance(fold.add("a", 2.0 + r, payloads[r], SHAPES), str)
        got = {n: fold.sum.tensor_mean(n).tobytes() for n in SHAPES}
        arrays = {n: id(a) for n, a in fold.sum._sum.items()}
        assert not previous or arrays == previous  # the pool's arrays, reused
        previous = arrays
        fresh = MeanFold(1e9, ["a"])
        fresh.add("a", 2.0 + r, payloads[r], SHAPES)
        alone.append(got == {n: fresh.sum.tensor_mean(n).tobytes() for n in SHAPES})
        del fold
        assert aggregator.sums.nbytes == 4 * (40 * 24 + 24)
    assert all(alone)
